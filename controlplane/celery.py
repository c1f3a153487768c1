"""The control plane's Celery app: configured from Django settings (CELERY_*), tasks
autodiscovered from each app's tasks.py. Start a worker with
`celery -A controlplane worker`."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
