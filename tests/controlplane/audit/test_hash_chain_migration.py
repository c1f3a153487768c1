"""Migrations audit 0002_hash_chain and 0003_chain_after_commit: events written
before the chain existed get one, in id order (seq follows id), that
verify_audit_chain accepts and new events continue."""

import io

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from controlplane.audit.actions import do_record_event
from controlplane.audit.models import AuditChainHead, AuditEvent

BEFORE = [("audit", "0001_initial")]
AFTER = [("audit", "0003_chain_after_commit")]


@pytest.fixture
def at_0001(transactional_db):
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    yield executor.loader.project_state(BEFORE).apps
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


def test_it_backfills_a_valid_chain(at_0001):
    old_event = at_0001.get_model("audit", "AuditEvent")
    for n in range(3):
        old_event.objects.create(
            actor_name="alice",
            verb=f"old.step{n}",
            object_type="release",
            object_id=str(n),
            after={"n": n, "nested": {"b": [1, 2], "a": None}},
            created=timezone.now(),
        )

    MigrationExecutor(connection).migrate(AFTER)

    events = list(AuditEvent.objects.order_by("id"))
    assert [e.verb for e in events] == ["old.step0", "old.step1", "old.step2"]
    assert len({e.event_hash for e in events}) == 3
    assert [e.seq for e in events] == [1, 2, 3]
    head = AuditChainHead.objects.get()
    assert (head.last_event_id, head.last_seq, head.last_hash) == (
        events[-1].pk,
        3,
        events[-1].event_hash,
    )
    out = io.StringIO()
    call_command("verify_audit_chain", stdout=out)
    assert "holds: 3 events" in out.getvalue()
    # New events continue the backfilled chain.
    new = do_record_event("system:cli", "new.step", events[0])  # any object
    new.refresh_from_db()  # chained at once: no transaction around it
    assert (new.seq, new.prev_hash) == (4, events[-1].event_hash)
    call_command("verify_audit_chain", stdout=out)
    assert "holds: 4 events" in out.getvalue()
