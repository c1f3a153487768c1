"""`python manage.py demo`: the embedded default, end to end.

Migrates, creates a demo team with a registrant and an approver, registers the demo
model as a release, promotes it through the real Celery task code in a worker process
on the configured (by default embedded) transport, approves it as the approver, waits
until it is live, then serves the dashboard and API (unless --no-serve).
"""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts.actions import team_source_roots
from controlplane.accounts.models import Membership, Team
from controlplane.celery import worker_command
from controlplane.fleet.models import Environment
from controlplane.releases.actions import (
    do_approve_release,
    do_evaluate_release_gates,
    do_register_release,
    do_request_promotion,
    do_set_gate_policy,
)
from controlplane.releases.models import ModelFamily, Release

DEMO_MODEL = Path(settings.BASE_DIR) / "gpuagent" / "engine" / "demo_model"
DEMO_RECIPE = {"weights": "int8", "kv_cache_dtype": "int8"}


class Command(BaseCommand):
    help = "Run a demo promotion on the embedded defaults, then serve the dashboard."

    def add_arguments(self, parser):
        parser.add_argument("--no-serve", action="store_true", help="stop when live")
        parser.add_argument("--addr", default="127.0.0.1:8000", help="host:port")
        parser.add_argument("--source", default=str(DEMO_MODEL), help="model folder")
        parser.add_argument("--timeout", type=float, default=120.0, help="seconds")

    def handle(self, *args, **options):
        call_command("migrate", interactive=False, verbosity=0)
        password = os.getenv("DEMO_PASSWORD") or secrets.token_urlsafe(12)
        registrant, approver, environment, family = self.cast(password)

        version = f"0.1.{family.releases.count() + 1}"
        source = self.upload(Path(options["source"]).resolve(), family, version)
        release, _ = do_register_release(
            family,
            version=version,
            source_uri=source.as_uri(),
            recipe=DEMO_RECIPE,
            target_environment=environment,
            actor=registrant,
        )
        self.stdout.write(f"registered {release} from {release.source_uri}")

        worker, log_path = self.start_worker()
        # A TERM (e.g. from a process manager) unwinds like Ctrl-C, so `finally`
        # stops the worker instead of leaving it orphaned.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            do_request_promotion(release, registrant)
            self.stdout.write("promotion queued; waiting for the worker ...")
            self.wait_for(release, ("gated",), worker, log_path, options)
            self.gate_on_integrity(release, registrant)
            self.wait_for(release, ("awaiting_approval",), worker, log_path, options)
            do_approve_release(
                release,
                approver,
                comment="demo approval",
                manifest_digest=release.manifest_digest,
            )
            self.stdout.write(f"approved by {approver.username}; deploying ...")
            self.wait_for(release, ("live",), worker, log_path, options)
            self.stdout.write("stage timings (Job rows, recorded by the worker):")
            self.print_jobs(release)
            self.stdout.write(self.style.SUCCESS(f"{release} is live in {environment}"))
            self.print_login(options["addr"], password)
            if not options["no_serve"]:
                # The worker keeps running so approvals made in the dashboard deploy.
                call_command("runserver", options["addr"], use_reloader=False)
        finally:
            self.stop_worker(worker)

    def cast(self, password: str):
        team, _ = Team.objects.get_or_create(slug="demo", defaults={"name": "Demo"})
        users = []
        for username, role in (("demo", "admin"), ("approver", "approver")):
            user, _ = User.objects.get_or_create(username=username)
            user.set_password(password)
            user.is_staff = user.is_superuser = role == "admin"
            user.save()
            Membership.objects.update_or_create(
                team=team, user=user, defaults={"role": role}
            )
            users.append(user)
        environment, _ = Environment.objects.get_or_create(team=team, name="staging")
        do_set_gate_policy(environment, {"quality": None, "load": None}, actor=users[0])
        family, _ = ModelFamily.objects.get_or_create(
            team=team,
            name="demo-llama",
            defaults={"description": "the tiny Llama that ships with releasegate"},
        )
        return users[0], users[1], environment, family

    def upload(self, source: Path, family, version: str) -> Path:
        """What CI does before registering: copy the model folder into the team's
        source root (a source outside it is refused)."""
        if not source.is_dir():
            raise CommandError(f"{source} is not a folder")
        target = team_source_roots(family.team)[0] / family.name / version
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target)
        return target

    def gate_on_integrity(self, release, registrant) -> None:
        """The pipeline pauses at the gate: it records no evidence yet. Hold what
        it checked (source inspected, candidate hashed) against the demo
        environment's policy, which gates integrity only until the evaluate and
        load-test jobs exist, and promote again to re-run the gate."""
        while not release.jobs.filter(kind="gate", finished__isnull=False).exists():
            time.sleep(0.2)  # the gate job is finishing (wait_for bounds the rest)
        release.refresh_from_db()
        integrity_ok = bool(release.manifest_digest) and (
            release.jobs.filter(kind="verify_source", state="succeeded").exists()
        )
        decision = do_evaluate_release_gates(
            release, quality=None, load=None, integrity_ok=integrity_ok
        )
        self.stdout.write(f"gate: {decision.outcome} ({decision.reason})")
        if not decision.ok:
            raise CommandError(f"{release} is gated: {decision.reason}")
        do_request_promotion(release, registrant)

    def start_worker(self) -> tuple[subprocess.Popen, Path]:
        log_path = Path(
            tempfile.mkstemp(prefix="releasegate-worker-", suffix=".log")[1]
        )
        command = worker_command()
        with open(log_path, "wb") as log:
            worker = subprocess.Popen(
                command,
                cwd=settings.BASE_DIR,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings"},
            )
        self.stdout.write(
            f"celery worker pid {worker.pid} on {settings.CELERY_BROKER_URL} "
            f"(log {log_path})"
        )
        return worker, log_path

    def stop_worker(self, worker: subprocess.Popen) -> None:
        if worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()

    def wait_for(self, release, states, worker, log_path: Path, options) -> None:
        deadline = time.monotonic() + options["timeout"]
        while time.monotonic() < deadline:
            release.refresh_from_db()
            if release.state in states:
                return
            if release.state in ("failed", "failed_verification", "rejected"):
                raise CommandError(
                    f"{release} is {release.state}: {release.failure_reason}"
                )
            if worker.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise CommandError(f"the celery worker exited:\n{tail}")
            time.sleep(0.2)
        raise CommandError(
            f"{release} still {release.state} after {options['timeout']:.0f}s "
            f"(worker log: {log_path})"
        )

    def print_jobs(self, release: Release) -> None:
        for job in release.jobs.order_by("id"):
            duration = f"{job.duration_s * 1000:8.1f} ms" if job.duration_s else "-"
            self.stdout.write(f"  {job.kind:<14} {job.state:<10} {duration}")

    def print_login(self, addr: str, password: str) -> None:
        url = f"http://{addr}/"
        self.stdout.write("")
        self.stdout.write(f"Dashboard:  {url}")
        self.stdout.write(f"API docs:   {url}api/v1/docs")
        self.stdout.write(f"Login:      demo / {password}  (registered the release)")
        self.stdout.write(f"Approver:   approver / {password}")
