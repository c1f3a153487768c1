"""What sealing every agent message costs: microseconds per message.

    .venv/bin/python -m controlplane.fleet.seal_bench [--n 2000]

Rows: a heartbeat recorded through the intake sealed (seal + check + nonce +
enrolled lookup + record) vs the same beat recorded unsealed (the pipeline's
record_heartbeat alone: the like-for-like baseline); then the crypto alone per
message kind: the agent's seal, the control plane's check, for a heartbeat, a
sign result (signature file and 6 files) and a job request (the control plane
seals, the agent checks). A throwaway SQLite database; one process, one core.

With --pipeline, first the demo (`manage.py demo --no-serve`, embedded defaults, a
fresh data folder) takes the demo model to live, sealed as always: its time to
deploy as it prints it, and the sealed messages that run exchanged, counted from
its database (agent messages accepted: the replay store's rows; job requests: the
jobs' attempts). "Without sealing" is that time less the sealing work those
messages cost at the per-message figures measured here (an agent message: its
seal plus the sealed intake's extra over the unsealed record; a job request: its
seal and its check); the control plane has no unsealed mode to time, on purpose.
"""

import argparse
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def per_message_us(fn, n: int) -> float:
    fn()  # warm-up
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="also the demo pipeline's time to deploy, with and without sealing",
    )
    args = parser.parse_args()
    n = args.n
    demo = run_demo() if args.pipeline else None
    data = Path(tempfile.mkdtemp(prefix="releasegate-seal-bench-"))
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        RELEASEGATE_DATA_DIR=str(data),
        DATABASE_URL=f"sqlite:///{data / 'db.sqlite3'}",
        RELEASEGATE_SOURCE_ROOTS=str(data / "sources"),
    )
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from controlplane.fleet.enrollment import do_enroll_local_agent
    from controlplane.fleet.keys import controlplane_key, seal_job_request
    from controlplane.releases import intake, pipeline
    from gpuagent.integrity import identity
    from gpuagent.protocol import FileDigest, HashResult, Heartbeat, JobRequest

    key = identity.load_or_create_key(data / "agent.key")
    raw = identity.public_raw(key)
    do_enroll_local_agent("bench", raw, actor="system:bench")
    beat = Heartbeat(
        agent="bench",
        queue="agent.bench",
        pool_queue="agents",
        incarnation="a" * 32,
        device="cpu",
        gpu_model="CPU",
        memory_total_bytes=2**34,
        memory_free_bytes=2**33,
        public_key=raw.hex(),
    ).model_dump(mode="json")

    def sealed_beat():
        sealed = identity.seal(key, beat, type="heartbeat").model_dump(mode="json")
        assert intake.accept_heartbeat(beat, sealed) == "online"

    def unsealed_beat():
        pipeline.record_heartbeat(Heartbeat.model_validate(beat))

    base = per_message_us(unsealed_beat, n)
    full = per_message_us(sealed_beat, n)
    print(f"{'heartbeat recorded':40s} {'us/msg':>10s}")
    print(f"{'  unsealed (pipeline alone)':40s} {base:10.1f}")
    print(f"{'  sealed, through the intake':40s} {full:10.1f}  (+{full - base:.1f})")

    sign_result = {
        "job_id": 12,
        "kind": "sign",
        "ok": True,
        "agent": "bench",
        "error": "",
        "payload": HashResult(
            manifest_digest="sha256:" + "ab" * 32,
            files=[
                FileDigest(path=f"f{i}.safetensors", size_bytes=i, digest="sha256:0")
                for i in range(6)
            ],
            signature="x" * 3000,
            signer="key sha256:" + "cd" * 32,
        ).model_dump(mode="json"),
    }
    request = JobRequest(job_id=12, release_id=3, kind="sign", source_uri="file:///m")
    request_body = request.model_dump(mode="json")
    cp_key = controlplane_key()
    cp_raw = identity.public_raw(cp_key)
    bound = {"type": "result", "job_id": 12, "attempt": 1, "kind": "sign"}
    print(f"{'crypto alone':40s} {'seal us':>10s} {'check us':>10s}")
    for name, body, signer, public, fields in (
        ("heartbeat", beat, key, raw, {"type": "heartbeat"}),
        ("sign result (6 files, 3 KB signature)", sign_result, key, raw, bound),
    ):
        sealed = identity.seal(signer, body, **fields)
        seal_us = per_message_us(
            lambda s=signer, b=body, f=fields: identity.seal(s, b, **f), n
        )
        check_us = per_message_us(
            lambda s=sealed, p=public, b=body, f=fields: identity.check_seal(
                s, p, b, **f
            ),
            n,
        )
        print(f"  {name:38s} {seal_us:10.1f} {check_us:10.1f}")
    sealed_job = seal_job_request(request, request_body)
    seal_us = per_message_us(lambda: seal_job_request(request, request_body), n)
    from gpuagent.protocol import Seal

    parsed = Seal.model_validate(sealed_job)
    check_us = per_message_us(
        lambda: identity.check_seal(parsed, cp_raw, request_body, type="job"), n
    )
    name = "job request (control plane -> agent)"
    print(f"  {name:38s} {seal_us:10.1f} {check_us:10.1f}")
    if demo is not None:
        agent_seal_us = per_message_us(
            lambda: identity.seal(key, beat, type="heartbeat"), n
        )
        print_pipeline(demo, agent_seal_us + full - base, seal_us + check_us)


def run_demo() -> dict:
    """The demo to live in a fresh data folder: its printed time to deploy and
    the sealed messages its database counts."""
    data = Path(tempfile.mkdtemp(prefix="releasegate-seal-bench-demo-"))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATABASE_URL", "CELERY_"))
    }
    env["RELEASEGATE_DATA_DIR"] = str(data)
    done = subprocess.run(
        [sys.executable, "manage.py", "demo", "--no-serve"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"time to deploy ([0-9.]+) s", done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(
            f"the demo did not go live:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    with sqlite3.connect(data / "releasegate.sqlite3") as db:
        [(agent_messages,)] = db.execute("SELECT COUNT(*) FROM fleet_seenmessage")
        [(requests,)] = db.execute(
            "SELECT COALESCE(SUM(MAX(attempts, 1)), 0) FROM releases_job"
        )
    return {
        "deploy_s": float(found.group(1)),
        "agent_messages": agent_messages,
        "requests": requests,
    }


def print_pipeline(demo: dict, agent_message_us: float, request_us: float) -> None:
    sealing_s = (
        demo["agent_messages"] * agent_message_us + demo["requests"] * request_us
    ) / 1e6
    with_s = demo["deploy_s"]
    without_s = with_s - sealing_s
    print(f"{'demo pipeline, time to deploy':40s} {'s':>10s}")
    print(f"  {'sealed (as it runs)':38s} {with_s:10.2f}")
    print(
        f"  {'without sealing (derived)':38s} {without_s:10.2f}  "
        f"(sealing {sealing_s * 1e3:.1f} ms = {sealing_s / with_s:.3%}; "
        f"{demo['agent_messages']} agent messages at {agent_message_us:.0f} us, "
        f"{demo['requests']} job requests at {request_us:.0f} us)"
    )


if __name__ == "__main__":
    main()
