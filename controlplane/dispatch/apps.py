from django.apps import AppConfig


class DispatchConfig(AppConfig):
    name = "controlplane.dispatch"
    label = "dispatch"

    def ready(self) -> None:
        from controlplane.dispatch import checks  # noqa: F401 (registers them)
