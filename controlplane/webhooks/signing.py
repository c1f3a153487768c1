"""What a webhook receiver checks, and how we sign (pure functions, no Django).

Every delivery carries

    X-Releasegate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256>

where the HMAC is keyed with the webhook's secret over `<t>.` followed by the exact
request body bytes. A receiver recomputes it, compares in constant time, and refuses
a timestamp older than its tolerance (replays). `verify_signature` does exactly that.
"""

import hashlib
import hmac

SIGNATURE_HEADER = "X-Releasegate-Signature"
EVENT_HEADER = "X-Releasegate-Event"
DELIVERY_HEADER = "X-Releasegate-Delivery"
DEFAULT_TOLERANCE_S = 300


def signature(secret: str, timestamp: int, body: bytes) -> str:
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signature_header(secret: str, timestamp: int, body: bytes) -> str:
    return f"t={timestamp},v1={signature(secret, timestamp, body)}"


def verify_signature(
    secret: str,
    header: str,
    body: bytes,
    *,
    now: float,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
) -> bool:
    """True when `header` signs `body` with `secret` at a time within `tolerance_s`
    of `now` (unix seconds)."""
    fields = dict(
        part.split("=", 1) for part in header.split(",") if part.count("=") == 1
    )
    try:
        timestamp = int(fields["t"])
    except (KeyError, ValueError):
        return False
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = signature(secret, timestamp, body)
    return hmac.compare_digest(expected, fields.get("v1", ""))
