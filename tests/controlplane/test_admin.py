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
