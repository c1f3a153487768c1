"""The REST API for CI under /api/v1/ (django-ninja): see `controlplane.api.main`."""
