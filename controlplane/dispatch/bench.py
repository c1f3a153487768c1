"""How long promote and approve take with the broker down, through the real API.

    .venv/bin/python -m controlplane.dispatch.bench

Against two Redis URLs on 127.0.0.1: a port that refuses connections, and a server
that takes connections and never answers. Each request is timed after one warm-up
request (imports and the first connection); the process uses a throwaway SQLite
database. Prints one line per request: status and seconds.
"""

import os
import socket
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    data = Path(tempfile.mkdtemp(prefix="releasegate-bench-"))
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        RELEASEGATE_DATA_DIR=str(data),
        DATABASE_URL=f"sqlite:///{data / 'db.sqlite3'}",
        RELEASEGATE_SOURCE_ROOTS=str(data / "sources"),
    )
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    refusing = socket.socket()
    refusing.bind(("127.0.0.1", 0))
    refused_port = refusing.getsockname()[1]
    refusing.close()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    brokers = {
        "refuses connections": f"redis://127.0.0.1:{refused_port}/12",
        "accepts, never answers": f"redis://127.0.0.1:{silent.getsockname()[1]}/12",
    }
    print(
        f"publish timeouts: connect {settings.BROKER_CONNECT_TIMEOUT_S} s, answer "
        f"{settings.RELEASEGATE_OUTBOX_PUBLISH_TIMEOUT_S} s"
    )
    for name, url in brokers.items():
        for line in time_requests(url, data):
            print(f"{name:24} {line}")
    silent.close()


def time_requests(broker_url: str, data: Path) -> list[str]:
    from django.contrib.auth.models import User
    from django.test import Client

    from controlplane import celery_app
    from controlplane.accounts.models import ApiToken, Membership, Team
    from controlplane.fleet.models import Environment
    from controlplane.releases.actions.registration import do_register_release
    from controlplane.releases.models import ModelFamily, Release

    for key in ("broker_url", "broker_read_url", "broker_write_url"):
        celery_app.conf[key] = broker_url
    slug = f"t{time.monotonic_ns()}"
    team = Team.objects.create(name=slug, slug=slug)
    ci = User.objects.create(username=f"{slug}-ci")
    approver = User.objects.create(username=f"{slug}-approver")
    Membership.objects.create(team=team, user=ci, role="admin")
    Membership.objects.create(team=team, user=approver, role="approver")
    environment = Environment.objects.create(team=team, name="staging")
    family = ModelFamily.objects.create(team=team, name="m")
    _, ci_token = ApiToken.create(ci, team, "ci", ["read", "register", "promote"])
    _, approver_token = ApiToken.create(approver, team, "a", ["read", "approve"])
    client = Client(SERVER_NAME="localhost")
    digest = "sha256:" + "ab" * 32
    lines = []
    for n in range(3):
        source = data / "sources" / slug / "m" / str(n)
        source.mkdir(parents=True)
        release, _ = do_register_release(
            family,
            version=str(n),
            source_uri=source.as_uri(),
            recipe={"weights": "int8", "kv_cache_dtype": "int8"},
            target_environment=environment,
            actor=ci,
        )
        started = time.monotonic()
        response = client.post(
            f"/api/v1/releases/{release.pk}/promote",
            headers={"Authorization": f"Bearer {ci_token}"},
        )
        promote_s = time.monotonic() - started
        Release.objects.filter(pk=release.pk).update(
            state="awaiting_approval", manifest_digest=digest
        )
        started = time.monotonic()
        approved = client.post(
            f"/api/v1/releases/{release.pk}/approve",
            {"manifest_digest": digest},
            content_type="application/json",
            headers={"Authorization": f"Bearer {approver_token}"},
        )
        approve_s = time.monotonic() - started
        if n:  # the first pair warms up (imports, first connection)
            lines.append(
                f"promote HTTP {response.status_code} {promote_s:6.2f} s   "
                f"approve HTTP {approved.status_code} {approve_s:6.2f} s"
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
