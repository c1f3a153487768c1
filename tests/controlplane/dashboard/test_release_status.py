from datetime import UTC

from controlplane.releases.actions.jobs import do_start_job
from tests.controlplane.api.test_get_release import reverified


def test_it_renders_the_state_and_stages_fragment(client, owner, make_release):
    release = make_release("1.0.0", state="verifying")
    do_start_job(release, "verify_source")
    client.force_login(owner)

    response = client.get(f"/releases/{release.pk}/status/")

    body = response.content.decode()
    assert response.status_code == 200
    assert "<html" not in body
    assert '<span class="state state-verifying">verifying</span>' in body
    assert '<tr data-stage="verify_source">' in body


def test_it_is_404_for_outsiders(client, outsider, release):
    client.force_login(outsider)

    assert client.get(f"/releases/{release.pk}/status/").status_code == 404


def test_it_shows_the_re_verifications_as_one_row_with_their_count(
    client, teammate, make_live
):
    release = make_live("1.0.0")
    *_, last = reverified(release, 4, last_error="changed: config.json")
    client.force_login(teammate)

    body = client.get(f"/releases/{release.pk}/status/").content.decode()

    assert body.count('<tr data-stage="reverify">') == 1
    finished = last.finished.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    assert f"re-verified 4 times, last at {finished} UTC: fail" in body
    assert f'href="/releases/{release.pk}/reverifications/"' in body
    assert '<tr data-stage="verify">' in body  # the pipeline as it was
