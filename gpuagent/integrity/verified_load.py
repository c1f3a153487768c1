"""Verify-on-load: read a model folder once, hash exactly the bytes that will
be loaded, and hand those bytes (never the paths) to the engine.

Each file is opened once through `_fs.open_file` (O_NOFOLLOW on every path
component, regular files only), read fully into an immutable `bytes`, and that
same object is hashed and returned. A file swapped on disk after this call
cannot reach the engine; one swapped during it changes the digest and is
refused.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from gpuagent.integrity import _fs
from gpuagent.integrity.errors import (
    HashingError,
    ManifestDigestMismatchError,
    ManifestMismatchError,
    ModelRejectedError,
)
from gpuagent.integrity.inspection import (
    FileVerdict,
    InspectionReport,
    check_file_name,
    check_file_size,
    check_format_bytes,
    check_index_references,
    check_json_bytes,
    inspect_model,
    path_kind,
)
from gpuagent.integrity.manifest import (
    HashSpec,
    Manifest,
    _model_name,
    default_ignore_paths,
    hash_bytes,
)
from gpuagent.integrity.policy import DEFAULT_POLICY, Policy
from gpuagent.integrity.safetensors_header import HeaderRejected, parse_header_bytes
from gpuagent.integrity.signing import (
    _relative_inside,
    check_statement,
    read_signed_statement,
)


def _read_file(root_fd: int, path: str) -> bytes:
    fd, _size = _fs.open_file(root_fd, path)
    try:
        with io.FileIO(fd, "rb", closefd=False) as f:
            return f.readall()
    except OSError as e:
        raise HashingError(f"cannot read {path}: {e}") from e
    finally:
        os.close(fd)


def read_verified_files(
    model_dir: str | Path,
    expected_manifest_digest: str,
    *,
    signature_path: str | Path | None = None,
    policy: Policy | None = None,
) -> dict[str, bytes]:
    """Reads every file of `model_dir` (relative posix name -> content) and
    returns it only if the content hashes to `expected_manifest_digest`.

    With `signature_path`, the signature, signer, ignore list and release
    binding are verified first (see `verify_model`) and the signed manifest
    must be the expected one; a mismatch then names the missing, extra and
    changed files. The returned bytes then pass `inspect_model`'s checks for
    what the engine parses (`_check_loadable`: no code files, strict JSON and
    safetensors headers; else `ModelRejectedError`). Raises an `IntegrityError`
    subclass on any failure.
    """
    policy = policy or DEFAULT_POLICY
    model_dir = Path(model_dir)
    spec, signed, ignore = expectation(
        model_dir, expected_manifest_digest, signature_path, policy
    )
    files, actual = _read_and_hash(model_dir, spec, ignore, policy, signed)
    # An empty file has no shard: it would be loaded without being covered.
    uncovered = sorted(p for p in files if p not in actual.files())
    check_manifest(actual, uncovered, signed, expected_manifest_digest)
    _check_loadable(model_dir, files, policy, ignore)
    return files


def expectation(
    model_dir: Path,
    expected_manifest_digest: str,
    signature_path: str | Path | None,
    policy: Policy,
) -> tuple[HashSpec, Manifest | None, list[str]]:
    """What a folder must hash to before anything of it is used: (the hash spec
    the expected digest names, the signed manifest or None, the paths left out).
    With `signature_path`, the signature, signer, ignore list and binding are
    checked first and the signed manifest must be the expected one."""
    name, _, _hex = expected_manifest_digest.rpartition(":")
    spec = HashSpec.from_digest_name(name)
    if signature_path is None:
        ignore = default_ignore_paths(policy.signature_names, policy.ignore_git_paths)
        return spec, None, ignore
    statement = read_signed_statement(signature_path, policy)
    check_statement(
        statement, policy, _relative_inside(model_dir, Path(signature_path))
    )
    signed = statement.manifest
    if signed.digest != expected_manifest_digest:
        raise ManifestDigestMismatchError(expected_manifest_digest, signed.digest)
    return spec, signed, list(signed.ignore_paths)


def check_manifest(
    actual: Manifest,
    uncovered: list[str],
    signed: Manifest | None,
    expected_manifest_digest: str,
) -> None:
    """The folder as hashed (`actual`; `uncovered`: files read that no shard
    covers) against the signed manifest, naming the missing, extra and changed
    files, then against the expected digest."""
    if signed is not None:
        missing, extra, changed = signed.diff(actual)
        extra = sorted(set(extra) | set(uncovered))
        if missing or extra or changed:
            raise ManifestMismatchError(missing, extra, changed)
    elif uncovered:
        raise ManifestMismatchError([], uncovered, [])
    if actual.digest != expected_manifest_digest:
        raise ManifestDigestMismatchError(expected_manifest_digest, actual.digest)


def read_inspected_files(
    model_dir: str | Path, *, policy: Policy | None = None
) -> tuple[dict[str, bytes], str]:
    """For a folder with no approved digest to compare against: what
    `read_verified_files` does but the comparison. `inspect_model` checks the
    folder, every file is read once, the strict checks run on the bytes
    returned, and the sha256 manifest digest of those bytes comes back with
    them (pin it next time). Raises an `IntegrityError` subclass."""
    policy = policy or DEFAULT_POLICY
    model_dir = Path(model_dir)
    inspect_model(model_dir, policy)
    ignore = default_ignore_paths(policy.signature_names, policy.ignore_git_paths)
    files, actual = _read_and_hash(
        model_dir, HashSpec("files", "sha256"), ignore, policy
    )
    _check_loadable(model_dir, files, policy, ignore)
    return files, actual.digest


def _read_and_hash(
    model_dir: Path,
    spec: HashSpec,
    ignore: list[str],
    policy: Policy,
    signed: Manifest | None = None,
) -> tuple[dict[str, bytes], Manifest]:
    """Every file of the folder, read once, and the manifest of those bytes.
    Before reading anything: the folder's names and limits, then (with
    `signed`) planted or missing files, then refusals by name and size, then
    holes: a planted file may be huge or sparse and must not be read into
    memory."""
    root_fd = _fs.open_root(model_dir)
    try:
        listed = _fs.list_files(
            root_fd,
            _fs.normalize_ignore(ignore),
            policy.limits,
            prefix=_fs.prefix_bytes(model_dir),
        )
        if signed is not None:
            names = {p for p, _ in listed}
            missing = sorted(set(signed.files()) - names)
            extra = sorted(names - set(signed.files()))
            if missing or extra:
                raise ManifestMismatchError(missing, extra, [])
        _refuse_unread(model_dir, listed, policy)
        _fs.check_dense(root_fd, listed)
        cpus = os.cpu_count() or 1
        # Twice as many readers as cores: one hashes while another waits on disk.
        with (
            concurrent.futures.ThreadPoolExecutor(max_workers=2 * cpus) as readers,
            concurrent.futures.ThreadPoolExecutor(max_workers=cpus) as hashers,
        ):

            def load(path: str):
                data = _read_file(root_fd, path)
                return path, data, hash_bytes(path, data, spec, hashers)

            results = list(readers.map(load, [p for p, _ in listed]))
    finally:
        os.close(root_fd)
    files = {path: data for path, data, _ in results}
    resources = [r for _, _, rs in results for r in rs]
    return files, Manifest(
        _model_name(model_dir), spec, tuple(resources), tuple(ignore)
    )


def _refuse_unread(
    model_dir: Path, listed: list[tuple[str, int]], policy: Policy
) -> None:
    """What `inspect_model` refuses by name and size alone (a digest may have
    been approved without an inspection, or under an older policy), refused
    before any file is read: code files, names the allow-list does not admit,
    JSON and text over their limits."""
    verdicts = []
    for path, size in listed:
        verdict = FileVerdict(path, path_kind(path, policy))
        check_file_name(path, verdict)
        check_file_size(size, verdict, policy)
        verdicts.append(verdict)
    report = InspectionReport(str(model_dir), verdicts)
    if not report.ok:
        raise ModelRejectedError(report)


def _check_loadable(
    model_dir: Path,
    files: dict[str, bytes],
    policy: Policy,
    ignore: list[str],
    headers: Mapping[str, object] = MappingProxyType({}),
    rejected: Mapping[str, HeaderRejected] = MappingProxyType({}),
) -> None:
    """The strict checks of `inspect_model`, on the very bytes the engine gets,
    for every file the engine parses: the approved digest may have been taken of
    bytes swapped in after inspection, and the engine's parsers take what ours
    refuse (duplicate names or keys, unknown fields, a shard by another name).
    JSON files get the strict JSON checks (an index its schema too, and its
    shards must be `.safetensors` files among `files`, not under `ignore`),
    every `.safetensors` file the strict header checks, text and tokenizer
    models their format checks. Files the manifest ignores are not read, so
    not checked (names were refused before reading, `_refuse_unread`).

    `headers` / `rejected` (streamed_load): `.safetensors` files not in `files`
    whose header was parsed strictly from the file itself, and those refused."""
    every = set(files) | set(headers) | set(rejected)
    kinds = {path: path_kind(path, policy) for path in every}
    verdicts = []
    for path in sorted(every):
        verdict = FileVerdict(path, kinds[path])
        if verdict.kind in ("text", "tokenizer-model"):
            check_format_bytes(files[path], verdict)
        elif verdict.kind in ("json", "index", "signature"):
            check_json_bytes(files[path], verdict, policy)
            if verdict.kind == "index":
                check_index_references(verdict, kinds, ignore)
        elif path in rejected:
            verdict.reject(rejected[path].code, rejected[path].detail)
        elif verdict.kind == "safetensors" and path in files:
            try:
                parse_header_bytes(files[path], policy)
            except HeaderRejected as e:
                verdict.reject(e.code, e.detail)
        verdicts.append(verdict)
    report = InspectionReport(str(model_dir), verdicts)
    if not report.ok:
        raise ModelRejectedError(report)
