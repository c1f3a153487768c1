from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError
from django.utils import timezone

from controlplane.audit import chain
from controlplane.audit.actions import chain_pending
from controlplane.audit.models import AuditChainHead, AuditEvent

# An event is chained right after its transaction commits; one this young and not
# yet chained may be between its commit and its chaining.
UNCHAINED_GRACE = timedelta(minutes=1)


class Command(BaseCommand):
    help = (
        "Check the audit log's hash chain: every event's hash over its content and "
        "the previous event's hash, in chain (seq) order, up to the chain head. "
        "First chains what is pending (events whose on-commit chaining was lost). "
        "Exits non-zero naming the first event that breaks it, or an event older "
        "than a minute that was never chained; on success prints the head hash "
        "(record it elsewhere to pin the history up to now)."
    )

    def handle(self, *args, **options) -> None:
        """An event left unchained is outside the chain's protection: it can be
        edited or deleted without a trace, and nothing fixes its order. Events are
        chained on commit, by the beat and by this command's own chain_pending
        just now, so one still unchained a minute after it was written means the
        chaining fails (or, here, could not run: a read-only connection) and the
        log has an unprotected part: a failure, not a pass. Younger ones may be
        committing this instant, so they are let be."""
        try:
            chained = chain_pending()
        except DatabaseError as error:
            self.stderr.write(f"could not chain pending events: {error}")
        else:
            if chained:
                self.stdout.write(f"chained {chained} pending events")
        head = AuditChainHead.objects.filter(pk=1).first()
        events = (
            AuditEvent.objects.filter(seq__isnull=False)
            .order_by("seq")
            .iterator(chunk_size=2000)
        )
        why = chain.first_break(
            events,
            head.last_event_id if head else None,
            head.last_hash if head else "",
        )
        if not why:
            stale = (
                AuditEvent.objects.filter(
                    seq__isnull=True, created__lt=timezone.now() - UNCHAINED_GRACE
                )
                .order_by("id")
                .first()
            )
            if stale:
                why = (
                    f"event {stale.pk} ({stale.verb}) was never chained: its "
                    "chaining fails or cannot run"
                )
        if why:
            raise CommandError(f"audit chain broken: {why}")
        count = AuditEvent.objects.filter(seq__isnull=False).count()
        last_hash = head.last_hash if head and head.last_hash else chain.GENESIS
        self.stdout.write(
            f"audit chain holds: {count} events, head {last_hash} "
            f"(event {head.last_event_id if head else None})"
        )
