"""Manifests: the digest of every file (or file shard) of a model, and one
manifest digest over all of them.

Resources, digest names and serialization parameters are exactly
model-signing's, so a manifest converts to and from the payload model-signing
signs: `sha256` or `blake3` for whole files, `sha256-sharded-<bytes>`
for shards. The manifest digest names the file digest too:
`<digest name>:<sha256 hex of the canonical manifest JSON>`, so a loader knows
how to recompute it; the name is inside the hashed JSON as well, so relabelling
the digest changes it. Unlike model-signing's root digest (SHA-256 over the
digests only), the manifest digest covers file names and hash parameters: a
renamed file changes it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import blake3

from gpuagent.integrity import _fs
from gpuagent.integrity.errors import HashingError, IntegrityError, UnsafePathError
from gpuagent.integrity.limits import DEFAULT_LIMITS, FolderLimits
from gpuagent.integrity.policy import GIT_PATHS

if TYPE_CHECKING:
    from gpuagent.protocol import FileDigest

MANIFEST_FORMAT = "releasegate-manifest/v1"
DEFAULT_SHARD_SIZE = 1_000_000_000  # model-signing's default shard size
_CHUNK_BYTES = 1 << 20
_DIGEST_NAMES = {"sha256": "sha256", "blake3": "blake3"}


@dataclass(frozen=True)
class HashSpec:
    """How files are hashed: model-signing's serialization parameters."""

    method: str = "files"  # "files" | "shards"
    hash_type: str = "sha256"  # "sha256" | "blake3"
    shard_size: int | None = None

    def __post_init__(self) -> None:
        if self.hash_type not in _DIGEST_NAMES:
            raise HashingError(f"unsupported hash type {self.hash_type!r}")
        if self.method == "shards":
            if self.hash_type == "blake3":
                raise HashingError("blake3 hashes whole files (it is parallel already)")
            if not isinstance(self.shard_size, int) or self.shard_size <= 0:
                raise HashingError(f"invalid shard size {self.shard_size!r}")
        elif self.method != "files" or self.shard_size is not None:
            raise HashingError(f"unsupported serialization {self.method!r}")

    @property
    def digest_name(self) -> str:
        """Name of each resource's digest; records every parameter of the digest."""
        base = _DIGEST_NAMES[self.hash_type]
        return f"{base}-sharded-{self.shard_size}" if self.method == "shards" else base

    @classmethod
    def from_digest_name(cls, name: str) -> HashSpec:
        base, sep, size = name.partition("-sharded-")
        hash_type = {v: k for k, v in _DIGEST_NAMES.items()}.get(base)
        if hash_type is None or (sep and not size.isdigit()):
            raise HashingError(f"unknown digest name {name!r}")
        if sep:
            return cls("shards", hash_type, int(size))
        return cls("files", hash_type)

    @classmethod
    def from_serialization(cls, args: dict[str, Any]) -> HashSpec:
        """From model-signing's signed `serialization` parameters."""
        method, hash_type = args.get("method"), args.get("hash_type")
        if method == "shards":
            size = args.get("shard_size")
            # The signed predicate is a protobuf Struct: numbers come back as floats.
            if isinstance(size, float) and size.is_integer():
                size = int(size)
            return cls("shards", hash_type, size)
        return cls(method, hash_type)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "hash_type": self.hash_type}
        if self.method == "shards":
            out["shard_size"] = self.shard_size
        return out


@dataclass(frozen=True)
class Resource:
    """One hashed object: a whole file, or the bytes [start, end) of one."""

    path: str
    algorithm: str
    digest: str  # hex
    start: int | None = None
    end: int | None = None

    @property
    def name(self) -> str:
        """model-signing's identifier: `path` or `path:start:end`."""
        return (
            self.path if self.start is None else f"{self.path}:{self.start}:{self.end}"
        )

    def sort_key(self) -> tuple:
        # model-signing orders by PurePosixPath (component-wise), then offsets;
        # its root digest depends on that order.
        return (PurePosixPath(self.path).parts, self.start or 0, self.end or 0)

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "algorithm": self.algorithm, "digest": self.digest}


@dataclass(frozen=True)
class Manifest:
    """Digests of a model folder. `ignore_paths` lists what was left out."""

    model_name: str
    spec: HashSpec
    resources: tuple[Resource, ...]
    ignore_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.resources, key=Resource.sort_key))
        object.__setattr__(self, "resources", ordered)
        object.__setattr__(self, "ignore_paths", tuple(sorted(set(self.ignore_paths))))

    def canonical_json(self) -> bytes:
        body = {
            "format": MANIFEST_FORMAT,
            "serialization": self.spec.to_dict(),
            "digest_name": self.spec.digest_name,
            "resources": [r.to_dict() for r in self.resources],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("ascii")

    @property
    def digest(self) -> str:
        """The manifest digest, `<digest name>:<hex>` (see the module docstring)."""
        body = hashlib.sha256(self.canonical_json()).hexdigest()
        return f"{self.spec.digest_name}:{body}"

    @property
    def root_digest(self) -> str:
        """model-signing's subject digest: SHA-256 over the resource digests."""
        h = hashlib.sha256()
        for r in self.resources:
            h.update(bytes.fromhex(r.digest))
        return h.hexdigest()

    def files(self) -> dict[str, tuple[Resource, ...]]:
        out: dict[str, list[Resource]] = {}
        for r in self.resources:
            out.setdefault(r.path, []).append(r)
        return {k: tuple(v) for k, v in out.items()}

    def diff(self, actual: Manifest) -> tuple[list[str], list[str], list[str]]:
        """(missing, extra, changed) paths of `actual` against this manifest."""
        return diff_files(self.files(), actual.files())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "model_name": self.model_name,
            "digest": self.digest,
            "root_digest": self.root_digest,
            "serialization": {
                **self.spec.to_dict(),
                "ignore_paths": list(self.ignore_paths),
            },
            "resources": [r.to_dict() for r in self.resources],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        serialization = dict(data["serialization"])
        ignore = serialization.pop("ignore_paths", [])
        spec = HashSpec.from_serialization(serialization)
        resources = [
            _resource(spec, r["name"], r["algorithm"], r["digest"])
            for r in data["resources"]
        ]
        manifest = cls(
            data.get("model_name", ""), spec, tuple(resources), tuple(ignore)
        )
        if "digest" in data and data["digest"] != manifest.digest:
            raise IntegrityError(
                f"manifest file digest {data['digest']} does not match its content"
            )
        return manifest

    def to_model_signing(self):
        """The equivalent `model_signing.manifest.Manifest` (what gets signed)."""
        from model_signing import manifest as ms_manifest
        from model_signing._hashing import hashing as ms_hashing

        args = {**self.spec.to_dict(), "allow_symlinks": False}
        if self.ignore_paths:
            args["ignore_paths"] = list(self.ignore_paths)
        serialization = ms_manifest.SerializationType.from_args(args)
        items = [
            serialization.new_item(
                r.name, ms_hashing.Digest(r.algorithm, bytes.fromhex(r.digest))
            )
            for r in self.resources
        ]
        return ms_manifest.Manifest(self.model_name, items, serialization)

    @classmethod
    def from_model_signing(cls, ms: Any) -> Manifest:
        args = dict(ms.serialization_type)
        spec = HashSpec.from_serialization(args)
        resources = [
            _resource(spec, rd.identifier, rd.digest.algorithm, rd.digest.digest_hex)
            for rd in ms.resource_descriptors()
        ]
        ignore = [str(p) for p in args.get("ignore_paths", [])]
        return cls(ms.model_name, spec, tuple(resources), tuple(ignore))


def diff_files(
    expected: Mapping[str, Any], actual: Mapping[str, Any]
) -> tuple[list[str], list[str], list[str]]:
    """(missing, extra, changed) sorted paths of `actual` against `expected`, both
    path -> digest(s)."""
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    changed = sorted(
        p for p in expected.keys() & actual.keys() if expected[p] != actual[p]
    )
    return missing, extra, changed


def _resource(spec: HashSpec, name: str, algorithm: str, digest: str) -> Resource:
    if spec.method == "shards":
        path, start, end = name.rsplit(":", 2)
        return Resource(path, algorithm, digest, int(start), int(end))
    return Resource(name, algorithm, digest)


def default_ignore_paths(
    extra: list[str] | tuple[str, ...] = (), ignore_git_paths: bool = True
) -> list[str]:
    return _fs.normalize_ignore(
        list(extra) + (list(GIT_PATHS) if ignore_git_paths else [])
    )


# --- hashing ---------------------------------------------------------------


def _new_hasher(hash_type: str, blake3_threads: int = blake3.blake3.AUTO):
    if hash_type == "sha256":
        return hashlib.sha256()
    return blake3.blake3(max_threads=blake3_threads)


def _blake3_threads(sizes: list[int], cpus: int) -> int:
    """Threads per blake3 hasher. With the bytes spread over enough files, one
    thread each: the files already keep every core busy, and blake3's own threads
    on top only contend (2 GB in 4 files on 2 cores: 0.18 s vs 0.22-0.25 s). A
    file holding more than a core's share is split across threads instead, or it
    would finish alone on one core."""
    total = sum(sizes)
    if len(sizes) >= cpus and max(sizes, default=0) * cpus <= total:
        return 1
    return blake3.blake3.AUTO


def _shards(size: int, shard_size: int) -> list[tuple[int, int]]:
    # model-signing: an empty file has no shards at all.
    return [(s, min(s + shard_size, size)) for s in range(0, size, shard_size)]


_local = threading.local()


def _buffer() -> memoryview:
    if not hasattr(_local, "buf"):
        _local.buf = memoryview(bytearray(_CHUNK_BYTES))
    return _local.buf


def _hash_range(
    fd: int, start: int, end: int, hash_type: str, blake3_threads: int
) -> str:
    """Digest of bytes [start, end) of `fd`, read with preadv into a reused
    buffer small enough to stay in cache between the copy and the hash
    (hashlib and blake3 release the GIL on large updates)."""
    hasher, buf, position = _new_hasher(hash_type, blake3_threads), _buffer(), start
    # A larger kernel readahead window keeps a cold disk busy while we hash.
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
    while position < end:
        want = min(len(buf), end - position)
        got = os.preadv(fd, [buf[:want]], position)
        if got == 0:
            raise HashingError("file shrank while hashing")
        hasher.update(buf[:got])
        position += got
    return hasher.hexdigest()


def _hash_item(
    root_fd: int,
    spec: HashSpec,
    path: str,
    size: int,
    start: int | None,
    end: int | None,
    blake3_threads: int,
) -> Resource:
    fd, now = _fs.open_file(root_fd, path)
    try:
        if now != size:
            raise HashingError(f"{path} changed size while hashing ({size} -> {now})")
        if start is None:
            digest = _hash_range(fd, 0, size, spec.hash_type, blake3_threads)
            return Resource(path, spec.digest_name, digest)
        digest = _hash_range(fd, start, end, spec.hash_type, blake3_threads)
        return Resource(path, spec.digest_name, digest, start, end)
    finally:
        os.close(fd)


def hash_folder(
    folder: str | Path,
    spec: HashSpec,
    ignore_paths: list[str] | tuple[str, ...],
    *,
    max_workers: int | None = None,
    limits: FolderLimits = DEFAULT_LIMITS,
) -> Manifest:
    """Our own hasher (used by verification): fd-based, symlinks, special
    files, the names and limits `limits` refuses and sparse files refused
    before anything is hashed, files and shards hashed in parallel threads.
    Produces exactly the digests model-signing produces for the same spec."""
    return hash_folder_listing(
        folder, spec, ignore_paths, max_workers=max_workers, limits=limits
    )[0]


def hash_folder_listing(
    folder: str | Path,
    spec: HashSpec,
    ignore_paths: list[str] | tuple[str, ...],
    *,
    max_workers: int | None = None,
    cache: Any = None,
    limits: FolderLimits = DEFAULT_LIMITS,
) -> tuple[Manifest, list[str]]:
    """`hash_folder`, plus the paths of every file found (a sharded manifest
    has no entry for an empty file). With a `digest_cache.DigestCache`, a file
    whose stat key it holds is not read: its digests are the cache's."""
    ignore = _fs.normalize_ignore(ignore_paths)
    root_fd = _fs.open_root(folder)
    try:
        files = _fs.list_files(root_fd, ignore, limits, prefix=_fs.prefix_bytes(folder))
        _fs.check_dense(root_fd, files)
        reused: list[Resource] = []
        keys: dict[str, tuple[int, ...]] = {}
        to_hash = []
        for path, size in files:
            if cache is not None:
                keys[path] = _stat_key(root_fd, path)
                found = cache.lookup(spec.digest_name, path, keys[path])
                if found is not None:
                    reused.extend(found)
                    continue
            to_hash.append((path, size))
        items: list[tuple[str, int, int | None, int | None]] = []
        for path, size in to_hash:
            if spec.method == "shards":
                items.extend(
                    (path, size, s, e) for s, e in _shards(size, spec.shard_size)
                )
            else:
                items.append((path, size, None, None))
        # Biggest first, so one large file does not end the run alone.
        items.sort(key=lambda it: -((it[3] - it[2]) if it[2] is not None else it[1]))
        # More threads than cores: while one waits on a cold read, another hashes.
        cpus = os.cpu_count() or 1
        workers = max_workers or 2 * cpus
        threads = _blake3_threads([size for _, size in files], cpus)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            resources = list(
                pool.map(lambda it: _hash_item(root_fd, spec, *it, threads), items)
            )
        if cache is not None:
            _remember(cache, root_fd, spec, [p for p, _ in to_hash], keys, resources)
    except OSError as e:
        raise HashingError(f"cannot hash {folder}: {e}") from e
    finally:
        os.close(root_fd)
    resources = reused + resources
    manifest = Manifest(_model_name(folder), spec, tuple(resources), tuple(ignore))
    return manifest, [path for path, _ in files]


def _stat_key(root_fd: int, path: str) -> tuple[int, ...]:
    fd, _ = _fs.open_file(root_fd, path)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(
    cache: Any,
    root_fd: int,
    spec: HashSpec,
    hashed: list[str],
    keys: dict[str, tuple[int, ...]],
    resources: list[Resource],
) -> None:
    """Stores the digests of each hashed file whose stat key did not change
    while it was hashed."""
    by_path: dict[str, list[Resource]] = {path: [] for path in hashed}
    for r in resources:
        by_path[r.path].append(r)
    for path, found in by_path.items():
        cache.hashed += 1
        if _stat_key(root_fd, path) == keys[path]:
            cache.store(spec.digest_name, path, keys[path], found)


def hash_bytes(
    path: str, data: bytes, spec: HashSpec, pool: concurrent.futures.Executor
) -> list[Resource]:
    """Resources of one file whose whole content is `data` (verify-on-load)."""
    view = memoryview(data)

    def digest(start: int, end: int) -> str:
        hasher = _new_hasher(spec.hash_type)
        hasher.update(view[start:end])
        return hasher.hexdigest()

    if spec.method == "files":
        return [Resource(path, spec.digest_name, digest(0, len(data)))]
    ranges = _shards(len(data), spec.shard_size)
    digests = list(pool.map(lambda r: digest(*r), ranges))
    return [
        Resource(path, spec.digest_name, d, s, e)
        for (s, e), d in zip(ranges, digests, strict=True)
    ]


def _model_name(folder: str | Path) -> str:
    name = Path(folder).name
    return name if name and name != ".." else os.path.basename(Path(folder).resolve())


def hash_model(
    folder: str | Path,
    algorithm: str = "sha256",
    *,
    shard_size: int | None = None,
    ignore_paths: list[str] | tuple[str, ...] = (),
    ignore_git_paths: bool = True,
    max_workers: int | None = None,
    limits: FolderLimits = DEFAULT_LIMITS,
) -> Manifest:
    """Hashes every file of `folder` in parallel into a `Manifest`.

    `algorithm` "sha256" (default) goes through model-signing's own
    serialization (`model_signing.hashing`), so the digests are the upstream
    tool's; with `shard_size` files are hashed in shards of that many bytes
    ("sha256-sharded-<n>"). "blake3" hashes whole files with the multithreaded
    `blake3` package. Symlinks, special files and the names and limits
    `limits` refuses are refused (UnsafePathError), sparse files too
    (SparseFileError), before anything is hashed.
    """
    ignore = default_ignore_paths(ignore_paths, ignore_git_paths)
    if algorithm == "blake3":
        if shard_size is not None:
            raise HashingError("blake3 does not use shards")
        return hash_folder(
            folder,
            HashSpec("files", "blake3"),
            ignore,
            max_workers=max_workers,
            limits=limits,
        )
    if algorithm != "sha256":
        raise HashingError(f"unsupported algorithm {algorithm!r}")
    spec = (
        HashSpec("shards", algorithm, shard_size)
        if shard_size
        else HashSpec("files", algorithm)
    )
    root = Path(folder)
    if not root.is_dir():
        raise HashingError(f"model folder {folder} does not exist or is not a folder")
    # model-signing follows a symlinked folder silently when listing; refuse
    # links, names, limits and holes up front so both hashers refuse alike.
    root_fd = _fs.open_root(root)
    try:
        files = _fs.list_files(root_fd, ignore, limits, prefix=_fs.prefix_bytes(root))
        _fs.check_dense(root_fd, files)
    finally:
        os.close(root_fd)
    from model_signing import hashing as ms_hashing

    config = ms_hashing.Config().set_ignored_paths(paths=ignore, ignore_git_paths=False)
    if spec.method == "shards":
        config.use_shard_serialization(
            hashing_algorithm=algorithm, shard_size=shard_size, max_workers=max_workers
        )
    else:
        config.use_file_serialization(
            hashing_algorithm=algorithm, max_workers=max_workers
        )
    try:
        ms_manifest = config.hash(pathlib.Path(folder))
    except ValueError as e:
        raise UnsafePathError(f"model-signing refused {folder}: {e}") from e
    except OSError as e:
        raise HashingError(f"cannot hash {folder}: {e}") from e
    # model-signing records ignore paths only when they were given at hash time;
    # record ours explicitly so both hashers agree on the manifest.
    manifest = Manifest.from_model_signing(ms_manifest)
    return Manifest(manifest.model_name, spec, manifest.resources, tuple(ignore))


def file_digests(
    folder: str | Path, manifest: Manifest | None = None
) -> list[FileDigest]:
    """Per-file digests of `folder` as the agents and the control plane exchange
    them (`gpuagent.protocol.FileDigest`: a sharded file is `shards:<count>`), from
    `manifest` (default: `hash_model(folder)`)."""
    from gpuagent.protocol import FileDigest

    manifest = manifest if manifest is not None else hash_model(folder)
    files = []
    for relpath, resources in manifest.files().items():
        digest = (
            f"{resources[0].algorithm}:{resources[0].digest}"
            if len(resources) == 1
            else f"shards:{len(resources)}"
        )
        size = os.stat(Path(folder) / relpath).st_size
        files.append(FileDigest(path=relpath, size_bytes=size, digest=digest))
    return files
