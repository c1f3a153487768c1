from django.contrib import admin

from controlplane.releases.models import (
    Approval,
    Artifact,
    GateResult,
    Job,
    ModelFamily,
    Release,
)


@admin.register(ModelFamily)
class ModelFamilyAdmin(admin.ModelAdmin):
    list_display = ("name", "team", "created")
    list_filter = ("team",)
    search_fields = ("name",)


class JobInline(admin.TabularInline):
    model = Job
    extra = 0
    fields = ("kind", "state", "attempts", "started", "finished", "error")
    readonly_fields = fields


@admin.register(Release)
class ReleaseAdmin(admin.ModelAdmin):
    list_display = ("__str__", "state", "target_environment", "created_by", "created")
    list_filter = ("state", "model__team")
    search_fields = ("version", "model__name")
    # State moves only through actions.do_transition_release (audited, checked).
    readonly_fields = ("state", "registration_body_digest", "created", "updated")
    inlines = [JobInline]


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ("path", "release", "size_bytes", "digest")


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("kind", "release", "state", "attempts", "started", "finished")
    list_filter = ("state", "kind")


@admin.register(GateResult)
class GateResultAdmin(admin.ModelAdmin):
    list_display = ("gate", "metric", "release", "observed", "threshold", "outcome")
    list_filter = ("outcome",)


@admin.register(Approval)
class ApprovalAdmin(admin.ModelAdmin):
    list_display = ("release", "user", "decision", "manifest_digest", "created")
    list_filter = ("decision",)
