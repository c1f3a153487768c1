"""`manage.py demo --no-serve` end to end in a subprocess, on the embedded defaults
(SQLite file + SQLAlchemy transport) in a fresh data folder, with a real worker."""

import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpuagent.serving.process import start_time
from tests.controlplane.test_celery import children_of, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "gpuagent" / "engine" / "demo_model"
PASSWORD = "demo-password-for-tests"


def demo_env(data_dir: Path) -> dict[str, str]:
    """The embedded defaults in `data_dir`, whatever the test settings point at."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATABASE_URL", "CELERY_"))
    }
    env.update(RELEASEGATE_DATA_DIR=str(data_dir), DEMO_PASSWORD=PASSWORD)
    return env


def run_demo(data_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "demo", "--no-serve", "--timeout", "400", *extra],
        cwd=ROOT,
        env=demo_env(data_dir),
        capture_output=True,
        text=True,
        timeout=420,
    )


def release_rows(data_dir: Path) -> list[tuple]:
    with sqlite3.connect(data_dir / "releasegate.sqlite3") as db:
        return db.execute(
            "SELECT version, state, manifest_digest FROM releases_release ORDER BY id"
        ).fetchall()


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_it_promotes_approves_and_deploys_through_the_local_agent(tmp_path):
    """The shipped demo model through every stage on the local CPU agent (the
    worker process), twice: the second release supersedes the first."""
    data_dir = tmp_path / "var"

    first = run_demo(data_dir)

    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert "demo-llama@0.1.1 is live in demo/staging" in out
    assert f"Login:      demo / {PASSWORD}" in out
    assert "Dashboard:  http://127.0.0.1:8000/" in out
    assert "Endpoint:   http://127.0.0.1:" in out
    assert "pass         integrity" in out and "quality:korean" in out
    assert "load:chat" in out
    for stage in (
        "verify_source",
        "compress",
        "sign",
        "verify",
        "evaluate",
        "load_test",
        "gate",
        "deploy",
    ):
        assert f"  {stage} " in out
    assert "time to deploy" in out and "integrity checks" in out
    [(version, state, digest)] = release_rows(data_dir)
    assert (version, state) == ("0.1.1", "live")
    assert digest.startswith("sha256")

    # A second run registers the next version, which supersedes the first.
    second = run_demo(data_dir)

    assert second.returncode == 0, second.stdout + second.stderr
    assert [row[:2] for row in release_rows(data_dir)] == [
        ("0.1.1", "superseded"),
        ("0.1.2", "live"),
    ]


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_it_takes_the_moe_demo_model_from_registration_to_live(tmp_path):
    """`--model moe`: the shipped tiny DeepSeek-V3 (MLA + MoE, sharded with an
    index) through every stage on the local CPU agent, its experts and MLA
    projections compressed to w8a16 and its MLA latent cached in int8, to live,
    the router-agreement gate judged; twice, the second release superseding the
    first. Between the two, the Llama demo goes live in its own environment, and
    neither model's release supersedes the other's."""
    data_dir = tmp_path / "var"

    result = run_demo(data_dir, "--model", "moe")

    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "demo-deepseek@0.1.1 is live in demo/staging-moe" in out
    assert "Endpoint:   http://127.0.0.1:" in out
    assert "pass         integrity" in out and "quality:korean" in out
    assert "load:chat" in out
    assert re.search(r"pass +routing +router_agreement", out), out
    for stage in (
        "verify_source",
        "compress",
        "sign",
        "verify",
        "evaluate",
        "load_test",
        "gate",
        "deploy",
    ):
        assert f"  {stage} " in out
    [(version, state, digest)] = release_rows(data_dir)
    assert (version, state) == ("0.1.1", "live")
    assert digest.startswith("sha256")
    with sqlite3.connect(data_dir / "releasegate.sqlite3") as db:
        [(family,)] = db.execute("SELECT name FROM releases_modelfamily").fetchall()
    assert family == "demo-deepseek"

    # The Llama demo in the same data folder goes live in its own environment
    # and leaves the MoE release live.
    llama = run_demo(data_dir)

    assert llama.returncode == 0, llama.stdout + llama.stderr
    assert "demo-llama@0.1.1 is live in demo/staging\n" in llama.stdout
    assert [row[:2] for row in release_rows(data_dir)] == [
        ("0.1.1", "live"),
        ("0.1.1", "live"),
    ]

    # A second MoE run registers the next version, gated against the first
    # (live in its environment), which it supersedes; the Llama one stays live.
    second = run_demo(data_dir, "--model", "moe")

    assert second.returncode == 0, second.stdout + second.stderr
    assert "demo-deepseek@0.1.2 is live in demo/staging-moe" in second.stdout
    assert [row[:2] for row in release_rows(data_dir)] == [
        ("0.1.1", "superseded"),
        ("0.1.1", "live"),
        ("0.1.2", "live"),
    ]


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_it_fails_loudly_when_verification_fails(tmp_path, model_folder):
    (model_folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 64)

    result = run_demo(tmp_path / "var", "--source", str(model_folder))

    assert result.returncode != 0
    assert "failed_verification" in result.stderr
    assert "pytorch_model.bin" in result.stderr


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_its_worker_dies_with_it_even_when_it_is_killed(tmp_path):
    demo = subprocess.Popen(
        [sys.executable, "manage.py", "demo", "--no-serve"],
        cwd=ROOT,
        env={**demo_env(tmp_path / "var"), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    started: dict[int, int | None] = {}  # the worker and its children
    try:
        for line in demo.stdout:
            if line.startswith("celery worker pid "):
                worker = int(line.split()[3])
                break
        else:
            pytest.fail(f"the demo started no worker (exit {demo.wait()})")
        started = {pid: start_time(pid) for pid in {worker, *children_of(worker)}}

        demo.kill()  # SIGKILL: nothing of the demo's own cleanup runs
        demo.wait()

        # Its warm shutdown: stops its embedded beat, finishes a job it has begun.
        for pid, pid_started in started.items():
            assert wait_until_gone(pid, pid_started, 60), pid
    finally:
        demo.kill()
        demo.wait()
        for pid, pid_started in started.items():
            if start_time(pid) == pid_started:  # left behind: stop it here
                os.kill(pid, signal.SIGKILL)
