import pytest
from django.apps import apps
from django.contrib import admin

APPS = ("accounts", "fleet", "releases", "audit", "costs")


@pytest.mark.parametrize(
    "model",
    [m for label in APPS for m in apps.get_app_config(label).get_models()],
    ids=lambda m: m._meta.label,
)
def test_it_registers_every_model_in_the_admin(model, admin_client):
    assert admin.site.is_registered(model)

    response = admin_client.get(
        f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
    )

    assert response.status_code == 200


@pytest.mark.parametrize(
    "label",
    [
        "audit.AuditEvent",
        "audit.AuditChainHead",
        "audit.EventWindow",
        "fleet.EnrollmentRequest",
        "fleet.SeenMessage",
    ],
)
def test_rows_only_their_own_writers_make_are_read_only_here(label, admin_client):
    model = apps.get_model(label)
    model_admin = admin.site._registry[model]

    response = admin_client.get(
        f"/admin/{model._meta.app_label}/{model._meta.model_name}/add/"
    )

    assert response.status_code == 403
    assert not model_admin.has_change_permission(None)
    assert not model_admin.has_delete_permission(None)
