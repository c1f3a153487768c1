"""`python -m gpuagent run --name NAME --broker URL --artifacts PATH`: one agent."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpuagent")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="start an agent worker")
    run.add_argument("--name", required=True, help="agent name; its queue agent.NAME")
    run.add_argument("--broker", required=True, help="Celery broker URL")
    run.add_argument("--artifacts", required=True, type=Path, help="artifact store")
    run.add_argument("--pool", default="agents", help="the pool's queue")
    run.add_argument("--controlplane-queue", default="celery", help="where results go")
    run.add_argument("--signing-key", type=Path, help="ECDSA private key, PEM")
    run.add_argument(
        "--trusted-key",
        type=Path,
        action="append",
        default=[],
        help="ECDSA public key signatures may be made with, PEM (repeatable)",
    )
    run.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    run.add_argument(
        "--state-dir",
        type=Path,
        help="this agent's own state (its identity key); var/agent-state/NAME",
    )
    run.add_argument(
        "--identity-key",
        type=Path,
        help="Ed25519 identity key, PEM (created with mode 0600 if absent); "
        "default STATE_DIR/identity.key",
    )
    run.add_argument(
        "--controlplane-key",
        type=Path,
        action="append",
        default=[],
        help="the control plane's public key, PEM (repeatable): job requests it "
        "did not seal are refused",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for path in (args.signing_key, *args.trusted_key, *args.controlplane_key):
        if path is not None and not path.is_file():
            raise SystemExit(f"{path} is not a file")
    os.environ.update(
        GPUAGENT_NAME=args.name,
        GPUAGENT_ARTIFACTS=str(args.artifacts.resolve()),
        GPUAGENT_POOL=args.pool,
        GPUAGENT_CONTROLPLANE_QUEUE=args.controlplane_queue,
        GPUAGENT_SIGNING_KEY=str(args.signing_key.resolve())
        if args.signing_key
        else "",
        GPUAGENT_TRUSTED_KEYS=",".join(str(p.resolve()) for p in args.trusted_key),
        GPUAGENT_THREADS=str(args.threads),
        GPUAGENT_CONTROLPLANE_KEY=",".join(
            str(p.resolve()) for p in args.controlplane_key
        ),
    )
    if args.state_dir:
        os.environ["GPUAGENT_STATE_DIR"] = str(args.state_dir.resolve())
    if args.identity_key:
        os.environ["GPUAGENT_IDENTITY_KEY"] = str(args.identity_key.resolve())
    from gpuagent.worker import make_app

    app = make_app(
        args.broker, name=args.name
    )  # its worker_ready starts the heartbeat (worker.py)
    app.set_current()
    app.set_default()
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            f"--queues=agent.{args.name},{args.pool}",
            f"--hostname={args.name}@%h",
            "--loglevel=INFO",
        ]
    )


if __name__ == "__main__":
    main()
