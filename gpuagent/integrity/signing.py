"""Signing and verification through OpenSSF `model-signing`, bound to a release.

Binding. model-signing signs an in-toto statement whose predicate holds the
serialization parameters and every resource digest; v1.0 verifiers ignore other
predicate keys. We add one, `releasegate`, holding the release (model, version,
recipe, parent digest) and our manifest digest. It sits inside the DSSE payload,
so it is covered by the signature: editing it breaks the signature, and a valid
signature for release A fails release B's check on the binding (and on the
manifest digest if the files differ). The upstream `model_signing` tool still
verifies our signatures (it ignores the extra key), and we verify its
signatures when the policy does not demand a binding.

Verification order: signature and signer, statement, serialization parameters
and ignore list against the policy, binding, then every file digest. Every
library exception becomes one of our `IntegrityError` subclasses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuagent.integrity import _fs
from gpuagent.integrity._text import printable
from gpuagent.integrity.digest_cache import DigestCache
from gpuagent.integrity.errors import (
    BindingMismatchError,
    HashingError,
    IgnoreListError,
    IntegrityError,
    ManifestMismatchError,
    PolicyError,
    SignatureError,
    SignerNotTrustedError,
    SigningError,
)
from gpuagent.integrity.inspection import check_signed_indexes
from gpuagent.integrity.manifest import (
    HashSpec,
    Manifest,
    hash_folder_listing,
    hash_model,
)
from gpuagent.integrity.policy import DEFAULT_POLICY, Policy, ReleaseBinding
from gpuagent.integrity.safetensors_header import HeaderRejected, strict_json_loads

BINDING_KEY = "releasegate"
BINDING_FORMAT = "releasegate-binding/v1"
_IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
_IN_TOTO_STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
_PREDICATE_TYPE = "https://model_signing/signature/v1.0"


@dataclass(frozen=True)
class SignResult:
    manifest: Manifest
    signature_path: str
    release: ReleaseBinding

    def to_dict(self) -> dict[str, Any]:
        return {
            "signature_path": self.signature_path,
            "manifest_digest": self.manifest.digest,
            "root_digest": self.manifest.root_digest,
            "release": self.release.to_dict(),
            "files": len(self.manifest.files()),
        }


@dataclass(frozen=True)
class SignedStatement:
    """What a signature says, after its signature and signer were verified."""

    manifest: Manifest
    signer: str  # "key sha256:<fingerprint>" or "certificate <identity> by <issuer>"
    binding: dict[str, str] | None
    serialization: dict[str, Any] = field(default_factory=dict)
    # Certificate and Sigstore modes: the signing (leaf) certificate's validity
    # window, see `certificate_validity`. None for key signatures.
    certificate_validity: dict[str, Any] | None = None


@dataclass(frozen=True)
class VerificationReport:
    """`release` is the release the signature is bound to (None: unbound).
    `binding_checked` is False when the policy named no release, so that binding
    was not compared with anything (`Policy.release=None`). `certificate_validity`
    is the signing certificate's validity window (certificate and Sigstore modes;
    see `certificate_validity` for where expiry is refused)."""

    ok: bool
    folder: str
    signer: str
    manifest_digest: str
    root_digest: str
    release: dict[str, str] | None
    files: list[str]
    binding_checked: bool = True
    certificate_validity: dict[str, Any] | None = None
    # Files whose digests came from a digest cache (a quick check), not re-hashed.
    reused_digests: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The report, every name and signed string in it kept printable (a
        signed release may spell a newline or U+202E)."""
        out = dict(self.__dict__)
        out["folder"] = printable(self.folder)
        out["files"] = [printable(f) for f in self.files]
        if self.release is not None:
            out["release"] = {
                printable(k): printable(v) for k, v in self.release.items()
            }
        return out

    def to_text(self) -> str:
        shown = self.to_dict()
        release = shown["release"] or {}
        bound = (
            f"{release.get('model')} {release.get('version')} ({release.get('recipe')})"
            if release
            else "not bound to a release"
        )
        if not self.binding_checked:
            bound += " [NOT CHECKED: no release required, replay not prevented]"
        lines = [
            f"verify {shown['folder']}: OK",
            f"  signer:          {printable(self.signer)}",
        ]
        validity = self.certificate_validity
        if validity:
            lines.append(
                f"  certificate:     valid {validity['not_before']} to "
                f"{validity['not_after']}"
                + (" (expired now)" if validity["expired"] else "")
            )
        lines += [
            f"  release:         {bound}",
            f"  manifest digest: {self.manifest_digest}",
            f"  files verified:  {len(self.files)}"
            + (
                f" ({self.reused_digests} by digest cache: a quick check)"
                if self.reused_digests
                else ""
            ),
        ]
        return "\n".join(lines)


def certificate_validity(cert: Any, now: datetime | None = None) -> dict[str, Any]:
    """A signing certificate's validity window (ISO 8601, UTC) and whether it has
    expired by `now`. Sigstore checks the chain at the logged signing time, so
    its signatures rightly outlive their short-lived certificates; model-signing's
    certificate mode checks it at the leaf's not-before time, with no trusted time
    at all, so there an expired leaf is refused
    (`Policy.allow_expired_certificates`)."""
    now = now or datetime.now(UTC)
    not_after = cert.not_valid_after_utc
    return {
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": not_after.isoformat(),
        "expired": now > not_after,
    }


def key_fingerprint(public_key_pem: bytes) -> str:
    """SHA-256 of the key's PEM SubjectPublicKeyInfo: model-signing's key hint."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(public_key_pem)
    except Exception as e:  # noqa: BLE001
        raise PolicyError(f"not a PEM public key: {e}") from e
    raw = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(raw).hexdigest()


# --- signing ---------------------------------------------------------------


def _relative_inside(folder: Path, path: Path) -> str | None:
    try:
        return (
            Path(os.path.abspath(path))
            .relative_to(Path(os.path.abspath(folder)))
            .as_posix()
        )
    except ValueError:
        return None


def _check_no_empty_files(folder: Path, manifest: Manifest, policy: Policy) -> None:
    listed = _fs.list_folder(folder, list(manifest.ignore_paths), policy.limits)
    empty = sorted(path for path, size in listed if size == 0)
    if empty:
        raise PolicyError(
            "empty files have no shard, so a sharded signature cannot cover them "
            f"and verify would refuse them as unsigned: {', '.join(empty)} (sign "
            "without --shard-size, or remove them)"
        )


def file_sizes(folder: Path, manifest: Manifest) -> dict[str, int]:
    """Size of every file the manifest covers, as signed in the binding."""
    return {path: (folder / path).stat().st_size for path in manifest.files()}


def _payload(manifest: Manifest, release: ReleaseBinding, sizes: dict[str, int]):
    from in_toto_attestation.v1 import statement as intoto
    from model_signing._signing import signing as ms_signing

    base = ms_signing.Payload(manifest.to_model_signing())
    predicate = {
        "serialization": manifest.to_model_signing().serialization_type,
        "resources": [
            {"name": r.name, "algorithm": r.algorithm, "digest": r.digest}
            for r in manifest.resources
        ],
        BINDING_KEY: {
            "format": BINDING_FORMAT,
            **release.to_dict(),
            "manifest_digest": manifest.digest,
            # Binding values are strings: the sizes as canonical JSON. Signed,
            # they let verify name a changed size before hashing anything.
            "file_sizes": json.dumps(sizes, sort_keys=True, separators=(",", ":")),
        },
    }
    base.statement = intoto.Statement(
        subjects=[base.statement.pb.subject[0]],
        predicate_type=_PREDICATE_TYPE,
        predicate=predicate,
    )
    return base


def _signer(
    private_key: str | Path | None,
    password: str | None,
    certificate: str | Path | None,
    certificate_chain: tuple[str | Path, ...],
    sigstore_identity_token: str | None,
    sigstore_trust_config: str | Path | None,
):
    key_password = None
    if private_key and not sigstore_identity_token:
        key_password = _check_private_key(
            Path(private_key), password, with_certificate=certificate
        )
    try:
        from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore

        if sigstore_identity_token:
            trust = Path(sigstore_trust_config) if sigstore_trust_config else None
            return sign_sigstore.Signer(
                identity_token=sigstore_identity_token,
                use_ambient_credentials=False,
                trust_config=trust,
            )
        if private_key and certificate:
            return sign_certificate.Signer(
                Path(private_key),
                Path(certificate),
                [Path(c) for c in certificate_chain],
            )
        if private_key:
            return sign_ec_key.Signer(Path(private_key), key_password)
    except Exception as e:  # noqa: BLE001 - bad key, password, certificate...
        raise SigningError(f"cannot set up the signer: {type(e).__name__}: {e}") from e
    raise SigningError("no signing key, certificate or identity token given")


def _check_private_key(
    path: Path, password: str | None, *, with_certificate: object
) -> bytes | None:
    """The password as model-signing must get it (it annotates a str but hands
    it to cryptography, which takes bytes only), after clear errors for an
    encrypted key without its password, a wrong password, or a password for a
    key that is not encrypted (model-signing would raise a bare TypeError or
    ValueError)."""
    from cryptography.hazmat.primitives import serialization

    try:
        data = path.read_bytes()
    except OSError as e:
        raise SigningError(f"cannot read the private key {path}: {e}") from e
    try:
        serialization.load_pem_private_key(data, None)
        encrypted = False
    except TypeError:  # documented: encrypted, and no password given
        encrypted = True
    except Exception as e:  # noqa: BLE001 - not PEM, unsupported algorithm...
        raise SigningError(
            f"{path} is not a PEM private key: {type(e).__name__}: {e}"
        ) from e
    if encrypted and with_certificate:
        # model-signing 1.1.1's certificate signer takes no password.
        raise SigningError(
            f"private key {path} is encrypted: certificate signing needs an "
            "unencrypted key"
        )
    if not encrypted:
        if password is not None:
            raise SigningError(
                f"a password was given but the private key {path} is not encrypted"
            )
        return None
    if password is None:
        raise SigningError(
            f"private key {path} is encrypted: give its password (--password)"
        )
    encoded = password.encode("utf-8")
    try:
        serialization.load_pem_private_key(data, encoded)
    except ValueError as e:  # documented: the data could not be decrypted
        raise SigningError(f"bad password for the private key {path}") from e
    return encoded


def sign_model(
    folder: str | Path,
    signature_path: str | Path,
    *,
    release: ReleaseBinding,
    private_key: str | Path | None = None,
    password: str | None = None,
    certificate: str | Path | None = None,
    certificate_chain: tuple[str | Path, ...] = (),
    sigstore_identity_token: str | None = None,
    sigstore_trust_config: str | Path | None = None,
    algorithm: str = "sha256",
    shard_size: int | None = None,
    ignore_paths: tuple[str, ...] = (),
    policy: Policy = DEFAULT_POLICY,
) -> SignResult:
    """Hashes `folder` and signs its manifest bound to `release`.

    Modes: `private_key` (ECDSA PEM) alone = key signature; with `certificate`
    (+ chain) = certificate signature; `sigstore_identity_token` = Sigstore
    keyless (needs the network at signing time). `password` decrypts an
    encrypted `private_key` (key mode only; certificate signing takes an
    unencrypted key). A signature written inside the folder is added to the
    ignore list explicitly.

    What `verify_model` under `policy` would refuse is refused here first:
    hash settings it does not allow (a shard size below its minimum), with
    shards an empty file (it has no shard, so verify would call it unsigned),
    a signature larger than it reads (PolicyError); the folder's names and
    limits, sparse files (`hash_model`); an index naming a shard the manifest
    does not cover (ModelRejectedError).
    """
    folder, signature_path = Path(folder), Path(signature_path)
    if shard_size is not None and algorithm == "sha256":
        try:
            check_hash_spec(HashSpec("shards", algorithm, shard_size), policy)
        except HashingError as e:
            raise PolicyError(str(e)) from e
    elif algorithm not in policy.allowed_hash_types:
        raise PolicyError(f"hash type {algorithm!r} not allowed by policy")
    signer = _signer(
        private_key,
        password,
        certificate,
        certificate_chain,
        sigstore_identity_token,
        sigstore_trust_config,
    )
    ignore = list(ignore_paths)
    inside = _relative_inside(folder, signature_path)
    if inside is not None:
        ignore.append(inside)
    manifest = hash_model(
        folder,
        algorithm,
        shard_size=shard_size,
        ignore_paths=tuple(ignore),
        limits=policy.limits,
    )
    if manifest.spec.method == "shards":
        _check_no_empty_files(folder, manifest, policy)
    check_signed_indexes(folder, manifest, policy)
    try:
        signature = signer.sign(
            _payload(manifest, release, file_sizes(folder, manifest))
        )
        signature.write(signature_path)
    except Exception as e:  # noqa: BLE001 - library failures become ours
        raise SigningError(f"signing failed: {type(e).__name__}: {e}") from e
    written = signature_path.stat().st_size
    if written > policy.limits.max_signature_bytes:
        signature_path.unlink()
        raise PolicyError(
            f"the signature is {written} bytes, more than verify reads "
            f"({policy.limits.max_signature_bytes}): sign with larger shards"
        )
    return SignResult(manifest, str(signature_path), release)


# --- verification ----------------------------------------------------------


def read_signed_statement(
    signature_path: str | Path, policy: Policy = DEFAULT_POLICY
) -> SignedStatement:
    """Verifies the signature and signer of `signature_path` against `policy`
    and returns what it signs. Does not look at the model files."""
    path = Path(signature_path)
    if not path.is_file():
        raise SignatureError(f"signature file {path} does not exist")
    data = _read_signature(path, policy.limits.max_signature_bytes)
    try:
        with tempfile.TemporaryDirectory(prefix="rg-trust-") as tmp:
            # model-signing reads a path: hand it the bytes checked here, so
            # what it verifies is what was bounded, whatever the path holds now.
            copy = Path(tmp) / "signature"
            copy.write_bytes(data)
            payload_type, payload, signer, validity = _verify_signature(
                copy, policy, Path(tmp)
            )
    except IntegrityError:
        raise
    except Exception as e:  # noqa: BLE001 - ValueError, InvalidSignature, OpenSSL, sigstore...
        raise SignatureError(
            f"signature does not verify: {type(e).__name__}: {e}"
        ) from e
    if payload_type != _IN_TOTO_PAYLOAD_TYPE:
        raise SignatureError(f"unexpected payload type {payload_type!r}")
    return dataclasses.replace(
        _parse_statement(payload, signer), certificate_validity=validity
    )


def _read_signature(path: Path, max_bytes: int) -> bytes:
    """The signature file's bytes: its size checked with fstat before reading
    (a sparse 2 GiB file is refused without reading it), and the read bounded
    all the same (a file that grows, a /proc file that says 0)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise SignatureError(f"cannot open the signature file {path}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SignatureError(f"signature file {path} is not a regular file")
        if st.st_size > max_bytes:
            raise SignatureError(
                f"signature file {path} is {st.st_size} bytes, more than the "
                f"limit of {max_bytes}; not read"
            )
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - total, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise SignatureError(f"cannot read the signature file {path}: {e}") from e
    finally:
        os.close(fd)
    if total > max_bytes:
        raise SignatureError(
            f"signature file {path} holds more than the limit of {max_bytes} bytes"
        )
    return b"".join(chunks)


def _verify_signature(
    path: Path, policy: Policy, tmp: Path
) -> tuple[str, bytes, str, dict[str, Any] | None]:
    """(payload type, payload, signer, signing certificate validity or None)."""
    from model_signing._signing import (
        sign_certificate,
        sign_ec_key,
        sign_sigstore,
        sign_sigstore_pb,
    )

    mode = policy.signature_mode
    if mode == "sigstore":
        if not (
            policy.sigstore_trust_config
            and policy.certificate_identity
            and policy.certificate_issuer
        ):
            raise PolicyError(
                "sigstore mode needs a pinned trust config, identity and OIDC issuer"
            )
        signature = sign_sigstore.Signature.read(path)
        verifier = sign_sigstore.Verifier(
            identity=policy.certificate_identity,
            oidc_issuer=policy.certificate_issuer,
            trust_config=Path(policy.sigstore_trust_config),
        )
        try:
            payload_type, payload = verifier._verify_signed_content(signature)
        except Exception:
            _check_sigstore_identity(signature.bundle.signing_certificate, policy)
            raise
        return (
            payload_type,
            payload,
            f"sigstore {policy.certificate_identity} by {policy.certificate_issuer}",
            certificate_validity(signature.bundle.signing_certificate),
        )

    try:
        signature = sign_sigstore_pb.Signature.read(path)
    except Exception as e:  # noqa: BLE001
        raise SignatureError(
            f"unreadable signature bundle: {type(e).__name__}: {e}"
        ) from e
    material = signature.bundle.verification_material
    if mode == "key":
        if material.public_key is None:
            raise SignatureError(
                "not a key signature (no public key hint in the bundle)"
            )
        trusted = {key_fingerprint(pem): pem for pem in policy.public_keys_pem}
        if not trusted:
            raise PolicyError("policy trusts no public key")
        hint = material.public_key.hint
        candidates = [hint] if hint else sorted(trusted)
        if hint and hint not in trusted:
            raise SignerNotTrustedError(
                f"signed by key sha256:{hint}, which the policy does not trust"
            )
        last: Exception | None = None
        for fingerprint in candidates:
            key_path = tmp / f"{fingerprint}.pub"
            key_path.write_bytes(trusted[fingerprint])
            try:
                payload_type, payload = sign_ec_key.Verifier(
                    key_path
                )._verify_signed_content(signature)
            except Exception as e:  # noqa: BLE001
                last = e
                continue
            return payload_type, payload, f"key sha256:{fingerprint}", None
        raise SignatureError(
            f"signature does not verify: {type(last).__name__}: {last}"
        )
    if mode == "certificate":
        if not (
            policy.certificate_chain_pem
            and policy.certificate_identity
            and policy.certificate_issuer
        ):
            raise PolicyError(
                "certificate mode needs a pinned chain, identity and issuer"
            )
        if material.x509_certificate_chain is None:
            raise SignatureError(
                "not a certificate signature (no certificate chain in the bundle)"
            )
        chain_path = tmp / "chain.pem"
        chain_path.write_bytes(policy.certificate_chain_pem)
        verifier = sign_certificate.Verifier([chain_path])
        payload_type, payload = verifier._verify_signed_content(signature)
        leaf = material.x509_certificate_chain.certificates[0].raw_bytes
        cert = _check_certificate_identity(leaf, policy)
        validity = certificate_validity(cert)
        if validity["expired"] and not policy.allow_expired_certificates:
            raise SignerNotTrustedError(
                f"the signing certificate expired at {validity['not_after']}; a "
                "certificate signature carries no trusted signing time, so it may "
                "have been made after that (re-sign with a valid certificate)"
            )
        return (
            payload_type,
            payload,
            f"certificate {policy.certificate_identity} by {policy.certificate_issuer}",
            validity,
        )
    raise PolicyError(f"unknown signature mode {mode!r}")


def _check_sigstore_identity(cert: Any, policy: Policy) -> None:
    """After a failed Sigstore verify: SignerNotTrustedError, naming who signed,
    when the certificate is not the policy's identity and OIDC issuer (sigstore
    reports that as a bare VerificationError, like any other failure)."""
    from sigstore.verify.policy import Identity

    try:
        Identity(
            identity=policy.certificate_identity, issuer=policy.certificate_issuer
        ).verify(cert)
    except Exception as e:  # noqa: BLE001 - sigstore's VerificationError
        raise SignerNotTrustedError(
            f"signed by a certificate the policy does not trust "
            f"(wants {policy.certificate_identity!r} "
            f"from {policy.certificate_issuer!r}): {e}"
        ) from e


def _check_certificate_identity(leaf_der: bytes, policy: Policy) -> Any:
    """The leaf certificate, once its identity and issuer are the policy's.

    Validity is checked by the caller (model-signing verified the chain at the
    leaf's not-before time only)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_der_x509_certificate(leaf_der)
    identities = {
        a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    }
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        identities |= {str(v) for v in san.get_values_for_type(x509.RFC822Name)}
        identities |= {
            str(v) for v in san.get_values_for_type(x509.UniformResourceIdentifier)
        }
        identities |= {str(v) for v in san.get_values_for_type(x509.DNSName)}
    except x509.ExtensionNotFound:
        pass
    issuers = {cert.issuer.rfc4514_string()}
    issuers |= {
        a.value for a in cert.issuer.get_attributes_for_oid(NameOID.COMMON_NAME)
    }
    if policy.certificate_identity not in identities:
        raise SignerNotTrustedError(
            f"certificate identity {sorted(identities)} is not "
            f"{policy.certificate_identity!r}"
        )
    if policy.certificate_issuer not in issuers:
        raise SignerNotTrustedError(
            f"certificate issuer {sorted(issuers)} is not {policy.certificate_issuer!r}"
        )
    return cert


def _parse_statement(payload: bytes, signer: str) -> SignedStatement:
    from model_signing._signing import signing as ms_signing

    try:
        # Strict: a duplicate key could make two parsers read different releases.
        statement = strict_json_loads(payload.decode("utf-8"), 64)
    except (UnicodeDecodeError, HeaderRejected) as e:
        raise SignatureError(f"signed statement is not strict JSON: {e}") from e
    if (
        not isinstance(statement, dict)
        or statement.get("_type") != _IN_TOTO_STATEMENT_TYPE
    ):
        raise SignatureError("signed payload is not an in-toto v1 statement")
    if statement.get("predicateType") != _PREDICATE_TYPE:
        # The v0.2 compat format has no serialization parameters: refuse it.
        raise SignatureError(
            f"unsupported predicate type {statement.get('predicateType')!r}"
        )
    try:
        ms_manifest = ms_signing.dsse_payload_to_manifest(statement)
        manifest = Manifest.from_model_signing(ms_manifest)
    except IntegrityError:
        raise
    except Exception as e:  # noqa: BLE001
        raise SignatureError(
            f"signed manifest is inconsistent: {type(e).__name__}: {e}"
        ) from e
    predicate = statement["predicate"]
    binding = predicate.get(BINDING_KEY)
    if binding is not None and not (
        isinstance(binding, dict) and all(isinstance(v, str) for v in binding.values())
    ):
        raise SignatureError("signed release binding is malformed")
    return SignedStatement(manifest, signer, binding, dict(predicate["serialization"]))


def check_statement(
    statement: SignedStatement, policy: Policy, signature_inside: str | None
) -> None:
    """Serialization parameters, ignore list and release binding against the policy."""
    args = statement.serialization
    if args.get("allow_symlinks") not in (False, "false", None):
        raise PolicyError(
            "signature was made with allow_symlinks; symlinks are refused"
        )
    check_hash_spec(statement.manifest.spec, policy)
    ignored = list(statement.manifest.ignore_paths)
    allowed = policy.ignorable_paths()
    if signature_inside is not None:  # the signature being checked may be left out
        allowed |= {signature_inside}
    bad = sorted(p for p in ignored if p not in allowed)
    if bad:
        raise IgnoreListError(
            "signed ignore list leaves out paths the policy requires to be signed: "
            + ", ".join(bad),
            bad,
        )
    if signature_inside is not None and signature_inside not in ignored:
        raise IgnoreListError(
            f"signature file {signature_inside} is inside the model folder but not in "
            "the signed ignore list",
            [signature_inside],
        )
    if policy.release is not None:
        check_binding(statement, policy.release)


def check_hash_spec(spec: HashSpec, policy: Policy) -> None:
    """Hash settings against the policy: what verify refuses, sign refuses."""
    if spec.hash_type not in policy.allowed_hash_types:
        raise PolicyError(f"hash type {spec.hash_type!r} not allowed by policy")
    if spec.method == "shards" and spec.shard_size < policy.min_shard_size:
        raise PolicyError(
            f"shard size {spec.shard_size} below policy minimum {policy.min_shard_size}"
        )


def check_binding(statement: SignedStatement, release: ReleaseBinding) -> None:
    binding = statement.binding
    if binding is None:
        raise BindingMismatchError(
            "signature is not bound to any release",
            {"release": (release.to_dict(), None)},
        )
    if binding.get("format") != BINDING_FORMAT:
        raise BindingMismatchError(
            f"unknown binding format {binding.get('format')!r}", {}
        )
    mismatches = {
        k: (v, binding.get(k))
        for k, v in release.to_dict().items()
        if binding.get(k) != v
    }
    if binding.get("manifest_digest") != statement.manifest.digest:
        mismatches["manifest_digest"] = (
            statement.manifest.digest,
            binding.get("manifest_digest"),
        )
    if mismatches:
        detail = "; ".join(
            f"{k}: expected {exp!r}, signed {got!r}"
            for k, (exp, got) in mismatches.items()
        )
        raise BindingMismatchError(
            f"signature is for another release: {detail}", mismatches
        )


def signed_sizes(statement: SignedStatement) -> dict[str, int]:
    """File sizes the signature vouches for: the binding's `file_sizes`
    (our signatures), else what shard ranges tell (a sharded manifest covers
    every byte of every non-empty file). Paths not in it: size unknown."""
    sizes: dict[str, int] = {}
    if statement.manifest.spec.method == "shards":
        for path, resources in statement.manifest.files().items():
            sizes[path] = max(r.end or 0 for r in resources)
    raw = (statement.binding or {}).get("file_sizes")
    if raw is not None:
        try:
            bound = strict_json_loads(raw, 2)
        except HeaderRejected as e:
            raise SignatureError(f"signed file sizes are not strict JSON: {e}") from e
        if not isinstance(bound, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in bound.values()
        ):
            raise SignatureError("signed file sizes are malformed")
        sizes.update(bound)
    return sizes


def _check_listing(folder: Path, statement: SignedStatement, policy: Policy) -> None:
    """Names, and sizes where signed, against the manifest before any file is
    read: a planted or swapped file (a sparse 128 GiB one) is named at once."""
    manifest = statement.manifest
    listed = dict(_fs.list_folder(folder, list(manifest.ignore_paths), policy.limits))
    expected = manifest.files()
    missing = sorted(set(expected) - set(listed))
    # An empty file has no shard, so it is absent from a sharded manifest;
    # count it as extra rather than let it in unsigned.
    extra = sorted(set(listed) - set(expected))
    sizes = signed_sizes(statement)
    changed = sorted(
        path
        for path, size in listed.items()
        if path in expected and path in sizes and sizes[path] != size
    )
    if missing or extra or changed:
        raise ManifestMismatchError(missing, extra, changed)


def verify_model(
    folder: str | Path,
    signature_path: str | Path,
    policy: Policy = DEFAULT_POLICY,
    *,
    max_workers: int | None = None,
    digest_cache: str | Path | None = None,
) -> VerificationReport:
    """Verifies `folder` against the signature: signature, signer, binding,
    ignore list, and every file digest (our fd-based parallel hasher, with the
    signed hash settings). Raises an `IntegrityError` subclass on any failure.

    The release binding is checked against `policy.release`. With
    `policy.release=None` it is NOT checked (the report says
    `binding_checked=False`): a valid signature made for any other release of
    the same files, e.g. a revoked one, is then accepted. That is a deliberate
    programmatic choice, for signatures made by other tools (a publisher's
    `model_signing` signature carries no binding); callers that gate a release
    must pass it. The CLI requires `--model/--version/--recipe` unless told
    `--any-release`.

    Every file is re-hashed (the default, for gates). With `digest_cache` (a
    file path), a quick check instead: files whose stat key (device, inode,
    size, mtime, ctime) the cache holds are not read (see `digest_cache`); the
    report says how many were reused."""
    folder = Path(folder)
    statement = read_signed_statement(signature_path, policy)
    check_statement(statement, policy, _relative_inside(folder, Path(signature_path)))
    expected = statement.manifest
    _check_listing(folder, statement, policy)
    cache = DigestCache.load(digest_cache) if digest_cache is not None else None
    actual, listed = hash_folder_listing(
        folder,
        expected.spec,
        expected.ignore_paths,
        max_workers=max_workers,
        cache=cache,
        limits=policy.limits,
    )
    if cache is not None:
        cache.save()
    missing, extra, changed = expected.diff(actual)
    # An empty file has no shard, so it is absent from a sharded manifest;
    # count it as extra rather than let it in unsigned.
    extra = sorted(set(extra) | {p for p in listed if p not in actual.files()})
    if missing or extra or changed:
        raise ManifestMismatchError(missing, extra, changed)
    if actual.digest != expected.digest:  # same files, e.g. different shard layout
        raise ManifestMismatchError([], [], sorted(actual.files()))
    check_signed_indexes(folder, expected, policy)
    return VerificationReport(
        ok=True,
        folder=str(folder),
        signer=statement.signer,
        manifest_digest=actual.digest,
        root_digest=actual.root_digest,
        release=statement.binding,
        files=sorted(actual.files()),
        binding_checked=policy.release is not None,
        certificate_validity=statement.certificate_validity,
        reused_digests=cache.reused if cache is not None else 0,
    )
