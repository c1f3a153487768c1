from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied

from controlplane.audit.admin import ReadOnlyAdmin
from controlplane.errors import ControlPlaneError, ValidationFailed
from controlplane.fleet.actions import do_set_serving_preset
from controlplane.fleet.backend import (
    AGENT_PRESETS,
    BACKEND_KEYS,
    check_command_template,
    clean_backend,
)
from controlplane.fleet.models import (
    Agent,
    Deployment,
    EnrollmentRequest,
    Environment,
    SeenMessage,
    ServingPreset,
)


class EnvironmentForm(forms.ModelForm):
    class Meta:
        model = Environment
        fields = ["team", "name", "serving_backend"]
        help_texts = {
            "serving_backend": "JSON with " + ", ".join(BACKEND_KEYS) + " ({} is the "
            'project\'s engine; e.g. {"kind": "external", "preset": "vllm", '
            '"tensor_parallel_size": 2})'
        }

    def clean_serving_backend(self):
        try:
            # The admin site is for staff only: platform operators.
            return clean_backend(self.cleaned_data["serving_backend"], operator=True)
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.message) from exc


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    form = EnvironmentForm
    list_display = ("name", "team", "serving_backend", "created")
    list_filter = ("team",)


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "queue",
        "gpu_model",
        "gpu_memory_bytes",
        "state",
        "incarnation",
        "started",
    )
    list_filter = ("state",)


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ("release", "environment", "agent", "state", "started", "ended")
    list_filter = ("state", "environment")


class ServingPresetForm(forms.ModelForm):
    class Meta:
        model = ServingPreset
        fields = ["name", "command_template", "description"]
        help_texts = {
            "command_template": "An argv template with {model_dir}, {port}, ... "
            "placeholders, never run through a shell; environments choose it as "
            '{"kind": "external", "preset": "<name>"}. Agents start it only when '
            "their GPUAGENT_ALLOWED_PROGRAMS lists this exact shape."
        }

    def clean_name(self):
        name = self.cleaned_data["name"]
        if name in AGENT_PRESETS:
            raise forms.ValidationError(f"{name!r} is one of the agent's own presets")
        return name

    def clean_command_template(self):
        template = self.cleaned_data["command_template"]
        try:
            check_command_template(template, "command_template")
        except ValidationFailed as exc:
            raise forms.ValidationError(exc.message) from exc
        return template


@admin.register(ServingPreset)
class ServingPresetAdmin(admin.ModelAdmin):
    """Platform operators name command templates here; team admins choose them
    by name for an environment's external backend."""

    form = ServingPresetForm
    list_display = ("name", "command_template", "updated")

    def get_readonly_fields(self, request, obj=None):
        return ("name",) if obj is not None else ()

    def save_model(self, request, obj, form, change):
        try:
            saved = do_set_serving_preset(
                obj.name,
                obj.command_template,
                actor=request.user,
                description=obj.description,
            )
        except ControlPlaneError as exc:
            raise PermissionDenied(exc.message) from exc
        obj.pk = saved.pk


@admin.register(EnrollmentRequest)
class EnrollmentRequestAdmin(ReadOnlyAdmin):
    list_display = ("requested_name", "fingerprint", "state", "agent", "last_seen")
    list_filter = ("state",)
    search_fields = ("requested_name", "fingerprint")


@admin.register(SeenMessage)
class SeenMessageAdmin(ReadOnlyAdmin):
    list_display = ("signer", "nonce", "seen")
    search_fields = ("signer",)
