from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "controlplane.fleet"
    label = "fleet"

    def ready(self) -> None:
        from controlplane.fleet import checks  # noqa: F401  (registers them)
