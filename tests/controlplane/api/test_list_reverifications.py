from controlplane.releases.actions.jobs import do_start_job
from tests.controlplane.api.helpers import error_of
from tests.controlplane.api.test_get_release import reverified


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}/reverifications"


def test_it_lists_every_re_verification_newest_first_a_page_at_a_time(
    api, owner_token, release
):
    jobs = reverified(release, 3, last_error="missing: model.safetensors")

    first = api.get(url(release.pk), token=owner_token, limit=2)
    rest = api.get(url(release.pk), token=owner_token, limit=2, offset=2)

    assert first.status_code == 200, first.content
    assert first.json()["count"] == 3
    ids = [j["id"] for j in first.json()["items"] + rest.json()["items"]]
    assert ids == [job.pk for job in reversed(jobs)]
    assert first.json()["items"][0]["error"] == "missing: model.safetensors"


def test_it_lists_nothing_else(api, owner_token, release):
    reverified(release, 1)
    do_start_job(release, "verify_source")

    response = api.get(url(release.pk), token=owner_token)

    assert [j["kind"] for j in response.json()["items"]] == ["reverify"]


def test_it_hides_the_release_from_an_outsider(api, outsider_token, release):
    reverified(release, 1)

    error_of(api.get(url(release.pk), token=outsider_token), 404, "not_found")


def test_it_needs_credentials(api, release):
    error_of(api.get(url(release.pk)), 401, "not_authenticated")
