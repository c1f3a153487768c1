"""What a model folder's tree may be, in one place: names, lengths, depth,
entry count and total size. `_fs.scan_tree` enforces these for every walk, so
`inspect_model` refuses a folder by them before reading any file, and every
hasher and reader (`hash_model`, `verify_model`, verify-on-load) refuses it
the same way before hashing.

Hidden paths. A name starting with "." is control data of some tool, never a
model file: version-control metadata above all (a `.git` folder whose config
sets `core.fsmonitor` runs that command for anyone who types `git status` in
the folder; `.git` as a file points at such a folder elsewhere), and likewise
`.hg`, `.svn`, `.bzr`, the download state `huggingface_hub` keeps in
`.cache/huggingface`, `.github` workflows. Every hidden file and folder is
refused, and not entered, whether or not a manifest would ignore it; so are
the version-control folders without a dot (`CVS`, `_darcs`, `_FOSSIL_`). The
one exception is what Hugging Face repositories carry at their top:
`.gitattributes` and `.gitignore`, text that names patterns (a filter or diff
driver it names runs only if a git config defines it, and that config lives in
the refused `.git`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuagent.integrity._text import unsafe_char

# Linux's PATH_MAX counts the terminating NUL: a path opened by name (loaders
# join the folder and the name) may hold at most PATH_MAX - 1 bytes.
PATH_MAX = 4096
VCS_NAMES = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        ".bzr",
        ".jj",
        ".sl",
        ".pijul",
        ".repo",
        ".fslckout",
        "_FOSSIL_",
        "_darcs",
        "CVS",
    }
)
ALLOWED_HIDDEN_PATHS = frozenset({".gitattributes", ".gitignore"})


@dataclass(frozen=True)
class FolderLimits:
    """Limits of a model folder's tree (`Policy.limits`). Names and paths are
    counted in UTF-8 bytes, relative to the folder; `max_depth` counts folder
    levels (walks recurse, holding an fd, per level: a planted folder thousands
    deep must be refused, not overflow the stack; models use two or three);
    `max_entries` files, folders and links together (listed before sorting, so
    a folder of millions costs no more than this); `max_total_bytes` the
    regular files' sizes. The largest public checkpoints hold about 200 files
    and 2 TB. `max_signature_bytes` bounds a signature file, which is
    read whole (a key signature is about 2 KB; a manifest of 1 MiB shards of a
    70B model about 32 MB)."""

    max_name_bytes: int = 255  # NAME_MAX
    max_path_bytes: int = 1024
    max_depth: int = 32
    max_entries: int = 10_000
    max_total_bytes: int = 4 << 40
    max_signature_bytes: int = 64 << 20


DEFAULT_LIMITS = FolderLimits()


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


def hidden_problem(path: str) -> tuple[str, str] | None:
    """(code, detail) when the last component of `path` is version-control
    metadata or hidden (see the module docstring), else None."""
    name = path.rsplit("/", 1)[-1]
    if name in VCS_NAMES:
        return (
            "vcs-metadata",
            f"{name}: version-control metadata is not allowed in a model folder "
            "(its config can name commands, e.g. git's core.fsmonitor, that run "
            "for anyone using the tool in the folder); remove it",
        )
    if name.startswith(".") and path not in ALLOWED_HIDDEN_PATHS:
        return (
            "hidden-path",
            f"{name}: hidden files and folders are control data of some tool, not "
            "model files, and are not allowed (only .gitattributes and .gitignore "
            "at the top); remove it",
        )
    return None


def name_problem(
    path: str, limits: FolderLimits, prefix_bytes: int = 0
) -> tuple[str, str] | None:
    """(code, detail) of the first reason `path` (relative, posix) is refused by
    name alone, or None. `prefix_bytes`: length of the folder's own path and
    its separator, with which the path must stay under PATH_MAX."""
    reason = bad_name_reason(path)
    if reason is not None:
        return "path-name-invalid", reason
    hidden = hidden_problem(path)
    if hidden is not None:
        return hidden
    name_bytes = len(path.rsplit("/", 1)[-1].encode("utf-8"))
    if name_bytes > limits.max_name_bytes:
        return (
            "name-too-long",
            f"a name of {name_bytes} bytes, more than the limit of "
            f"{limits.max_name_bytes}",
        )
    path_bytes = len(path.encode("utf-8"))
    if path_bytes > limits.max_path_bytes:
        return (
            "path-too-long",
            f"a path of {path_bytes} bytes, more than the limit of "
            f"{limits.max_path_bytes}",
        )
    if prefix_bytes + path_bytes > PATH_MAX - 1:
        return (
            "path-too-long",
            f"with the folder's own path, {prefix_bytes + path_bytes} bytes: more "
            f"than PATH_MAX ({PATH_MAX}) lets a loader open",
        )
    return None
