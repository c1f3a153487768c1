"""Checks of a model folder before it is served and while it is live, all through
`gpuagent.integrity` (no hashing of our own).

`verify_for_deploy` runs before any server process starts: quarantined digest,
signature (signer, release binding, signed manifest) when one is given, every file
re-hashed against the approved manifest digest, `inspect_model`'s content checks, and
the recipe's weight format against the folder's config. `reverify` re-hashes a
deployed copy now and lists what differs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from gpuagent.integrity import (
    IntegrityError,
    Manifest,
    ManifestMismatchError,
    Policy,
    file_digests,
    inspect_model,
    verify_model,
)
from gpuagent.integrity.manifest import (
    HashSpec,
    default_ignore_paths,
    diff_files,
    hash_folder_listing,
)
from gpuagent.integrity.policy import (
    DEFAULT_POLICY,
    policy_from_trust_args,
    release_from_flags,
)
from gpuagent.integrity.signing import read_signed_statement
from gpuagent.protocol import DeploySpec, FileDigest, VerifyResult
from gpuagent.serving.errors import DeployRefusedError


@dataclass(frozen=True)
class Trust:
    """Where this agent finds the signature of a folder and whom it trusts: the
    engine CLI's trust flags (`--signature`, `--public-key`, ...), as paths on this
    agent. Without `signature_path` a folder is checked against the approved
    manifest digest only."""

    signature_path: Path | None = None
    public_keys: tuple[Path, ...] = ()
    certificate_chain: Path | None = None
    sigstore_trust_config: Path | None = None
    identity: str | None = None
    issuer: str | None = None


def trust_policy(trust: Trust, spec: DeploySpec) -> Policy:
    """The integrity policy `trust` and the spec's release binding ask for, built
    as the engine CLI builds it (`policy_from_trust_args`), so the agent's check and
    the engine's verify-on-load agree. Raises DeployRefusedError for a signature
    without a trust anchor or without the release it must be bound to."""
    if trust.signature_path is None:
        return DEFAULT_POLICY
    try:
        release = release_from_flags(
            spec.release_model or None,
            spec.release_version or None,
            spec.release_recipe or None,
            spec.release_parent_digest,
        )
        if release is None:
            raise ValueError(
                "a signature needs the release it must be bound to "
                "(release_model, release_version, release_recipe)"
            )
        args = SimpleNamespace(
            public_key=list(trust.public_keys),
            certificate_chain=trust.certificate_chain,
            sigstore_trust_config=trust.sigstore_trust_config,
            identity=trust.identity,
            issuer=trust.issuer,
            signature=Path(trust.signature_path),
        )
        return policy_from_trust_args(args, release=release)
    except ValueError as e:
        raise DeployRefusedError(str(e), code="bad-trust") from None


def verify_for_deploy(
    model_dir: Path,
    spec: DeploySpec,
    trust: Trust,
    *,
    quarantined: Sequence[str] = (),
) -> tuple[Manifest, list[FileDigest]]:
    """Everything checked before a server process may start; returns the manifest
    of the files as hashed now and their per-file digests. Raises
    DeployRefusedError naming the reason and, for a mismatch, the
    missing/extra/changed files."""
    digest = spec.manifest_digest
    check_not_quarantined(digest, spec, quarantined)
    policy = trust_policy(trust, spec)
    try:
        if trust.signature_path is not None:
            # Hashes every file once and names the differing ones itself.
            report = verify_model(model_dir, trust.signature_path, policy)
            if report.manifest_digest != digest:
                raise DeployRefusedError(
                    f"the signature signs {report.manifest_digest}, not the approved "
                    f"{digest}",
                    code="manifest-digest-mismatch",
                )
            # The files hashed to the signed manifest: it is theirs (no re-hash).
            manifest = read_signed_statement(trust.signature_path, policy).manifest
        else:
            result, manifest = _compare(model_dir, digest, spec.approved_files, policy)
            if not result.ok:
                raise _refusal(result)
        inspect_model(model_dir, policy)
    except ManifestMismatchError as e:
        raise DeployRefusedError(
            f"refused {model_dir}: [{e.code}] {e}",
            code=e.code,
            missing=e.missing,
            extra=e.extra,
            changed=e.changed,
        ) from None
    except IntegrityError as e:
        raise DeployRefusedError(
            f"refused {model_dir}: [{e.code}] {e}", code=e.code
        ) from None
    check_weight_format(model_dir, spec.recipe.weights)
    try:
        return manifest, file_digests(model_dir, manifest)
    except OSError as e:
        raise DeployRefusedError(
            f"the folder changed while it was verified: {e}", code="manifest-mismatch"
        ) from None


def check_not_quarantined(
    digest: str, spec: DeploySpec, quarantined: Sequence[str]
) -> None:
    """Refuse a digest the control plane (`spec.quarantined_digests`) or this
    agent (`quarantined`) has quarantined."""
    if digest in set(spec.quarantined_digests) | set(quarantined):
        raise DeployRefusedError(
            f"manifest digest {digest} is quarantined: no agent loads it again",
            code="quarantined",
        )


def reverify(
    model_dir: str | Path,
    manifest_digest: str,
    *,
    approved_files: Sequence[FileDigest] = (),
    signature_path: str | Path | None = None,
    policy: Policy | None = None,
) -> VerifyResult:
    """Re-hash the deployed copy in `model_dir` now and compare it with the approved
    `manifest_digest`. The missing/extra/changed lists come from the signed manifest
    (with `signature_path`, whose signature and binding are checked against
    `policy`) or from `approved_files` (the per-file digests recorded at approval);
    with neither, a mismatch has no file list and says so in `changed` as ["*"]. A
    folder that cannot be checked (gone: `missing` ["*"]; a symlink or special file
    inside, a bad signature) is a failed result with `error`, never a pass."""
    model_dir = Path(model_dir)
    policy = policy or DEFAULT_POLICY
    try:
        if signature_path is not None:
            try:
                report = verify_model(model_dir, signature_path, policy)
            except ManifestMismatchError as e:
                return VerifyResult(
                    ok=False,
                    manifest_digest=manifest_digest,
                    missing=e.missing,
                    extra=e.extra,
                    changed=e.changed,
                )
            # Every file was hashed against the signed manifest: not again.
            return VerifyResult(
                ok=report.manifest_digest == manifest_digest,
                manifest_digest=report.manifest_digest,
                changed=[] if report.manifest_digest == manifest_digest else ["*"],
            )
        result, _ = _compare(model_dir, manifest_digest, approved_files, policy)
        return result
    except IntegrityError as e:
        # Unreadable (gone, a symlink or special file planted, a bad signature):
        # a failure with the reason, never a pass.
        return VerifyResult(
            ok=False,
            manifest_digest="",
            missing=[] if model_dir.is_dir() else ["*"],
            error=f"[{e.code}] {e}",
        )


@dataclass(frozen=True)
class FolderFormat:
    """What an engine's flags depend on in a verified folder's config.json."""

    quantized: bool  # has a quantization_config (compressed-tensors)
    kv_scale_strategy: str | None  # its kv_cache_scheme's strategy; None: no scales
    max_position_embeddings: int | None


def check_weight_format(model_dir: Path, weights: str) -> FolderFormat:
    """The folder holds the recipe's weight format: unquantized weights for
    bf16/fp16 (no `quantization_config`, or one with no config groups that only
    declares fp8 KV scales), a compressed-tensors checkpoint for int8 and int4-g*.
    Read after verification, so these are the approved bytes; returns what the
    engine's flags depend on."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DeployRefusedError(
            f"cannot read config.json: {e}", code="bad-config"
        ) from None
    if not isinstance(config, dict):
        raise DeployRefusedError("config.json is not a JSON object", code="bad-config")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise DeployRefusedError(
            "config.json's quantization_config is not a JSON object", code="bad-config"
        )
    method = quant.get("quant_method") if quant else None
    if quant is not None and method != "compressed-tensors":
        raise DeployRefusedError(
            f"recipe weights={weights} needs a compressed-tensors checkpoint or none; "
            f"config.json has quant_method {method!r}",
            code="recipe-mismatch",
        )
    if weights in ("bf16", "fp16"):
        if quant is not None and quant.get("config_groups"):
            raise DeployRefusedError(
                f"recipe weights={weights} but config.json's quantization_config "
                f"quantizes weights ({method!r})",
                code="recipe-mismatch",
            )
    elif quant is None:
        raise DeployRefusedError(
            f"recipe weights={weights} needs a compressed-tensors checkpoint; "
            "config.json has no quantization_config",
            code="recipe-mismatch",
        )
    kv_scheme = (quant or {}).get("kv_cache_scheme")
    strategy = kv_scheme.get("strategy") if isinstance(kv_scheme, dict) else None
    positions = config.get("max_position_embeddings")
    return FolderFormat(
        quantized=quant is not None,
        kv_scale_strategy=strategy,
        max_position_embeddings=positions if isinstance(positions, int) else None,
    )


def _compare(
    model_dir: Path,
    manifest_digest: str,
    approved_files: Sequence[FileDigest],
    policy: Policy,
) -> tuple[VerifyResult, Manifest]:
    name, _, _hex = manifest_digest.rpartition(":")
    try:
        spec = HashSpec.from_digest_name(name)
    except (ValueError, IntegrityError) as e:
        raise DeployRefusedError(
            f"cannot use manifest digest {manifest_digest!r}: {e}",
            code="bad-digest",
        ) from None
    ignore = default_ignore_paths(policy.signature_names, policy.ignore_git_paths)
    actual, listed = hash_folder_listing(model_dir, spec, ignore)
    # An empty file has no shard: it would be served without being covered.
    uncovered = sorted(p for p in listed if p not in actual.files())
    if actual.digest == manifest_digest and not uncovered:
        return VerifyResult(ok=True, manifest_digest=actual.digest), actual
    if approved_files:
        missing, extra, changed = diff_files(
            {f.path: f.digest for f in approved_files},
            {f.path: f.digest for f in file_digests(model_dir, actual)},
        )
        extra = sorted(set(extra) | set(uncovered))
    else:
        missing, extra, changed = [], uncovered, ([] if uncovered else ["*"])
    if not (missing or extra or changed):
        changed = ["*"]  # same files, another layout: still not the approved bytes
    return (
        VerifyResult(
            ok=False,
            manifest_digest=actual.digest,
            missing=missing,
            extra=extra,
            changed=changed,
        ),
        actual,
    )


def describe_mismatch(result: VerifyResult) -> str:
    """ "missing: a; extra: b; changed: c" for the lists a result has."""
    return "; ".join(
        f"{label}: {', '.join(getattr(result, label))}"
        for label in ("missing", "extra", "changed")
        if getattr(result, label)
    )


def _refusal(result: VerifyResult) -> DeployRefusedError:
    return DeployRefusedError(
        f"model folder does not match the approved manifest (files hash to "
        f"{result.manifest_digest}): {describe_mismatch(result)}",
        code="manifest-mismatch",
        missing=result.missing,
        extra=result.extra,
        changed=result.changed,
    )
