from django.apps import AppConfig


class LoadPlansConfig(AppConfig):
    name = "controlplane.loadplans"
    label = "loadplans"
