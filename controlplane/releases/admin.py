from django import forms
from django.contrib import admin
from pydantic import ValidationError

from controlplane.releases.gates import GatePolicy
from controlplane.releases.models import (
    Approval,
    Artifact,
    EnvironmentGatePolicy,
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
    # State moves only through do_transition_release (audited, checked).
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


class EnvironmentGatePolicyForm(forms.ModelForm):
    class Meta:
        model = EnvironmentGatePolicy
        fields = ["environment", "policy"]
        help_texts = {
            "policy": "JSON of releases.gates.GatePolicy (README: Gate policy); "
            '{} is the default, {"quality": null} stops gating on quality, '
            '{"auto_rollback_on_failed_verification": true} rolls the environment '
            "back by itself when a live copy fails re-verification."
        }

    def clean_policy(self):
        try:
            spec = GatePolicy.model_validate(self.cleaned_data["policy"])
        except ValidationError as exc:
            raise forms.ValidationError(str(exc)) from exc
        return spec.model_dump(mode="json")


@admin.register(EnvironmentGatePolicy)
class EnvironmentGatePolicyAdmin(admin.ModelAdmin):
    form = EnvironmentGatePolicyForm
    list_display = ("environment", "version", "updated")

    def save_model(self, request, obj, form, change):
        # A changed policy is a new version: approvals re-check gate results
        # held against an older one.
        if form.changed_data:
            obj.version += 1
        super().save_model(request, obj, form, change)
