"""What the gate accepts: structural limits, hash settings, trusted signers and
the release a signature must be bound to."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuagent.integrity.limits import DEFAULT_LIMITS, FolderLimits
from gpuagent.integrity.strict_json import DEFAULT_MAX_ELEMENTS

# Files model-signing ignores by default, so its signatures may leave them out.
# Of them a folder may only hold .gitattributes and .gitignore (see `limits`).
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")

# Byte-sized safetensors dtypes and their item size. Sub-byte (F4, F6_*) and
# complex types are left out of the default allowlist on purpose.
SAFETENSORS_DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class ReleaseBinding:
    """The release a signature is made for; it goes into the signed statement.

    `parent_digest` is the manifest digest of the model this one was derived
    from ("" for a source model).
    """

    model: str
    version: str
    recipe: str
    parent_digest: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReleaseBinding:
        return cls(
            model=str(data["model"]),
            version=str(data["version"]),
            recipe=str(data["recipe"]),
            parent_digest=str(data.get("parent_digest", "")),
        )


@dataclass(frozen=True)
class AllowedFile:
    """A file the policy lets a model folder hold beyond the built-in kinds
    (see `allowlist`): `pattern` is matched with fnmatch against the path inside
    the folder ("*.npy", "extras/*.bin"; "*" matches "/" too), `name` says what
    and why, for reports. `containers`: the file may be a compressed stream or
    an archive (what is inside is still checked). The content checks for
    pickles and their containers apply to it all the same."""

    pattern: str
    name: str
    containers: bool = False


@dataclass(frozen=True)
class Policy:
    """Limits and trust anchors. The defaults are the strict production ones.

    Signer trust: `public_keys_pem` for key signatures (a key's fingerprint is
    the SHA-256 of its PEM SubjectPublicKeyInfo, as model-signing's key hint);
    `certificate_chain_pem` + `certificate_identity` + `certificate_issuer` for
    certificate signatures; `sigstore_trust_config` + `certificate_identity` +
    `certificate_issuer` (the OIDC issuer) for Sigstore keyless signatures.
    """

    # The folder's tree: names, path lengths, depth, entries, total size, and
    # the signature file's size (see `limits`); refused before anything is read.
    limits: FolderLimits = DEFAULT_LIMITS
    # Safetensors headers and JSON files: bytes, nesting (headers; JSON files
    # allow 64), and elements (see strict_json.DEFAULT_MAX_ELEMENTS).
    max_header_bytes: int = 100 * 1024 * 1024
    max_json_depth: int = 16
    max_json_elements: int = DEFAULT_MAX_ELEMENTS
    # Containers (compressed streams, tar, ZIP) are looked into, within these
    # limits per file; past one, the file is refused (its rest is unchecked).
    max_decompressed_bytes: int = 256 << 20
    max_container_depth: int = 4
    max_archive_members: int = 4096
    # Text files and tokenizer models are read whole to check their format.
    max_text_bytes: int = 64 << 20
    # Files beyond the built-in allow-list (see AllowedFile).
    extra_allowed_files: tuple[AllowedFile, ...] = ()
    max_tensor_rank: int = 8
    allowed_dtypes: frozenset[str] = frozenset(SAFETENSORS_DTYPE_SIZES)
    scan_nonfinite: bool = False
    allow_internal_symlinks: bool = False
    # Hash settings a signature may use.
    allowed_hash_types: frozenset[str] = frozenset({"sha256", "blake3"})
    min_shard_size: int = 1 << 20
    # Paths a signature may leave out of the manifest. Everything else (weights,
    # configs, tokenizers) must be covered. Signature files must be listed here
    # AND in the signed ignore list.
    signature_names: tuple[str, ...] = ("model.sig",)
    extra_ignorable_paths: tuple[str, ...] = ()
    ignore_git_paths: bool = True
    # Trust anchors (see the class docstring).
    signature_mode: str = "key"  # "key" | "certificate" | "sigstore"
    public_keys_pem: tuple[bytes, ...] = ()
    certificate_chain_pem: bytes | None = None
    certificate_identity: str | None = None
    certificate_issuer: str | None = None
    sigstore_trust_config: str | None = None
    # Certificate mode has no trusted signing time (model-signing checks the chain
    # at the leaf's not-before), so an expired leaf could still sign today: refused
    # unless this is set. Sigstore's time comes from its log and is checked there.
    allow_expired_certificates: bool = False
    # The release the signature must be bound to; None: binding not enforced
    # (only for signatures made by other tools, e.g. a publisher's).
    release: ReleaseBinding | None = None

    def ignorable_paths(self) -> frozenset[str]:
        paths = set(self.signature_names) | set(self.extra_ignorable_paths)
        if self.ignore_git_paths:
            paths |= set(GIT_PATHS)
        return frozenset(paths)

    def replace(self, **changes: Any) -> Policy:
        return dataclasses.replace(self, **changes)


DEFAULT_POLICY = Policy()
# Names a signature file may have and still be left out of the manifest by name
# (model-signing writes `model.sig`; Sigstore bundles are `*.sigstore[.json]`).
SIGNATURE_SUFFIXES = (".sig", ".sigstore", ".sigstore.json", ".bundle")


def release_from_flags(
    model: str | None,
    version: str | None,
    recipe: str | None,
    parent_digest: str = "",
) -> ReleaseBinding | None:
    """The release named on a command line (`--model/--version/--recipe`, or a
    CLI's spelling of them): None when none of the three is given.

    Raises ValueError when only some are: a partial release would silently check
    nothing.
    """
    fields = (model, version, recipe)
    if all(f is None for f in fields):
        return None
    if any(f is None for f in fields):
        raise ValueError("the release model, version and recipe go together")
    return ReleaseBinding(str(model), str(version), str(recipe), parent_digest or "")


def policy_from_flags(
    *,
    public_keys_pem: Sequence[bytes] = (),
    certificate_chain_pem: bytes | None = None,
    sigstore_trust_config: str | os.PathLike[str] | None = None,
    identity: str | None = None,
    issuer: str | None = None,
    release: ReleaseBinding | None = None,
    signature_name: str | None = None,
    extra_ignorable_paths: Sequence[str] = (),
    base: Policy = DEFAULT_POLICY,
) -> Policy:
    """The verification policy the command-line flags ask for, on top of `base`.

    One trust anchor, in this order: a pinned Sigstore trust config (with the
    identity and OIDC issuer), a pinned certificate chain (with the certificate
    identity and issuer), or trusted public keys (PEM). `signature_name` (the
    signature's file name) may be left out of the manifest when it ends in one of
    `SIGNATURE_SUFFIXES`: a signature kept outside the folder as `config.json` must
    not let a signed ignore list leave out the folder's own `config.json`.
    `release`, when given, must be the one the signature is bound to. Raises
    ValueError when no trust anchor is given: a policy without one trusts no signer.
    """
    policy = base.replace(
        release=release,
        extra_ignorable_paths=(*base.extra_ignorable_paths, *extra_ignorable_paths),
    )
    if (
        signature_name
        and signature_name.endswith(SIGNATURE_SUFFIXES)
        and signature_name not in policy.signature_names
    ):
        policy = policy.replace(
            signature_names=(*policy.signature_names, signature_name)
        )
    if sigstore_trust_config:
        return policy.replace(
            signature_mode="sigstore",
            sigstore_trust_config=str(sigstore_trust_config),
            certificate_identity=identity,
            certificate_issuer=issuer,
        )
    if certificate_chain_pem:
        return policy.replace(
            signature_mode="certificate",
            certificate_chain_pem=certificate_chain_pem,
            certificate_identity=identity,
            certificate_issuer=issuer,
        )
    if public_keys_pem:
        return policy.replace(
            signature_mode="key", public_keys_pem=tuple(public_keys_pem)
        )
    raise ValueError(
        "give a trusted public key (--public-key), a certificate chain "
        "(--certificate-chain) or a sigstore trust config (--sigstore-trust-config)"
    )


def policy_from_trust_args(
    args: Any, *, release: ReleaseBinding | None, **extra: Any
) -> Policy:
    """`policy_from_flags` over the trust flags the integrity and engine CLIs share:
    `args.public_key` (paths), `certificate_chain` (path or None),
    `sigstore_trust_config`, `identity`, `issuer` and `signature` (path). `extra` goes
    to `policy_from_flags` as is. Raises ValueError for a bad combination or a PEM file
    that cannot be read."""
    return policy_from_flags(
        public_keys_pem=[_read_pem(path) for path in args.public_key],
        certificate_chain_pem=(
            _read_pem(args.certificate_chain) if args.certificate_chain else None
        ),
        sigstore_trust_config=args.sigstore_trust_config,
        identity=args.identity,
        issuer=args.issuer,
        release=release,
        signature_name=args.signature.name,
        **extra,
    )


def _read_pem(path: os.PathLike[str]) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from e
