"""Verify-on-load for models larger than memory: the checkpoint's tensors are read
one at a time, after the folder's digest is confirmed, and each is checked
against the bytes that digest covered.

`read_verified_files` / `read_inspected_files` (verified_load) hold every file in
memory. Here the small files (config, tokenizer, index) are read and hashed the
same way, whole, but each `.safetensors` file is opened once (`_fs.open_file`:
O_NOFOLLOW on every component, regular files only; the descriptor is kept open
until `close`) and goes through two passes:

1. a streaming pass, in chunks, before anything is used: its strict header
   (`parse_header`, the checks `_check_loadable` makes on bytes in memory), the
   manifest resources of the whole file (the folder's digest is compared with the
   approved one, or returned, exactly as verified_load does), and a blake3 digest
   of each tensor's own bytes, taken from the same chunks;
2. `tensor(name)`: the tensor's bytes read again from the same descriptor into
   fresh memory, hashed, and used only if they match the digest of pass 1.

Why two passes rather than hashing while building the model: a file's digest is
confirmed only once its last byte is hashed, so tensors read in one pass would
all have to wait in memory for that (a shard can be most of the model, and a
layer's tensors need not be in file order). Why not a plain memory map after
pass 1: a map shows whatever is written into the file later, so a writer could
swap bytes between the check and the use. The per-tensor check costs one more
hash of the bytes used (blake3, several GB/s) and closes that gap: a tensor
changed on disk after pass 1 is refused (`TensorChangedError`), never used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import blake3
import torch

from gpuagent.integrity import _fs
from gpuagent.integrity.errors import (
    HashingError,
    IntegrityError,
    ManifestMismatchError,
)
from gpuagent.integrity.inspection import inspect_model
from gpuagent.integrity.manifest import (
    HashSpec,
    Manifest,
    Resource,
    _model_name,
    _new_hasher,
    _shards,
    default_ignore_paths,
    hash_bytes,
)
from gpuagent.integrity.policy import DEFAULT_POLICY, Policy
from gpuagent.integrity.safetensors_header import (
    HeaderRejected,
    SafetensorsHeader,
    parse_header,
)
from gpuagent.integrity.verified_load import (
    _check_loadable,
    _read_file,
    _refuse_unread,
    check_manifest,
    expectation,
)

CHUNK_BYTES = 16 << 20
# safetensors dtype -> torch dtype, for the tensors a checkpoint may hold
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TensorChangedError(IntegrityError):
    """A tensor's bytes differ from those the confirmed digest covered."""

    code = "tensor-changed"


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies, and the digest of its bytes in the checked pass."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int
    digest: bytes  # blake3


class StreamedModel:
    """A checked model folder: `files` (name -> bytes) for everything but the
    `.safetensors` files, `digest` the folder's manifest digest, `tensor(name)`
    one checkpoint tensor in fresh memory (module docstring). Close it (or use it
    as a context manager) to release the descriptors."""

    def __init__(
        self,
        files: dict[str, bytes],
        digest: str,
        headers: dict[str, SafetensorsHeader],
        refs: dict[str, TensorRef],
        fds: dict[str, int],
    ) -> None:
        self.files = files
        self.digest = digest
        self.headers = headers
        self.refs = refs
        self._fds = fds

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def tensor(self, name: str) -> torch.Tensor:
        """The checkpoint tensor `name` (a CPU tensor owning its memory), read now
        and refused (TensorChangedError) unless its bytes are those pass 1 hashed."""
        ref = self.refs[name]
        size = ref.end - ref.start
        dtype = TORCH_DTYPES.get(ref.dtype)
        if dtype is None:
            raise HashingError(f"{name}: dtype {ref.dtype} is not read")
        out = torch.empty(ref.shape, dtype=dtype)
        if size == 0:
            return out
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        fd, position = self._fds[ref.file], 0
        while position < size:
            got = os.preadv(fd, [view[position:]], ref.start + position)
            if got == 0:
                raise TensorChangedError(f"{ref.file} shrank after it was checked")
            position += got
        if blake3.blake3(view).digest() != ref.digest:
            raise TensorChangedError(
                f"{name} in {ref.file} changed after the folder's digest was checked"
            )
        return out


def open_inspected(
    model_dir: str | Path, *, policy: Policy | None = None
) -> StreamedModel:
    """What `read_inspected_files` does, tensors left on disk: `inspect_model`
    checks the folder, the small files are read, every file is hashed (sha256
    manifest, its digest in `.digest`), the strict checks run on what is used.
    Raises an `IntegrityError` subclass."""
    policy = policy or DEFAULT_POLICY
    model_dir = Path(model_dir)
    inspect_model(model_dir, policy)
    ignore = default_ignore_paths(policy.signature_names, policy.ignore_git_paths)
    return _open_checked(model_dir, HashSpec("files", "sha256"), ignore, policy)


def open_verified(
    model_dir: str | Path,
    expected_manifest_digest: str,
    *,
    signature_path: str | Path | None = None,
    policy: Policy | None = None,
) -> StreamedModel:
    """What `read_verified_files` does, tensors left on disk: the folder is
    opened only if its files hash to `expected_manifest_digest` (with
    `signature_path`, the signature, signer, ignore list and binding first, and
    a mismatch names the missing, extra and changed files), then the strict
    checks. Raises an `IntegrityError` subclass."""
    policy = policy or DEFAULT_POLICY
    model_dir = Path(model_dir)
    spec, signed, ignore = expectation(
        model_dir, expected_manifest_digest, signature_path, policy
    )

    def compare(actual: Manifest, uncovered: list[str]) -> None:
        check_manifest(actual, uncovered, signed, expected_manifest_digest)

    return _open_checked(model_dir, spec, ignore, policy, signed, compare)


def _open_checked(
    model_dir: Path,
    spec: HashSpec,
    ignore: list[str],
    policy: Policy,
    signed: Manifest | None = None,
    compare=None,
) -> StreamedModel:
    root_fd = _fs.open_root(model_dir)
    fds: dict[str, int] = {}
    try:
        listed = _fs.list_files(
            root_fd,
            _fs.normalize_ignore(ignore),
            policy.limits,
            prefix=_fs.prefix_bytes(model_dir),
        )
        if signed is not None:  # planted or missing files, before reading any
            names = {p for p, _ in listed}
            missing = sorted(set(signed.files()) - names)
            extra = sorted(names - set(signed.files()))
            if missing or extra:
                raise ManifestMismatchError(missing, extra, [])
        _refuse_unread(model_dir, listed, policy)
        _fs.check_dense(root_fd, listed)
        files: dict[str, bytes] = {}
        headers: dict[str, SafetensorsHeader] = {}
        refs: dict[str, TensorRef] = {}
        resources: list[Resource] = []
        rejected: dict[str, HeaderRejected] = {}
        for path, _size in listed:
            if not path.endswith(".safetensors"):
                data = _read_file(root_fd, path)
                files[path] = data
                resources += hash_bytes(path, data, spec, _Inline())
                continue
            fd, size = _fs.open_file(root_fd, path)
            fds[path] = fd
            try:
                headers[path] = parse_header(fd, size, policy)
            except HeaderRejected as e:
                rejected[path] = e  # hashed all the same; refused below
            found, file_refs = _stream_hash(fd, size, path, headers.get(path), spec)
            resources += found
            refs.update(file_refs)
        manifest = Manifest(
            _model_name(model_dir), spec, tuple(resources), tuple(ignore)
        )
        covered = set(manifest.files())
        uncovered = sorted(p for p, _ in listed if p not in covered)
        if compare is not None:
            compare(manifest, uncovered)
        elif uncovered:
            raise ManifestMismatchError([], uncovered, [])
        _check_loadable(model_dir, files, policy, ignore, headers, rejected)
        duplicated = _duplicates(headers)
        if duplicated:
            raise HashingError(f"tensors in more than one file: {duplicated}")
        return StreamedModel(files, manifest.digest, headers, refs, fds)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    finally:
        os.close(root_fd)


def _duplicates(headers: dict[str, SafetensorsHeader]) -> list[str]:
    seen: set[str] = set()
    dup = []
    for header in headers.values():
        for name in header.tensors:
            if name in seen:
                dup.append(name)
            seen.add(name)
    return sorted(dup)


class _Inline:
    """An executor that runs each call at once (hash_bytes of small files)."""

    def map(self, fn, *iterables):
        return list(map(fn, *iterables))


def _stream_hash(
    fd: int, size: int, path: str, header: SafetensorsHeader | None, spec: HashSpec
) -> tuple[list[Resource], dict[str, TensorRef]]:
    """Pass 1 over one file (module docstring): its manifest resources and the
    blake3 digest of every tensor, from one sequential read in chunks."""
    if spec.method == "files":
        ranges = [(0, size)]
    else:
        ranges = _shards(size, spec.shard_size)
    entries = header.tensors.values() if header else ()
    data_start = header.data_start if header else size
    spans = sorted(
        ((data_start + e.begin, data_start + e.end, e) for e in entries),
        key=lambda s: s[:2],
    )
    resources = []
    refs = {}
    range_i, span_i = 0, 0
    range_hasher = _new_hasher(spec.hash_type) if ranges else None
    span_hasher = blake3.blake3()
    buf = bytearray(CHUNK_BYTES)
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
    position = 0

    def finish_spans(upto: int) -> None:
        # tensors whose last byte is before `upto` are complete
        nonlocal span_i, span_hasher
        while span_i < len(spans) and spans[span_i][1] <= upto:
            start, end, e = spans[span_i]
            refs[e.name] = TensorRef(
                path, e.dtype, e.shape, start, end, span_hasher.digest()
            )
            span_hasher = blake3.blake3()
            span_i += 1

    finish_spans(0)  # empty tensors at offset 0
    while position < size:
        got = os.preadv(fd, [buf], position)
        if got == 0:
            raise HashingError(f"{path} shrank while hashing")
        chunk = memoryview(buf)[:got]
        end = position + got
        # manifest ranges
        offset = position
        while offset < end and range_i < len(ranges):
            r_start, r_end = ranges[range_i]
            take = min(end, r_end) - offset
            range_hasher.update(chunk[offset - position : offset - position + take])
            offset += take
            if offset == r_end:
                resources.append(
                    Resource(
                        path,
                        spec.digest_name,
                        range_hasher.hexdigest(),
                        *((r_start, r_end) if spec.method == "shards" else ()),
                    )
                )
                range_i += 1
                range_hasher = _new_hasher(spec.hash_type)
        # tensor spans (they tile the data buffer, in order)
        offset = max(position, data_start)
        while offset < end and span_i < len(spans):
            start, stop, _e = spans[span_i]
            offset = max(offset, start)
            take = min(end, stop) - offset
            if take > 0:
                span_hasher.update(chunk[offset - position : offset - position + take])
                offset += take
            finish_spans(offset)
            if offset >= end:
                break
        position = end
    if position != size or span_i != len(spans):
        raise HashingError(f"{path} changed size while hashing")
    return resources, refs
