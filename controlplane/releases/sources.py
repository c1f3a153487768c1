"""Where a release's source may come from: a folder inside one of its team's source
roots, named by a `file://` URI or an absolute path, reached without `..` and
without following a symlink below the root.

Pure functions over paths (no Django): the registration check and whatever opens the
folder later apply the same rule, so a folder swapped for a symlink after
registration is refused when it is used too. The root itself is the operator's
configuration and may be a symlink."""

import os
import stat
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit


class SourceRefused(ValueError):
    """The source URI is not a folder inside the allowed roots; says why."""


def source_path(source_uri: str) -> PurePosixPath:
    """The absolute local path `source_uri` names. Raises SourceRefused for another
    scheme, a host, a query or fragment, a relative path, or `.`/`..` segments."""
    parts = urlsplit(source_uri)
    if parts.scheme not in ("", "file"):
        raise SourceRefused(
            f"source_uri scheme {parts.scheme!r} is not supported; use a file:// URI "
            "of a folder inside your team's source roots"
        )
    if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
        raise SourceRefused(f"source_uri names host {parts.netloc!r}; only local")
    if parts.query or parts.fragment:
        raise SourceRefused("source_uri must not have a query or a fragment")
    raw = unquote(parts.path) if parts.scheme == "file" else source_uri
    if "\x00" in raw or "\\" in raw:
        raise SourceRefused("source_uri must not contain NUL or backslashes")
    if not raw.startswith("/"):
        raise SourceRefused(f"source_uri must be an absolute path, got {raw!r}")
    segments = raw.split("/")[1:]
    if any(segment in (".", "..") for segment in segments):
        raise SourceRefused("source_uri must not contain '.' or '..' segments")
    return PurePosixPath("/" + "/".join(s for s in segments if s))


def resolve_source(source_uri: str, roots: Sequence[Path | str]) -> tuple[Path, Path]:
    """(root, folder) for a source inside one of `roots`, checked on disk: every
    path segment below the root exists, is a folder, and is not a symlink. Raises
    SourceRefused naming the problem. Whether a path is inside a root is decided
    before the disk is read, so nothing is learnt about folders outside them."""
    path = source_path(source_uri)
    for root in roots:
        root_path = PurePosixPath(os.path.normpath(root))
        if path == root_path or root_path in path.parents:
            return Path(root_path), _walk(Path(root_path), path.relative_to(root_path))
    allowed = ", ".join(str(r) for r in roots) or "none configured"
    raise SourceRefused(f"{path} is outside your team's source roots ({allowed})")


def _walk(root: Path, relative: PurePosixPath) -> Path:
    try:
        root_mode = os.stat(root).st_mode
    except OSError as exc:
        raise SourceRefused(f"source root {root}: {exc.strerror}") from exc
    if not stat.S_ISDIR(root_mode):
        raise SourceRefused(f"source root {root} is not a folder")
    current = root
    for segment in relative.parts:
        current = current / segment
        shown = current.relative_to(root)
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError as exc:
            raise SourceRefused(f"{shown} does not exist in {root}") from exc
        except OSError as exc:
            raise SourceRefused(f"{shown} in {root}: {exc.strerror}") from exc
        if stat.S_ISLNK(mode):
            raise SourceRefused(f"{shown} in {root} is a symlink; symlinks are refused")
        if not stat.S_ISDIR(mode):
            raise SourceRefused(f"{shown} in {root} is not a folder")
    return current


def relative_to_source(value, source_uri: str):
    """`value` (a string, or dicts and lists of them) with the source folder's
    absolute path written relative to the folder ("./config.json", "."): what
    jobs report about a source names its files, never where the host keeps them."""
    try:
        folder = str(source_path(source_uri))
    except SourceRefused:
        return value
    if folder == "/":
        return value

    def scrub(item):
        if isinstance(item, str):
            return item.replace(folder + "/", "./").replace(folder, ".")
        if isinstance(item, dict):
            return {key: scrub(entry) for key, entry in item.items()}
        if isinstance(item, list):
            return [scrub(entry) for entry in item]
        return item

    return scrub(value)
