from django.apps import AppConfig


class DispatchConfig(AppConfig):
    name = "controlplane.dispatch"
    label = "dispatch"
