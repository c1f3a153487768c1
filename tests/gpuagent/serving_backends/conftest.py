"""Fixtures of the serving tests: a copy of the demo model with its approved
digest, an agent's registry in a temporary artifacts folder, helpers that look
for processes and ports."""

import os
import shlex
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuagent.integrity import file_digests, hash_model
from gpuagent.protocol import BackendSpec, DeploySpec, FileDigest, Recipe
from gpuagent.serving import Registry, undeploy

REPO = Path(__file__).resolve().parents[3]
DEMO_MODEL = REPO / "gpuagent" / "engine" / "demo_model"
HEALTH_SERVER = Path(__file__).resolve().parent / "health_server.py"
RECIPE = Recipe(weights="bf16", kv_cache_dtype="int8")


@dataclass
class Approved:
    folder: Path
    digest: str
    files: list[FileDigest]


@pytest.fixture
def approved(tmp_path) -> Approved:
    """A copy of the demo model, hashed as the approval recorded it."""
    folder = tmp_path / "model"
    shutil.copytree(DEMO_MODEL, folder)
    manifest = hash_model(folder)
    return Approved(folder, manifest.digest, file_digests(folder, manifest))


@pytest.fixture
def registry(tmp_path):
    """This agent's registry; whatever a test left running is stopped after it."""
    reg = Registry(tmp_path / "artifacts" / "serving")
    yield reg
    for record in reg.records():
        undeploy(record.info.deployment_id, registry=reg, grace_s=2)


@pytest.fixture
def engine_env() -> dict[str, str]:
    """The environment of an engine child: one thread, the torch references on a
    CPU (not the Triton interpreter the test session selects)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    return env


def spec_for(
    approved: Approved, backend: BackendSpec | None = None, **kw
) -> DeploySpec:
    fields = {
        "manifest_digest": approved.digest,
        "recipe": RECIPE,
        "approved_files": approved.files,
        "port_range": (free_port(), 65000),
        "health_timeout_s": 120,
    }
    if backend is not None:
        fields["backend"] = backend
    return DeploySpec(**{**fields, **kw})


def stand_in_backend(*flags: str) -> BackendSpec:
    """An external backend that starts health_server.py through a template; its
    served model name (a `new_marker()`) finds the process in /proc."""
    words = [
        "{python}",
        shlex.quote(str(HEALTH_SERVER)),
        "--port",
        "{port}",
        "--name",
        "{served_model_name}",
        *flags,
    ]
    return BackendSpec(kind="external", command_template=" ".join(words))


def new_marker() -> str:
    return f"rg-test-{uuid.uuid4().hex[:12]}"


def processes_with(word: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line holds `word`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(word.encode() in part for part in cmdline):
            found.append(int(entry.name))
    return found


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
