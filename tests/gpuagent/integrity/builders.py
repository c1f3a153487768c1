"""Builders shared by the integrity tests: deterministic model folders, raw
safetensors bytes, throwaway signing keys (never committed), sparse files and
spies on what the gate reads."""

import json
import os
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from safetensors.numpy import save

from gpuagent.integrity import (
    DEFAULT_POLICY,
    AllowedFile,
    ModelRejectedError,
    Policy,
    ReleaseBinding,
    inspect_model,
)

RELEASE = ReleaseBinding("demo-llama", "1.0.0", "weights=int4-g128,kv=int8", "")
# A policy that names the data files the content tests plant, so that a refusal
# is the content checks' alone (defence in depth), not the allow-list's.
DATA_FILES = DEFAULT_POLICY.replace(
    extra_allowed_files=(
        AllowedFile("*.dat", "test data"),
        AllowedFile("*.state", "optimizer state"),
        AllowedFile("*.npy", "numpy arrays"),
    )
)


def raw_safetensors(header, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file with exactly this header (dict, str or bytes)."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def mutations(original: bytes, seed: int, count: int) -> Iterator[bytes]:
    """`count` copies of `original`, each with 1-3 bytes set to printable ASCII."""
    rng = random.Random(seed)
    for _ in range(count):
        data = bytearray(original)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(32, 127)
        yield bytes(data)


def tensors(seed: int, names: list[str]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((4, 8), dtype=np.float32) for n in names}


def write_model(folder: Path, *, sharded: bool = False, seed: int = 0) -> Path:
    """A small deterministic HF-style folder (same bytes on every run)."""
    folder.mkdir(parents=True, exist_ok=True)
    # Indented with a final newline, as transformers writes them.
    config = {"model_type": "llama", "hidden_size": 8, "vocab_size": 4}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "vocab": {}}))
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    if not sharded:
        (folder / "model.safetensors").write_bytes(save(tensors(seed, names)))
        return folder
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for i, (shard, shard_names) in enumerate(shards.items()):
        (folder / shard).write_bytes(save(tensors(seed + i, shard_names)))
        weight_map.update({n: shard for n in shard_names})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )
    return folder


class Keys:
    def __init__(self, root: Path, name: str):
        key = ec.generate_private_key(ec.SECP256R1())
        self.private = root / f"{name}.pem"
        self.public = root / f"{name}.pub"
        self.private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        self.public_pem = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.public.write_bytes(self.public_pem)

    def policy(self, **changes) -> Policy:
        return Policy(
            **{"public_keys_pem": (self.public_pem,), "release": RELEASE, **changes}
        )


class CertificateAuthority:
    """A throwaway CA and a code-signing leaf certificate for one identity."""

    def __init__(
        self,
        root: Path,
        name: str,
        identity: str,
        leaf_days: tuple[int, int] = (-1, 10),
    ):
        """`leaf_days`: the leaf's not-before and not-after, in days from now."""
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=min(leaf_days[0], 0) - 2))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .add_extension(
                x509.KeyUsage(
                    False, False, False, False, False, True, True, False, False
                ),
                True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "signer")])
            )
            .issuer_name(ca_name)
            .public_key(leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=leaf_days[0]))
            .not_valid_after(now + datetime.timedelta(days=leaf_days[1]))
            .add_extension(
                x509.SubjectAlternativeName([x509.RFC822Name(identity)]), False
            )
            .add_extension(
                x509.KeyUsage(
                    True, False, False, False, False, False, False, False, False
                ),
                True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        self.issuer = f"{name} CA"
        self.identity = identity
        self.chain_pem = ca.public_bytes(pem)
        self.chain = root / f"{name}-ca.pem"
        self.chain.write_bytes(self.chain_pem)
        self.certificate = root / f"{name}-leaf.pem"
        self.certificate.write_bytes(leaf.public_bytes(pem))
        self.private = root / f"{name}-leaf-key.pem"
        self.private.write_bytes(
            leaf_key.private_bytes(
                pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    def sign(self, folder: Path, **kwargs):
        """`sign_model` into folder/model.sig with this CA's leaf."""
        from gpuagent.integrity import sign_model

        return sign_model(
            folder,
            folder / "model.sig",
            **{"release": RELEASE, **kwargs},
            private_key=self.private,
            certificate=self.certificate,
            certificate_chain=(self.chain,),
        )

    def policy(self, **changes) -> Policy:
        settings = {
            "signature_mode": "certificate",
            "certificate_chain_pem": self.chain_pem,
            "certificate_identity": self.identity,
            "certificate_issuer": self.issuer,
            "release": RELEASE,
        }
        return Policy(**{**settings, **changes})


def make_sparse(path: Path, size: int) -> None:
    """`path` grown (or created) to `size` bytes with a hole: no disk behind it."""
    with open(path, "ab") as f:
        f.truncate(size)


class ReadFromFile(BaseException):
    """A file the gate must not read was read. A BaseException: the gate's
    broad `except Exception` (a reader's failure is a finding) can't hide it."""


def refuse_reads(monkeypatch, path: Path) -> None:
    """Makes any os.pread, os.preadv or os.read of `path` (by the gate's own
    readers, whatever the fd) raise ReadFromFile."""
    st = path.stat()
    target = (st.st_dev, st.st_ino)

    for name in ("pread", "preadv", "read"):
        real = getattr(os, name)

        def spy(fd, *args, _real=real):
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino) == target:
                raise ReadFromFile(f"{path.name} was read")
            return _real(fd, *args)

        monkeypatch.setattr(os, name, spy)


def upstream_sign(folder: Path, signature: Path, private_key: Path, ignore=()) -> None:
    """A publisher's signature, made by model-signing itself (no release
    binding, none of our sign-time checks)."""
    from model_signing import hashing, signing

    config = hashing.Config().set_ignored_paths(paths=list(ignore))
    signing.Config().use_elliptic_key_signer(
        private_key=private_key
    ).set_hashing_config(config).sign(folder, signature)


def shard_under_extras(folder: Path) -> str:
    """Moves the second shard of a sharded `write_model` folder to extras/ and
    points the index at it there; returns its new path."""
    shard = "model-00002-of-00002.safetensors"
    (folder / "extras").mkdir()
    (folder / shard).rename(folder / "extras" / shard)
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace(f'"{shard}"', f'"extras/{shard}"'))
    return f"extras/{shard}"


def rejected_files(
    folder: Path, policy: Policy = DEFAULT_POLICY
) -> dict[str, set[str]]:
    """path -> finding codes of each file `inspect_model` rejects in `folder`
    (it must reject one)."""
    with pytest.raises(ModelRejectedError) as refused:
        inspect_model(folder, policy)
    return {
        f.path: {x.code for x in f.findings}
        for f in refused.value.report.files
        if f.findings
    }
