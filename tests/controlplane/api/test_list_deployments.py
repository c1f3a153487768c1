from datetime import timedelta

from django.utils import timezone

from controlplane.fleet.models import Deployment
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/deployments"


def release_ids(response) -> list[int]:
    assert response.status_code == 200, response.content
    return [d["release_id"] for d in response.json()["items"]]


def test_it_lists_deployments_newest_first_with_filters(
    api, owner_token, make_release, make_environment, environment
):
    production = make_environment("production")
    old = make_release("1.0.0", state="superseded")
    new = make_release("2.0.0", state="live")
    earlier = timezone.now() - timedelta(hours=1)
    Deployment.objects.create(
        release=old, environment=environment, state="superseded", started=earlier
    )
    Deployment.objects.create(release=new, environment=environment, state="live")
    Deployment.objects.create(release=new, environment=production, state="deploying")

    everything = api.get(URL, token=owner_token)
    assert release_ids(everything) == [new.pk, new.pk, old.pk]
    assert everything.json()["count"] == 3
    staging = api.get(URL, token=owner_token, environment="staging")
    assert release_ids(staging) == [new.pk, old.pk]
    assert release_ids(api.get(URL, token=owner_token, state="superseded")) == [old.pk]
    by_release = api.get(URL, token=owner_token, release=new.pk)
    assert [d["environment"] for d in by_release.json()["items"]] == [
        "production",
        "staging",
    ]


def test_it_shows_an_outsider_nothing(api, outsider_token, release, environment):
    Deployment.objects.create(release=release, environment=environment, state="live")

    assert release_ids(api.get(URL, token=outsider_token)) == []


def test_it_names_a_bad_state(api, owner_token):
    response = api.get(URL, token=owner_token, state="exploded")

    assert field_names(error_of(response, 422, "validation_error")) == {"state"}


def test_it_needs_credentials(api, db):
    error_of(api.get(URL), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, db):
    error_of(api.get(URL, token="rg_nope"), 401, "not_authenticated")


def test_it_needs_the_read_scope(api, make_token, owner):
    response = api.get(URL, token=make_token(owner, "register"))

    assert error_of(response, 403, "missing_scope")["scope"] == "read"


def test_it_shows_why_a_rollback_ended(api, owner_token, make_release, environment):
    release = make_release("1.0.0", state="failed")
    reason = f"no previous release of staging still verifies: {release} (not loadable)"
    Deployment.objects.create(
        release=release,
        environment=environment,
        state="failed",
        ended=timezone.now(),
        reason=reason,
        rollback_tried=[],
    )

    (shown,) = api.get(URL, token=owner_token).json()["items"]

    assert (shown["reason"], shown["rollback"]) == (reason, True)
