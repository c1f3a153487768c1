"""The deployments this agent runs, kept in memory and in a state file under the
agent's artifacts folder, so an agent restarted (or another worker process of the
same agent) finds its servers and can stop them.

`<state_dir>/deployments.json` holds one record per running server: its
`DeploymentInfo` plus the process start time that tells our pid from a recycled
one. `<state_dir>/quarantine.json` lists digests this agent refuses to load.
Every change is made under an exclusive `flock` and written atomically (temporary
file, fsync, rename): a crash leaves the old file or the new one, never half.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from gpuagent.protocol import DeploymentInfo, FileDigest
from gpuagent.serving import process
from gpuagent.serving.errors import ServingError

STATE_FORMAT = "releasegate-deployments/v1"


class DeploymentRecord(BaseModel):
    """A running server as the state file keeps it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    info: DeploymentInfo
    process_start_time: int
    log_path: str
    local_url: str
    # Per-file digests of the bytes verified at deploy: re-verification names
    # the files that changed since.
    approved_files: list[FileDigest] = []
    # The server's command line, secrets as *** (templates.redacted_command).
    command: list[str] = []

    def running(self) -> bool:
        return process.is_running(self.info.pid, self.process_start_time)


class Registry:
    """Running deployments of one agent, rooted at `state_dir` (e.g.
    `<artifacts>/serving`)."""

    def __init__(self, state_dir: str | os.PathLike[str]):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._path = self.state_dir / "deployments.json"
        self._quarantine_path = self.state_dir / "quarantine.json"
        self._lock_path = self.state_dir / ".lock"
        self._records: dict[str, DeploymentRecord] = {}

    # --- deployments -------------------------------------------------------------

    def add(self, record: DeploymentRecord) -> None:
        with self._locked():
            records = self._read()
            records[record.info.deployment_id] = record
            self._write(records)

    def remove(self, deployment_id: str) -> DeploymentRecord | None:
        with self._locked():
            records = self._read()
            record = records.pop(deployment_id, None)
            self._write(records)
        return record

    def get(self, deployment_id: str) -> DeploymentRecord | None:
        with self._locked():
            return self._read().get(deployment_id)

    def records(self) -> list[DeploymentRecord]:
        """Every recorded deployment whose server still runs. Records of servers
        that died are dropped from the state file (they serve nothing)."""
        with self._locked():
            records = self._read()
            alive = {k: r for k, r in records.items() if r.running()}
            if alive.keys() != records.keys():
                self._write(alive)
        return sorted(alive.values(), key=lambda r: r.info.started)

    def log_path(self, deployment_id: str) -> Path:
        return self.state_dir / "logs" / f"{deployment_id}.log"

    # --- quarantine --------------------------------------------------------------

    def quarantine(self, manifest_digest: str) -> None:
        """Never load `manifest_digest` on this agent again."""
        with self._locked():
            digests = set(self.quarantined())
            digests.add(manifest_digest)
            _atomic_write(self._quarantine_path, sorted(digests))

    def quarantined(self) -> list[str]:
        try:
            data = json.loads(self._quarantine_path.read_text())
            if not isinstance(data, list):
                raise ValueError("not a list of digests")
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            # A quarantine list that can't be read must not let a digest through.
            raise ServingError(
                f"cannot read the quarantine file {self._quarantine_path}: {e}"
            ) from None
        return [str(d) for d in data]

    # --- state file --------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self) -> dict[str, DeploymentRecord]:
        try:
            data = json.loads(self._path.read_text())
            if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
                raise ValueError(f"not a {STATE_FORMAT} state file")
            records = {
                k: DeploymentRecord.model_validate(v)
                for k, v in data["deployments"].items()
            }
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, AttributeError) as e:
            # Never guessed over: the servers it names may still run.
            raise ServingError(
                f"cannot read the deployments state file {self._path}: {e}"
            ) from None
        self._records = records
        return dict(records)

    def _write(self, records: dict[str, DeploymentRecord]) -> None:
        body = {
            "format": STATE_FORMAT,
            "deployments": {k: r.model_dump(mode="json") for k, r in records.items()},
        }
        _atomic_write(self._path, body)
        self._records = dict(records)


def _atomic_write(path: Path, data: object) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
