import pytest

from controlplane.webhooks.models import Webhook
from tests.controlplane.api.helpers import error_of


def url(environment_id) -> str:
    return f"/api/v1/environments/{environment_id}/webhooks"


@pytest.fixture
def admin_token(make_token, owner):
    return make_token(owner, "read", "admin")


HOOK = "https://hooks.example.org/services/T000/B000/s3cr3t-token"


def test_it_adds_a_webhook_and_shows_its_secret_once(api, admin_token, environment):
    response = api.post(url(environment.pk), {"url": HOOK}, token=admin_token)

    assert response.status_code == 201, response.content
    created = response.json()
    assert created["secret"].startswith("whsec_")
    assert created["full_url"] == HOOK
    listed = api.get(url(environment.pk), token=admin_token)
    assert listed.status_code == 200, listed.content
    [shown] = listed.json()
    assert shown["id"] == created["id"]
    assert shown["url"] == "https://hooks.example.org/…"
    assert created["secret"] not in listed.content.decode()
    assert "s3cr3t" not in listed.content.decode()


def test_it_refuses_a_bad_url(api, admin_token, environment, settings):
    settings.RELEASEGATE_WEBHOOK_ALLOW_PRIVATE = False
    for bad in ("ftp://x.org/h", "http://10.0.0.7/hook", "http://[::1]/h"):
        response = api.post(url(environment.pk), {"url": bad}, token=admin_token)

        error_of(response, 422, "validation_failed")
    assert not Webhook.objects.exists()


def test_it_removes_a_webhook(api, admin_token, environment):
    created = api.post(url(environment.pk), {"url": HOOK}, token=admin_token).json()

    response = api.client.delete(
        f"{url(environment.pk)}/{created['id']}",
        headers={"Authorization": f"Bearer {admin_token}"},
    )

    assert response.status_code == 204, response.content
    assert not Webhook.objects.exists()


def test_it_needs_the_admin_scope_and_hides_other_teams(
    api, owner_token, outsider_token, environment
):
    error = error_of(
        api.post(url(environment.pk), {"url": HOOK}, token=owner_token),
        403,
        "missing_scope",
    )
    assert error["scope"] == "admin"
    error_of(
        api.post(url(environment.pk), {"url": HOOK}, token=outsider_token),
        404,
        "not_found",
    )
