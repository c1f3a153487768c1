"""Signed webhooks: every release state change is POSTed, HMAC-SHA256 signed and
timestamped, to the URLs configured for the release's target environment, with
bounded retries (see signing.py for what a receiver checks)."""
