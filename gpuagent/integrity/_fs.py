"""Folder walking and file opening that never follows a symlink.

Every file is opened relative to a directory fd, one path component at a time,
with O_NOFOLLOW, and checked to be a regular file on the open fd (fstat), so a
symlink or FIFO swapped in after the listing is refused rather than followed.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from gpuagent.integrity._text import printable
from gpuagent.integrity.errors import HashingError, SparseFileError, UnsafePathError
from gpuagent.integrity.limits import DEFAULT_LIMITS, FolderLimits, name_problem

# O_NONBLOCK: opening a FIFO swapped in for a file must not hang the agent.
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Refused by name even where a manifest ignores the path (see `limits`).
_REFUSED_WHEN_IGNORED = frozenset({"vcs-metadata", "hidden-path"})


@dataclass(frozen=True)
class Entry:
    """One directory entry, as found (symlinks not followed). `problem`: (code,
    detail) when the entry is refused by name or past a limit of the walk; such
    a folder is not entered, such a file must not be read."""

    path: str  # posix path relative to the root ("." for the root itself)
    kind: str  # "file" | "dir" | "symlink" | "special" | "folder"
    size: int
    link_target: str | None = None
    problem: tuple[str, str] | None = None


def normalize_ignore(paths: list[str] | tuple[str, ...] | frozenset[str]) -> list[str]:
    """Relative posix forms of ignore paths ("./a/" -> "a")."""
    out = []
    for p in paths:
        text = str(PurePosixPath(str(p)))
        out.append(text)
    return sorted(set(out))


def is_ignored(path: str, ignore: list[str] | tuple[str, ...]) -> bool:
    """Same rule as model-signing: a path is ignored if it is or lies under one."""
    return any(path == ig or path.startswith(ig + "/") for ig in ignore)


def open_root(folder: str | Path) -> int:
    """Opens the model folder itself (the root may be a symlink, e.g. `current`)."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise HashingError(f"model folder {folder} does not exist") from e
    except NotADirectoryError as e:
        raise HashingError(f"model path {folder} is not a folder") from e
    except OSError as e:
        raise HashingError(f"cannot open model folder {folder}: {e}") from e


def prefix_bytes(folder: str | Path) -> int:
    """Bytes a loader puts in front of a relative path: the folder's absolute
    path and a separator (see `limits.name_problem`)."""
    return len(os.fsencode(os.path.abspath(folder))) + 1


def scan_tree(
    root_fd: int,
    limits: FolderLimits = DEFAULT_LIMITS,
    *,
    ignore: list[str] | tuple[str, ...] = (),
    prefix: int = 0,
) -> list[Entry]:
    """Every entry under the root, depth first, sorted; symlinks are reported,
    never followed, and ignored paths left out (but for hidden ones, refused
    all the same). Entries refused by name or past a limit of `limits` carry
    their `problem` (a folder too deep is not entered); past `max_entries` the
    walk stops with an entry "folder-too-many-files" for the folder it was in.
    `prefix`: see `prefix_bytes`. Raises OSError when a folder can't be read."""
    walk = _Walk(limits, ignore, prefix)
    walk.folder(root_fd, "", 1)
    return walk.entries


class _Walk:
    def __init__(
        self, limits: FolderLimits, ignore: list[str] | tuple[str, ...], prefix: int
    ):
        self.limits, self.ignore, self.prefix = limits, ignore, prefix
        self.entries: list[Entry] = []
        self.total_bytes = 0
        self.full = False

    def folder(self, dir_fd: int, prefix: str, depth: int) -> None:
        budget = self.limits.max_entries - len(self.entries)
        found = []
        with os.scandir(dir_fd) as it:
            for item in it:  # bounded before sorting: a folder may hold millions
                found.append(item)
                if len(found) > budget:
                    self.full = True
                    detail = (
                        f"more than {self.limits.max_entries} files and folders; "
                        "the rest is not listed"
                    )
                    problem = ("folder-too-many-files", detail)
                    where = prefix.rstrip("/") or "."
                    self.entries.append(Entry(where, "folder", 0, problem=problem))
                    return
        for item in sorted(found, key=lambda e: e.name):
            if self.full:
                return
            self.entry(dir_fd, item, prefix, depth)

    def entry(self, dir_fd: int, item: os.DirEntry, prefix: str, depth: int) -> None:
        path = f"{prefix}{item.name}"
        problem = name_problem(path, self.limits, self.prefix)
        ignored = is_ignored(path, self.ignore)
        if ignored and (problem is None or problem[0] not in _REFUSED_WHEN_IGNORED):
            return
        st = item.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(item.name, dir_fd=dir_fd)
            self.entries.append(Entry(path, "symlink", 0, target, problem))
        elif stat.S_ISDIR(st.st_mode):
            if problem is None and depth > self.limits.max_depth:
                detail = f"folders nested deeper than {self.limits.max_depth} levels"
                problem = ("folder-too-deep", detail)
            self.entries.append(Entry(path, "dir", 0, problem=problem))
            if problem is None:
                sub = os.open(item.name, _O_DIR, dir_fd=dir_fd)
                try:
                    self.folder(sub, path + "/", depth + 1)
                finally:
                    os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            before, limit = self.total_bytes, self.limits.max_total_bytes
            self.total_bytes += st.st_size
            if problem is None and before <= limit < self.total_bytes:
                # The file that crosses the limit names it.
                problem = (
                    "folder-too-large",
                    f"the folder's files add up to more than {limit} bytes",
                )
            self.entries.append(Entry(path, "file", st.st_size, problem=problem))
        else:
            self.entries.append(Entry(path, "special", 0, problem=problem))


def refusal(entry: Entry) -> str | None:
    """Why a hasher or reader refuses `entry`, or None for a regular file."""
    if entry.problem is not None:
        return f"{printable(entry.path)}: {entry.problem[1]}"
    if entry.kind == "symlink":
        return f"{printable(entry.path)} is a symlink; symlinks are refused"
    if entry.kind == "special":
        return f"{printable(entry.path)} is a special file (not a regular file)"
    return None


def list_files(
    root_fd: int,
    ignore: list[str],
    limits: FolderLimits = DEFAULT_LIMITS,
    *,
    prefix: int = 0,
) -> list[tuple[str, int]]:
    """(path, size) of every regular file not ignored; raises UnsafePathError,
    naming every one, when anything outside the ignored paths is refused: a
    symlink, a special file, a name or a limit of `limits` (`scan_tree`)."""
    try:
        entries = scan_tree(root_fd, limits, ignore=ignore, prefix=prefix)
    except OSError as e:
        raise HashingError(f"cannot list the model folder: {e}") from e
    refused = [r for r in map(refusal, entries) if r is not None]
    if len(refused) == 1:
        raise UnsafePathError(refused[0])
    if refused:
        raise UnsafePathError(
            f"{len(refused)} paths refused:\n" + "\n".join(f"  {r}" for r in refused)
        )
    return [(e.path, e.size) for e in entries if e.kind == "file"]


def list_folder(
    folder: str | Path, ignore: list[str], limits: FolderLimits = DEFAULT_LIMITS
) -> list[tuple[str, int]]:
    """`list_files` of a folder given by its path."""
    root_fd = open_root(folder)
    try:
        return list_files(root_fd, ignore, limits, prefix=prefix_bytes(folder))
    finally:
        os.close(root_fd)


def open_file(root_fd: int, path: str) -> tuple[int, int]:
    """Opens `path` (relative) without following any symlink on the way.

    Returns (fd, size); the caller closes the fd.
    """
    parts = PurePosixPath(path).parts
    if not parts or any(p in ("..", "/", "") for p in parts) or path.startswith("/"):
        raise UnsafePathError(f"{path!r} is not a path inside the model folder")
    dir_fd = root_fd
    opened: list[int] = []
    try:
        for part in parts[:-1]:
            dir_fd = os.open(part, _O_DIR, dir_fd=dir_fd)
            opened.append(dir_fd)
        fd = os.open(parts[-1], _O_FILE, dir_fd=dir_fd)
    except OSError as e:
        # ELOOP: last component is a symlink; ENOTDIR: a middle one is.
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"{path} is (or goes through) a symlink") from e
        if isinstance(e, FileNotFoundError):
            raise HashingError(f"{path} disappeared while reading") from e
        raise HashingError(f"cannot open {path}: {e}") from e
    finally:
        for d in opened:
            os.close(d)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    return fd, st.st_size


@dataclass(frozen=True)
class FileRange:
    """Bytes [start, start + size) of an open file: a whole file, a member of an
    archive inside one, or a decompressed stream spilled to a temporary file."""

    fd: int
    size: int
    start: int = 0

    def read_at(self, n: int, pos: int) -> bytes:
        """Up to `n` bytes at `pos` (relative to the range), never past its end."""
        n = min(n, self.size - pos)
        return os.pread(self.fd, n, self.start + pos) if n > 0 else b""

    def sub(self, pos: int, size: int) -> FileRange:
        """The range [pos, pos + size) of this one, cut at its end."""
        pos = min(max(pos, 0), self.size)
        return FileRange(self.fd, min(size, self.size - pos), self.start + pos)


def read_exact_at(fd: int, size: int, offset: int = 0) -> bytes:
    """Reads exactly `size` bytes at `offset` without moving the file position."""
    chunks = []
    position, remaining = offset, size
    while remaining:
        chunk = os.pread(fd, min(remaining, 1 << 30), position)
        if not chunk:
            raise HashingError("file shrank while reading")
        chunks.append(chunk)
        position += len(chunk)
        remaining -= len(chunk)
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def first_hole(fd: int, size: int) -> int | None:
    """Offset of the first hole (a range never written, read back as zeros
    with no disk behind it) in the `size` bytes of `fd`, or None when the file
    is dense. Found with SEEK_HOLE, which reads nothing (a filesystem that does
    not track holes says there are none); the file position is left at 0."""
    if size == 0:
        return None
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError:
        return None
    finally:
        os.lseek(fd, 0, os.SEEK_SET)
    return hole if hole < size else None


def sparse_detail(hole: int, size: int) -> str:
    """Why a sparse file is refused, for reports."""
    return (
        f"sparse file: a hole (a range never written) at offset {hole} of its "
        f"{size} bytes; model files must be fully written (a sparse file costs "
        "nothing to plant and hours to read); rewrite it without holes "
        "(cp --sparse=never)"
    )


def check_dense(root_fd: int, files: list[tuple[str, int]]) -> None:
    """Raises SparseFileError, naming every one, when any of `files` ((path,
    size) as listed) has a hole: run before hashing, so a huge sparse file is
    refused without reading it."""
    sparse = {}
    for path, _ in files:
        fd, size = open_file(root_fd, path)
        try:
            hole = first_hole(fd, size)
        finally:
            os.close(fd)
        if hole is not None:
            sparse[path] = sparse_detail(hole, size)
    if sparse:
        raise SparseFileError(sparse)
