"""Who sent a message: Ed25519 identities and seals over agent <-> control plane
messages (torch-free, Django-free; both sides import it).

Every agent holds its own Ed25519 key pair (created on first start, mode 0600);
its identity is the fingerprint of its public key: the sha256 of the raw 32-byte
key, in hex. The control plane holds one key of its own for job requests.

A message travels as (body, ..., seal): the seal is a `protocol.Seal` whose
fields bind the message's type, job id, attempt, job kind, release id, the
sender's fingerprint, the sha256 of the body's canonical encoding, a timestamp
and a random nonce, signed over their canonical encoding (JSON, sorted keys, no
spaces). `check_seal` refuses, naming why, a bad signature, another body, a
field bound to another job, or a timestamp outside the allowed skew; the
receiver keeps the seen nonces (replays) itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from gpuagent.protocol import Seal

MAX_SKEW_S = 300.0
# What a seal binds besides the signer, the body's digest and the time.
BOUND_FIELDS = ("type", "job_id", "attempt", "kind", "release_id")


class SealRefused(Exception):
    """A message whose seal does not hold; the text says which check failed."""


def canonical(value) -> bytes:
    """The canonical encoding signed and hashed: JSON, sorted keys, no spaces."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def body_sha256(body) -> str:
    return hashlib.sha256(canonical(body)).hexdigest()


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 private key (PEM, PKCS8) at `path`, created there with mode
    0600 (its folder 0700) if absent. A key file others may read is refused."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it meanwhile: read that
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(pem)
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"identity key {path} is readable by others (chmod 600)")
    key = serialization.load_pem_private_key(path.read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} is not an Ed25519 private key")
    return key


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The raw 32 bytes of the (public half of the) key."""
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def fingerprint(raw_public_key: bytes) -> str:
    """sha256 of the raw public key, hex: the identity a seal names."""
    return hashlib.sha256(raw_public_key).hexdigest()


def public_key_from_text(text: str) -> bytes:
    """Raw public key bytes from hex (64 digits) or a PEM SubjectPublicKeyInfo."""
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_public_key(text.encode())
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("not an Ed25519 public key")
        return public_raw(key)
    try:
        raw = bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError("a public key is 64 hex digits or a PEM block") from exc
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
    return raw


def seal(
    key: Ed25519PrivateKey,
    body,
    *,
    type: str,
    job_id: int | None = None,
    attempt: int | None = None,
    kind: str = "",
    release_id: int | None = None,
    now: float | None = None,
) -> Seal:
    """The seal of `body` (JSON-ready) signed with `key`."""
    fields = {
        "type": type,
        "job_id": job_id,
        "attempt": attempt,
        "kind": kind,
        "release_id": release_id,
        "signer": fingerprint(public_raw(key)),
        "body_sha256": body_sha256(body),
        "timestamp": time.time() if now is None else now,
        "nonce": secrets.token_hex(16),
    }
    signature = key.sign(canonical(fields))
    return Seal(**fields, signature=base64.b64encode(signature).decode("ascii"))


def check_seal(
    sealed: Seal,
    raw_public_key: bytes,
    body,
    *,
    now: float | None = None,
    max_skew_s: float = MAX_SKEW_S,
    **expected,
) -> None:
    """Raise SealRefused unless `sealed` was made by `raw_public_key` over
    `body`, within `max_skew_s` of `now`, with each of `expected` (a subset of
    BOUND_FIELDS) as given."""
    if sealed.signer != fingerprint(raw_public_key):
        raise SealRefused(f"sealed by {sealed.signer[:16]}, not by the expected key")
    fields = sealed.model_dump(exclude={"signature"})
    try:
        signature = base64.b64decode(sealed.signature, validate=True)
        Ed25519PublicKey.from_public_bytes(raw_public_key).verify(
            signature, canonical(fields)
        )
    except (InvalidSignature, binascii.Error, ValueError) as exc:
        raise SealRefused("the signature does not verify") from exc
    if sealed.body_sha256 != body_sha256(body):
        raise SealRefused("the seal was made over another message body")
    for name, value in expected.items():
        if name not in BOUND_FIELDS:
            raise TypeError(f"{name} is not a bound field")
        if getattr(sealed, name) != value:
            raise SealRefused(
                f"the seal binds {name}={getattr(sealed, name)!r}, "
                f"the message {value!r}"
            )
    now = time.time() if now is None else now
    if abs(now - sealed.timestamp) > max_skew_s:
        raise SealRefused(
            f"stale: sealed {now - sealed.timestamp:+.0f} s from now "
            f"(at most {max_skew_s:.0f} s either way)"
        )
