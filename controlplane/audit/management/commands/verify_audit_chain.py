from django.core.management.base import BaseCommand, CommandError

from controlplane.audit import chain
from controlplane.audit.models import AuditChainHead, AuditEvent


class Command(BaseCommand):
    help = (
        "Check the audit log's hash chain: every event's hash over its content and "
        "the previous event's hash, in id order, up to the chain head. Exits "
        "non-zero naming the first event that breaks it; on success prints the "
        "head hash (record it elsewhere to pin the history up to now)."
    )

    def handle(self, *args, **options) -> None:
        head = AuditChainHead.objects.filter(pk=1).first()
        events = AuditEvent.objects.order_by("id").iterator(chunk_size=2000)
        why = chain.first_break(
            events,
            head.last_event_id if head else None,
            head.last_hash if head else "",
        )
        if why:
            raise CommandError(f"audit chain broken: {why}")
        count = AuditEvent.objects.count()
        last_hash = head.last_hash if head and head.last_hash else chain.GENESIS
        self.stdout.write(
            f"audit chain holds: {count} events, head {last_hash} "
            f"(event {head.last_event_id if head else None})"
        )
