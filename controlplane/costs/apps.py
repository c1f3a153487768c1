from django.apps import AppConfig


class CostsConfig(AppConfig):
    name = "controlplane.costs"
    label = "costs"
