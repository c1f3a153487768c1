"""The agent's artifact store: a folder (shared storage in production) holding the
candidates the compress job makes, signatures, job outputs and deployment logs.

Outputs are content-addressed: a candidate's folder is named by the digest of what
determines it (source manifest digest and weight format), a job's output by the
digest of its request (attempt aside). A redelivered job therefore finds what an
earlier delivery made and returns it instead of redoing the work. Folders are
built beside their final name and renamed into place, so a half-written one is
never found."""

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from gpuagent.protocol import JobRequest, Recipe

# Agents may not re-run these from a stored output: they act on the world now
# (start or stop a server) or check the bytes as they are now.
NOT_REPLAYED = ("deploy", "undeploy", "reverify")


class ArtifactStore:
    """Paths and content-addressed outputs under `root`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        for sub in ("candidates", "outputs", "signatures", "deployments", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def path_of(self, relative: str) -> Path:
        """The folder `relative` names inside the store; ValueError outside it."""
        path = (self.root / relative).resolve()
        if self.root not in path.parents:
            raise ValueError(f"{relative!r} is outside the artifact store")
        return path

    def relative(self, path: Path) -> str:
        return str(path.resolve().relative_to(self.root))

    def candidate(self, key: str, build: Callable[[Path], None]) -> Path:
        """The candidate folder named `key`, built by `build(tmp_folder)` (which
        creates the folder) unless a complete one exists already."""
        final = self.root / "candidates" / key
        if final.is_dir():
            return final
        tmp = self.root / "tmp" / f"{key}-{uuid.uuid4().hex[:8]}"
        try:
            build(tmp)
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # another delivery won the rename: use its copy
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _output_path(self, request: JobRequest) -> Path:
        data = request.model_dump(mode="json", exclude={"attempt"})
        key = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        return self.root / "outputs" / f"{request.kind}-{key}.json"

    def stored_output(self, request: JobRequest) -> dict | None:
        """The payload an earlier delivery of `request` stored, if any."""
        if request.kind in NOT_REPLAYED:
            return None
        path = self._output_path(request)
        return json.loads(path.read_text()) if path.is_file() else None

    def store_output(self, request: JobRequest, payload: dict) -> None:
        if request.kind in NOT_REPLAYED:
            return
        path = self._output_path(request)
        tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)


def candidate_key(
    source_manifest_digest: str, recipe: Recipe, kv_scale_strategy: str = "tensor"
) -> str:
    """The name of the candidate made from a source under a recipe (every option
    that shapes the output is in it: weights, method, grouping, KV scales and, for
    an fp8 KV cache, the scales' layout)."""
    text = f"{source_manifest_digest}|recipe={recipe.model_dump_json()}"
    if recipe.kv_cache_dtype == "fp8":
        text += f"|kv_scales={kv_scale_strategy}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]
