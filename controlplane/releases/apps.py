from django.apps import AppConfig


class ReleasesConfig(AppConfig):
    name = "controlplane.releases"
    label = "releases"
