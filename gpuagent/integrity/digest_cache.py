"""Per-file digests kept between verifications, for a quick re-verification.

A file's digests are reused while its stat key is unchanged: (device, inode,
size, mtime_ns, ctime_ns). Any write changes mtime and ctime, and ctime cannot be
set back by a user (utime sets it to now), so a file swapped or edited in place
gets a new key and is hashed again. Entries are not kept for a file changed
within `RACY_WINDOW_S` of its hashing: a write in the same clock tick as the
hash would leave the key as it was (git's "racy" entries), `RACY_WINDOW_S`.

The cache is as trusted as the verifier itself: keep it where only the agent
can write (never in the model folder). Gates re-hash in full (the default of
`verify_model`); this is for frequent checks of files already verified.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuagent.integrity.manifest import Resource

CACHE_FORMAT = "releasegate-digest-cache/v1"
RACY_WINDOW_S = 2.0
StatKey = tuple[int, int, int, int, int]


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class DigestCache:
    """Digests by digest name and stat key. `reused` / `hashed` count files."""

    path: Path
    entries: dict[str, dict[str, dict]] = field(default_factory=dict)
    reused: int = 0
    hashed: int = 0

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DigestCache:
        """The cache at `path`; empty when it does not exist or cannot be read
        (a lost cache costs one full re-hash, never a wrong answer)."""
        cache = cls(Path(path))
        try:
            data = json.loads(cache.path.read_text())
        except (OSError, ValueError):
            return cache
        if isinstance(data, dict) and data.get("format") == CACHE_FORMAT:
            entries = data.get("entries")
            if isinstance(entries, dict):
                cache.entries = entries
        return cache

    def lookup(
        self, digest_name: str, path: str, key: StatKey
    ) -> list[Resource] | None:
        entry = self.entries.get(digest_name, {}).get(_id(key))
        if not isinstance(entry, dict) or entry.get("key") != list(key):
            return None
        if entry.get("path") != path:
            return None
        try:
            resources = [
                Resource(path, digest_name, digest, start, end)
                for start, end, digest in entry["resources"]
            ]
        except (KeyError, TypeError, ValueError):
            return None
        self.reused += 1
        return resources

    def store(
        self, digest_name: str, path: str, key: StatKey, resources: list[Resource]
    ) -> None:
        """Keeps `resources` (digests of the file at `path` with stat `key`,
        taken before and after hashing alike) unless the file changed too
        recently to trust its timestamps."""
        _, _, _, mtime_ns, ctime_ns = key
        if time.time_ns() - max(mtime_ns, ctime_ns) < RACY_WINDOW_S * 1e9:
            return
        self.entries.setdefault(digest_name, {})[_id(key)] = {
            "path": path,
            "key": list(key),
            "resources": [[r.start, r.end, r.digest] for r in resources],
        }

    def save(self) -> None:
        """Writes the cache atomically (temporary file, then rename), 0600."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"format": CACHE_FORMAT, "entries": self.entries})
        fd, tmp = tempfile.mkstemp(prefix=".digest-cache-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise


def _id(key: StatKey) -> str:
    return f"{key[0]}:{key[1]}"
