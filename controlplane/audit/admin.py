from django.contrib import admin

from controlplane.audit.models import AuditChainHead, AuditEvent, EventWindow


class ReadOnlyAdmin(admin.ModelAdmin):
    """Shown, never written in the admin: rows only their own writers make (the
    audit log and its chain, the refusal counts; elsewhere enrollment through its
    actions and the replay store through the intake)."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ("created", "actor_name", "verb", "object_type", "object_id")
    list_filter = ("verb", "object_type", "team")
    search_fields = ("actor_name", "object_id")


@admin.register(AuditChainHead)
class AuditChainHeadAdmin(ReadOnlyAdmin):
    # Moved only by chain_pending; shown so an operator can copy the head hash.
    list_display = ("last_event_id", "last_seq", "last_hash")


@admin.register(EventWindow)
class EventWindowAdmin(ReadOnlyAdmin):
    # Refusals being counted now (written only by audit.actions).
    list_display = ("window_start", "verb", "source", "reason", "count", "last_seen")
    list_filter = ("verb", "source")
