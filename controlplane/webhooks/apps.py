from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "controlplane.webhooks"
    label = "webhooks"
