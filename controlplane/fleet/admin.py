from django.contrib import admin

from controlplane.fleet.models import Agent, Deployment, Environment


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    list_display = ("name", "team", "created")
    list_filter = ("team",)


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = ("name", "queue", "gpu_model", "gpu_memory_bytes", "state")
    list_filter = ("state",)


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ("release", "environment", "agent", "state", "started", "ended")
    list_filter = ("state", "environment")
