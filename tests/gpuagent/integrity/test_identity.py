"""Agent and control-plane identities and message seals
(gpuagent.integrity.identity)."""

import hashlib
import os
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gpuagent.integrity import identity


def test_it_creates_a_key_readable_by_its_owner_alone_and_keeps_it(tmp_path):
    path = tmp_path / "state" / "identity.key"

    key = identity.load_or_create_key(path)
    again = identity.load_or_create_key(path)

    assert path.stat().st_mode & 0o777 == 0o600
    assert identity.public_raw(again) == identity.public_raw(key)


def test_it_refuses_a_key_file_others_may_read(tmp_path):
    path = tmp_path / "identity.key"
    identity.load_or_create_key(path)
    os.chmod(path, 0o644)

    with pytest.raises(PermissionError, match="readable by others"):
        identity.load_or_create_key(path)


def test_the_fingerprint_is_the_sha256_of_the_raw_public_key():
    key = Ed25519PrivateKey.generate()
    raw = identity.public_raw(key)

    assert len(raw) == 32
    assert identity.fingerprint(raw) == hashlib.sha256(raw).hexdigest()


def test_the_canonical_encoding_sorts_keys_without_spaces():
    assert identity.canonical({"b": 1, "a": [1, "é"]}) == '{"a":[1,"é"],"b":1}'.encode()


def sealed(key, body, **fields):
    return identity.seal(
        key, body, type="result", job_id=1, attempt=1, kind="sign", **fields
    )


def test_a_seal_holds_for_its_body_and_bindings():
    key = Ed25519PrivateKey.generate()
    body = {"job_id": 1, "ok": True}

    identity.check_seal(
        sealed(key, body, release_id=4),
        identity.public_raw(key),
        body,
        type="result",
        job_id=1,
        attempt=1,
        kind="sign",
        release_id=4,
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"body": {"job_id": 1, "ok": False}}, "another message body"),
        ({"expected": {"attempt": 2}}, "the seal binds attempt=1, the message 2"),
        ({"expected": {"kind": "verify"}}, "the seal binds kind='sign'"),
        ({"later_s": 301}, "stale"),
        ({"key": Ed25519PrivateKey.generate()}, "not by the expected key"),
        ({"seal": {"attempt": 2}}, "the signature does not verify"),
    ],
)
def test_a_seal_is_refused_naming_why(change, reason):
    key = Ed25519PrivateKey.generate()
    body = {"job_id": 1, "ok": True}
    seal = sealed(key, body)
    if "seal" in change:  # a field changed after signing
        seal = seal.model_copy(update=change["seal"])

    with pytest.raises(identity.SealRefused, match=reason):
        identity.check_seal(
            seal,
            identity.public_raw(change.get("key", key)),
            change.get("body", body),
            now=time.time() + change.get("later_s", 0),
            **change.get("expected", {}),
        )


def test_a_public_key_reads_from_hex_or_pem():
    from cryptography.hazmat.primitives import serialization

    key = Ed25519PrivateKey.generate()
    raw = identity.public_raw(key)
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )

    assert identity.public_key_from_text(raw.hex()) == raw
    assert identity.public_key_from_text(pem.decode()) == raw
    with pytest.raises(ValueError, match="32 bytes"):
        identity.public_key_from_text("ab" * 16)
