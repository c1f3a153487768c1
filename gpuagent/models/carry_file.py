"""Carrying a file into an imported folder: hard-linked where the filesystem
allows (the same bytes, no copy), else copied as a stream and read back against
the digest taken while copying; the file's sha256 either way."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

CHUNK = 8 << 20
# link(2) failures that mean "copy instead": another filesystem, one that does
# not link, or too many links to the inode
NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)


class CopyError(OSError):
    """The copy does not read back as the source did."""


def link_or_copy(source: Path, target: Path) -> tuple[str, str]:
    """Hard-link `source` at `target` (same filesystem), else copy it; and its
    sha256."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as e:
        if e.errno not in NO_LINK:
            raise
        return "copied", copy_checked(source, target)
    return "hard-linked", sha256_file(target)


def copy_checked(source: Path, target: Path) -> str:
    """Copy as a stream, then read the copy back against the source's digest."""
    digest = hashlib.sha256()
    with open(source, "rb") as f, open(target, "xb") as out:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    expected = digest.hexdigest()
    if sha256_file(target) != expected:
        raise CopyError(f"{target.name}: the copy's sha256 differs")
    return expected


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
