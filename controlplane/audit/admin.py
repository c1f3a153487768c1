from django.contrib import admin

from controlplane.audit.models import AuditChainHead, AuditEvent, EventWindow


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("created", "actor_name", "verb", "object_type", "object_id")
    list_filter = ("verb", "object_type", "team")
    search_fields = ("actor_name", "object_id")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(AuditChainHead)
class AuditChainHeadAdmin(admin.ModelAdmin):
    # Moved only by chain_pending; shown so an operator can copy the head hash.
    list_display = ("last_event_id", "last_seq", "last_hash")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(EventWindow)
class EventWindowAdmin(admin.ModelAdmin):
    # Refusals being counted now (written only by audit.actions): read-only.
    list_display = ("window_start", "verb", "source", "reason", "count", "last_seen")
    list_filter = ("verb", "source")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
