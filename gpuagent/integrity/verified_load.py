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
from pathlib import Path

from gpuagent.integrity import _fs
from gpuagent.integrity.errors import (
    HashingError,
    ManifestDigestMismatchError,
    ManifestMismatchError,
    ModelRejectedError,
)
from gpuagent.integrity.inspection import FileVerdict, InspectionReport
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
    changed files. Every returned safetensors header then passes the strict
    checks of `inspect_model` (else `ModelRejectedError`). Raises an
    `IntegrityError` subclass on any failure.
    """
    policy = policy or DEFAULT_POLICY
    model_dir = Path(model_dir)
    name, _, _hex = expected_manifest_digest.rpartition(":")
    spec = HashSpec.from_digest_name(name)
    signed: Manifest | None = None
    if signature_path is not None:
        statement = read_signed_statement(signature_path, policy)
        check_statement(
            statement, policy, _relative_inside(model_dir, Path(signature_path))
        )
        signed = statement.manifest
        if signed.digest != expected_manifest_digest:
            raise ManifestDigestMismatchError(expected_manifest_digest, signed.digest)
        ignore = list(signed.ignore_paths)
    else:
        ignore = default_ignore_paths(policy.signature_names, policy.ignore_git_paths)

    root_fd = _fs.open_root(model_dir)
    try:
        listed = _fs.list_files(root_fd, _fs.normalize_ignore(ignore))
        if signed is not None:
            # Refuse planted or missing files before reading anything: a planted
            # file may be huge (or sparse) and must not be read into memory.
            names = {p for p, _ in listed}
            missing = sorted(set(signed.files()) - names)
            extra = sorted(names - set(signed.files()))
            if missing or extra:
                raise ManifestMismatchError(missing, extra, [])
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
    actual = Manifest(_model_name(model_dir), spec, tuple(resources), tuple(ignore))
    # An empty file has no shard: it would be loaded without being covered.
    uncovered = sorted(p for p in files if p not in actual.files())
    if signed is not None:
        missing, extra, changed = signed.diff(actual)
        extra = sorted(set(extra) | set(uncovered))
        if missing or extra or changed:
            raise ManifestMismatchError(missing, extra, changed)
    elif uncovered:
        raise ManifestMismatchError([], uncovered, [])
    if actual.digest != expected_manifest_digest:
        raise ManifestDigestMismatchError(expected_manifest_digest, actual.digest)
    _check_headers(model_dir, files, policy)
    return files


def _check_headers(model_dir: Path, files: dict[str, bytes], policy: Policy) -> None:
    """The strict safetensors checks of `inspect_model`, on the very bytes the
    engine gets: the approved digest may have been taken of bytes swapped in
    after inspection, and the engine's parser takes what ours refuses
    (duplicate names, unknown fields)."""
    verdicts = []
    for path in sorted(p for p in files if p.endswith(".safetensors")):
        verdict = FileVerdict(path, "safetensors")
        try:
            parse_header_bytes(files[path], policy)
        except HeaderRejected as e:
            verdict.reject(e.code, e.detail)
        verdicts.append(verdict)
    report = InspectionReport(str(model_dir), verdicts)
    if not report.ok:
        raise ModelRejectedError(report)
