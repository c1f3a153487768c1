"""The hash chain (controlplane.audit.chain) as do_record_event and chain_pending
write it, and the verify_audit_chain command that checks it. Tampering is done the
way someone with the database would: raw SQL past the append-only model. These
tests run inside one transaction that never commits, so they chain by calling
chain_pending (what the commit would)."""

import io

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from controlplane.audit import chain
from controlplane.audit.actions import chain_pending, do_record_event
from controlplane.audit.models import AuditChainHead, AuditEvent


@pytest.fixture
def events(release, owner):
    """Five events, each with its own verb so a message can name which, chained."""
    written = [
        do_record_event(owner, f"release.step{n}", release, after={"n": n})
        for n in range(1, 6)
    ]
    chain_pending()
    return [AuditEvent.objects.get(pk=event.pk) for event in written]


def verify() -> str:
    out = io.StringIO()
    call_command("verify_audit_chain", stdout=out)
    return out.getvalue()


def sql(statement: str, *params) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params)


def test_it_chains_each_event_to_the_one_before(events):
    assert AuditEvent.objects.order_by("seq").first().prev_hash == chain.GENESIS
    for before, event in zip(events, events[1:], strict=False):
        assert event.seq == before.seq + 1
        assert event.prev_hash == before.event_hash
        assert event.event_hash == chain.event_hash(event, before.event_hash)
    head = AuditChainHead.objects.get()
    assert (head.last_event_id, head.last_seq, head.last_hash) == (
        events[-1].pk,
        events[-1].seq,
        events[-1].event_hash,
    )


def test_it_holds_for_an_untouched_log(events):
    out = verify()

    count = AuditEvent.objects.count()  # with the release's own
    assert f"holds: {count} events, head {events[-1].event_hash}" in out


def test_it_holds_for_an_empty_log(db):
    assert "holds: 0 events" in verify()


def test_it_detects_an_edited_event(events):
    sql("UPDATE audit_auditevent SET verb = %s WHERE id = %s", "x", events[2].pk)

    with pytest.raises(CommandError, match=f"event {events[2].pk} \\(x\\) was changed"):
        verify()


def test_it_detects_an_edited_payload_or_actor(events, teammate):
    sql(
        "UPDATE audit_auditevent SET after = %s WHERE id = %s",
        '{"n": 30}',
        events[2].pk,
    )
    with pytest.raises(CommandError, match=f"event {events[2].pk} .* was changed"):
        verify()
    sql(
        "UPDATE audit_auditevent SET after = %s, actor_name = %s WHERE id = %s",
        '{"n": 3}',
        teammate.username,
        events[2].pk,
    )
    with pytest.raises(CommandError, match=f"event {events[2].pk} .* was changed"):
        verify()


def test_it_detects_a_deleted_event(events):
    sql("DELETE FROM audit_auditevent WHERE id = %s", events[2].pk)

    with pytest.raises(
        CommandError,
        match=f"event {events[3].pk} \\(release.step4\\) does not follow "
        f"event {events[1].pk}",
    ):
        verify()


def test_it_detects_that_the_newest_events_were_deleted(events):
    sql("DELETE FROM audit_auditevent WHERE id >= %s", events[3].pk)

    with pytest.raises(
        CommandError,
        match=f"ends at event {events[2].pk} but its head names event {events[4].pk}",
    ):
        verify()


def test_it_detects_reordered_events(events):
    second, third = events[1], events[2]
    sql("UPDATE audit_auditevent SET seq = %s WHERE id = %s", -1, second.pk)
    sql("UPDATE audit_auditevent SET seq = %s WHERE id = %s", second.seq, third.pk)
    sql("UPDATE audit_auditevent SET seq = %s WHERE id = %s", third.seq, second.pk)

    # The third event now sits where the second was: it does not follow the first.
    with pytest.raises(
        CommandError,
        match=f"event {third.pk} \\(release.step3\\) does not follow event "
        f"{events[0].pk}",
    ):
        verify()


def test_it_detects_an_event_rehashed_on_its_own(events):
    """Recomputing the edited event's own hash does not help: the next one still
    names the old hash."""
    edited = AuditEvent.objects.get(pk=events[2].pk)
    edited.verb = "x"
    forged = chain.event_hash(edited, edited.prev_hash)
    sql(
        "UPDATE audit_auditevent SET verb = %s, event_hash = %s WHERE id = %s",
        "x",
        forged,
        edited.pk,
    )

    with pytest.raises(CommandError, match=f"event {events[3].pk} .* does not follow"):
        verify()


@pytest.mark.django_db(transaction=True)
def test_it_keeps_one_chain_under_concurrent_writers(release, owner):
    """Writers in their own transactions and connections, each holding its
    transaction open a moment after appending: each commit chains what committed,
    under the head's lock, so they keep one chain."""
    import threading
    import time

    from django.db import connections, transaction

    def write(n: int) -> None:
        try:
            for i in range(5):
                with transaction.atomic():
                    do_record_event(owner, f"release.w{n}.{i}", release)
                    time.sleep(0.005)
        finally:
            connections.close_all()

    writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)

    assert AuditEvent.objects.filter(verb__startswith="release.w").count() == 20
    assert not AuditEvent.objects.filter(seq__isnull=True).exists()
    assert "holds" in verify()
