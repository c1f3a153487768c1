"""What sealing every agent message costs: microseconds per message.

    .venv/bin/python -m controlplane.fleet.seal_bench [--n 2000]

Rows: a heartbeat recorded through the intake sealed (seal + check + nonce +
enrolled lookup + record) vs the same beat recorded unsealed (the pipeline's
record_heartbeat alone: the like-for-like baseline); then the crypto alone per
message kind: the agent's seal, the control plane's check, for a heartbeat, a
sign result (signature file and 6 files) and a job request (the control plane
seals, the agent checks). A throwaway SQLite database; one process, one core.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path


def per_message_us(fn, n: int) -> float:
    fn()  # warm-up
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2000)
    n = parser.parse_args().n
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


if __name__ == "__main__":
    main()
