"""Events are chained after their transaction commits (actions.chain_pending), never
under the caller's locks. These tests commit for real (transactional db), so the
on-commit chaining runs as in production."""

import io
import threading
import time
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, connections, transaction
from django.utils import timezone

from controlplane.audit import actions, chain
from controlplane.audit.actions import chain_pending, do_record_event
from controlplane.audit.management.commands import verify_audit_chain
from controlplane.audit.models import AuditChainHead, AuditEvent
from controlplane.releases.models import Release

pytestmark = pytest.mark.django_db(transaction=True)


class Rollback(Exception):
    pass


def verify() -> str:
    out = io.StringIO()
    call_command("verify_audit_chain", stdout=out)
    return out.getvalue()


def chained(verb: str) -> AuditEvent:
    return AuditEvent.objects.get(verb=verb)


def test_an_event_is_chained_when_its_transaction_commits(release, owner):
    with transaction.atomic():
        event = do_record_event(owner, "release.inside", release)
        stored = AuditEvent.objects.get(pk=event.pk)
        assert (stored.seq, stored.prev_hash, stored.event_hash) == (None, "", "")

    event = chained("release.inside")
    last_before = AuditEvent.objects.get(seq=event.seq - 1)
    assert event.prev_hash == last_before.event_hash
    assert event.event_hash == chain.event_hash(event, last_before.event_hash)
    head = AuditChainHead.objects.get()
    assert (head.last_event_id, head.last_seq) == (event.pk, event.seq)
    assert "holds" in verify()


def test_a_rolled_back_event_leaves_no_hole(release, owner):
    with pytest.raises(Rollback), transaction.atomic():
        do_record_event(owner, "release.undone", release)
        raise Rollback
    with transaction.atomic():
        do_record_event(owner, "release.kept", release)

    assert not AuditEvent.objects.filter(verb="release.undone").exists()
    kept = chained("release.kept")
    assert kept.seq == AuditEvent.objects.count()  # seqs 1..n, no gap
    assert kept.prev_hash == AuditEvent.objects.get(seq=kept.seq - 1).event_hash
    assert "holds" in verify()


def test_a_lost_on_commit_is_chained_later(release, owner, monkeypatch):
    """The process killed right after the commit: its chaining never ran."""
    with monkeypatch.context() as lost:
        lost.setattr(actions, "chain_pending", lambda: 0)
        with transaction.atomic():
            do_record_event(owner, "release.orphan", release)
    assert chained("release.orphan").seq is None

    assert chain_pending() == 1
    assert chain_pending() == 0  # idempotent
    orphan = chained("release.orphan")
    assert orphan.seq == AuditChainHead.objects.get().last_seq
    assert "holds" in verify()


def test_the_beat_chains_what_is_pending(release, owner, monkeypatch, settings):
    from controlplane.audit.tasks import chain_pending_events

    with monkeypatch.context() as lost:
        lost.setattr(actions, "chain_pending", lambda: 0)
        do_record_event(owner, "release.orphan", release)
    scheduled = settings.CELERY_BEAT_SCHEDULE["chain-audit-events"]
    assert scheduled["task"] == chain_pending_events.name

    assert chain_pending_events() == 1
    assert chained("release.orphan").seq is not None


def test_verify_chains_what_is_pending_first(release, owner, monkeypatch):
    with monkeypatch.context() as lost:
        lost.setattr(actions, "chain_pending", lambda: 0)
        do_record_event(owner, "release.orphan", release)

    out = verify()

    assert "chained 1 pending events" in out
    assert chained("release.orphan").seq is not None


def test_verify_fails_on_an_event_never_chained(release, owner, monkeypatch):
    def cannot_chain():
        raise DatabaseError("read-only transaction")

    monkeypatch.setattr(actions, "chain_pending", lambda: 0)
    monkeypatch.setattr(verify_audit_chain, "chain_pending", cannot_chain)
    do_record_event(owner, "release.young", release)
    assert "holds" in verify()  # a moment old: may be committing right now

    old = do_record_event(owner, "release.old", release)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE audit_auditevent SET created = %s WHERE id = %s",
            [timezone.now() - timedelta(minutes=2), old.pk],
        )
    with pytest.raises(CommandError, match=f"event {old.pk} .* was never chained"):
        verify()


def test_concurrent_chainers_chain_each_event_once(release, owner, monkeypatch):
    monkeypatch.setattr(actions, "chain_pending", lambda: 0)
    for n in range(20):
        do_record_event(owner, f"release.p{n}", release)
    monkeypatch.undo()
    counts, errors = [], []

    def run() -> None:
        try:
            counts.append(chain_pending())
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            connections.close_all()

    chainers = [threading.Thread(target=run) for _ in range(4)]
    for chainer in chainers:
        chainer.start()
    for chainer in chainers:
        chainer.join(timeout=60)

    assert errors == []
    assert sum(counts) == 20
    assert not AuditEvent.objects.filter(seq__isnull=True).exists()
    assert "holds" in verify()


def test_a_writer_holding_a_row_lock_never_waits_on_the_chain(release, owner):
    """The deadlock chaining at insert had on PostgreSQL: T1 locks row A then
    records an event; T2 records an event (holding the chain head, then) and locks
    row A. With chaining after commit T2 only waits for T1 to commit."""
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's (SQLite locks the whole database)")
    a_locked, t2_recorded, t1_recorded = (threading.Event() for _ in range(3))
    errors = []

    def limit_waits() -> None:
        # Fail, not hang, if a lock is never granted (the deadlock detector
        # usually ends it after deadlock_timeout, 1s).
        connection.cursor().execute("SET LOCAL lock_timeout = '10s'")

    def t1() -> None:
        try:
            with transaction.atomic():
                limit_waits()
                Release.objects.select_for_update().get(pk=release.pk)
                a_locked.set()
                assert t2_recorded.wait(10)
                do_record_event(owner, "release.t1", release)
                t1_recorded.set()
                time.sleep(0.3)  # still holding A while T2 asks for it
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(("t1", error))
        finally:
            connections.close_all()

    def t2() -> None:
        try:
            assert a_locked.wait(10)
            with transaction.atomic():
                limit_waits()
                do_record_event(owner, "release.t2", release)
                t2_recorded.set()
                # Chaining at insert, T1 never gets here: it waits on the head.
                t1_recorded.wait(3)
                Release.objects.select_for_update().get(pk=release.pk)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(("t2", error))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=t1), threading.Thread(target=t2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    t1_event, t2_event = chained("release.t1"), chained("release.t2")
    assert t2_event.pk < t1_event.pk  # T2 wrote first, T1 committed first
    assert None not in (t1_event.seq, t2_event.seq)
    assert "holds" in verify()
