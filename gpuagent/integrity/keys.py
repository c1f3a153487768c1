"""Signing keys for agents: an ECDSA P-256 key pair in PEM files (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path


def ensure_key_pair(private_path: Path) -> Path:
    """Create an ECDSA P-256 private key at `private_path` (mode 0600) unless one is
    there, and its public key beside it (`<name>.pub.pem`); returns the public
    key's path. Only the agent that signs is given the private one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private_path = Path(private_path)
    public_path = private_path.with_name(private_path.stem + ".pub.pem")
    if not private_path.is_file():
        private_path.parent.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
    public_path.write_bytes(public_key_pem(private_path))
    return public_path


def public_key_pem(private_key_path: Path) -> bytes:
    """The SubjectPublicKeyInfo PEM of the private key (PEM) at `private_key_path`."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(private_key_path.read_bytes(), None)
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
