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

from gpuagent.integrity._text import printable, unsafe_char
from gpuagent.integrity.errors import HashingError, UnsafePathError

# O_NONBLOCK: opening a FIFO swapped in for a file must not hang the agent.
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Walks recurse (and hold one fd) per level: a planted folder thousands of levels
# deep must be refused, not overflow the Python stack. Models use two or three.
MAX_FOLDER_DEPTH = 32


@dataclass(frozen=True)
class Entry:
    """One directory entry, as found (symlinks not followed)."""

    path: str  # posix path relative to the root
    kind: str  # "file" | "dir" | "symlink" | "special" | "too-deep"
    size: int
    link_target: str | None = None


def normalize_ignore(paths: list[str] | tuple[str, ...] | frozenset[str]) -> list[str]:
    """Relative posix forms of ignore paths ("./a/" -> "a")."""
    out = []
    for p in paths:
        text = str(PurePosixPath(str(p)))
        out.append(text)
    return sorted(set(out))


def bad_name_reason(path: str) -> str | None:
    """Why `path` is not an acceptable file name, or None.

    A name that is not UTF-8 (decoded with surrogate escapes) cannot be put in
    a JSON report, a protocol message or the database; a control, separator or
    bidirectional character (newline, U+2028, U+202E) can forge or reorder lines
    of a report.
    """
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "file name is not valid UTF-8"
    bad = sorted({c for c in path if unsafe_char(c)})
    if bad:
        shown = ", ".join(f"U+{ord(c):04X}" for c in bad[:8])
        return f"file name contains a control or bidirectional character ({shown})"
    return None


def is_ignored(path: str, ignore: list[str]) -> bool:
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


def scan_tree(root_fd: int, prefix: str = "", depth: int = 1) -> list[Entry]:
    """Every entry under the root, depth first, sorted; symlinks are reported,
    never followed. A folder nested deeper than MAX_FOLDER_DEPTH is reported as
    kind "too-deep" and not entered."""
    entries: list[Entry] = []
    with os.scandir(root_fd) as it:
        found = sorted(it, key=lambda e: e.name)
    for item in found:
        path = f"{prefix}{item.name}"
        st = item.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(item.name, dir_fd=root_fd)
            entries.append(Entry(path, "symlink", 0, target))
        elif stat.S_ISDIR(st.st_mode) and depth > MAX_FOLDER_DEPTH:
            entries.append(Entry(path, "too-deep", 0))
        elif stat.S_ISDIR(st.st_mode):
            entries.append(Entry(path, "dir", 0))
            sub = os.open(item.name, _O_DIR, dir_fd=root_fd)
            try:
                entries.extend(scan_tree(sub, path + "/", depth + 1))
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            entries.append(Entry(path, "file", st.st_size))
        else:
            entries.append(Entry(path, "special", 0))
    return entries


def list_files(root_fd: int, ignore: list[str]) -> list[tuple[str, int]]:
    """(path, size) of every regular file not ignored; raises UnsafePathError on
    a symlink or special file anywhere outside the ignored paths."""
    files: list[tuple[str, int]] = []

    def walk(dir_fd: int, prefix: str, depth: int) -> None:
        with os.scandir(dir_fd) as it:
            found = sorted(it, key=lambda e: e.name)
        for item in found:
            path = f"{prefix}{item.name}"
            if is_ignored(path, ignore):
                continue
            reason = bad_name_reason(path)
            if reason is not None:
                raise UnsafePathError(f"{printable(path)}: {reason}")
            st = item.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(f"{path} is a symlink; symlinks are refused")
            if stat.S_ISDIR(st.st_mode):
                if depth > MAX_FOLDER_DEPTH:
                    raise UnsafePathError(
                        f"{path}: folders nested deeper than {MAX_FOLDER_DEPTH}"
                    )
                sub = os.open(item.name, _O_DIR, dir_fd=dir_fd)
                try:
                    walk(sub, path + "/", depth + 1)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                files.append((path, st.st_size))
            else:
                raise UnsafePathError(f"{path} is a special file (not a regular file)")

    try:
        walk(root_fd, "", 1)
    except OSError as e:
        raise HashingError(f"cannot list the model folder: {e}") from e
    return files


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
