from django import forms
from django.contrib import admin

from controlplane.errors import ValidationFailed
from controlplane.fleet.backend import BACKEND_KEYS, clean_backend
from controlplane.fleet.models import Agent, Deployment, Environment


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
            return clean_backend(self.cleaned_data["serving_backend"])
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
