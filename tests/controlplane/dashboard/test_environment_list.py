import pytest

from controlplane.fleet.models import Deployment
from controlplane.releases.actions.deployments import do_fail_deployment
from controlplane.releases.actions.jobs import do_finish_job, do_start_job

REASON = "manifest digest mismatch; changed: model-00002-of-00002.safetensors"


@pytest.fixture
def broken(make_live):
    """0.9.0 was live, 0.9.5 replaced it, then 0.9.5 failed re-verification."""
    old = make_live("0.9.0")
    new = make_live("0.9.5")
    deployment = Deployment.objects.get(release=new)
    do_fail_deployment(
        deployment, actor="system:worker", reason=REASON, verification=True
    )
    return old, new


def _row(response, environment) -> dict:
    (row,) = [r for r in response.context["rows"] if r["environment"] == environment]
    return row


def test_it_shows_what_is_live_since_when_where(
    client, teammate, make_live, environment
):
    live = make_live("0.9.0")
    deployment = Deployment.objects.get(release=live)
    client.force_login(teammate)

    response = client.get("/environments/")

    body = response.content.decode()
    row = _row(response, environment)
    assert row["live"] == deployment
    assert row["live_agent_health"].alive is True
    assert f"{deployment.started:%Y-%m-%d %H:%M:%S} UTC" in body
    assert "gpu-a1" in body and "http://10.0.0.7:8100/v1" in body
    assert row["target"] is None and b"/rollback/" not in response.content


def test_it_offers_rollback_of_a_failed_verification_with_the_target_checked(
    client, teammate, broken, environment
):
    old, new = broken
    client.force_login(teammate)

    response = client.get("/environments/")

    row = _row(response, environment)
    assert row["live"].release == new and row["live"].state == "failed_verification"
    assert row["target"].release == old
    assert row["target_verification"].ok is True
    assert row["rollback_refusal"] == ""
    body = response.content.decode()
    assert REASON in body
    assert f"/environments/{environment.pk}/rollback/" in body
    assert f"Roll back to {old}…" in body


def test_it_shows_a_target_whose_bytes_failed_their_last_check(
    client, teammate, broken, environment
):
    old, _ = broken
    job = do_start_job(old, "reverify")
    do_finish_job(job, result={"changed": ["config.json"]}, error="digest mismatch")
    client.force_login(teammate)

    response = client.get("/environments/")

    verification = _row(response, environment)["target_verification"]
    assert (verification.ok, verification.changed) == (False, ["config.json"])
    assert b"verification failed" in response.content


def test_it_offers_rollback_of_a_healthy_live_release(
    client, teammate, make_live, environment
):
    old = make_live("0.9.0")
    make_live("0.9.5")
    client.force_login(teammate)

    response = client.get("/environments/")

    assert _row(response, environment)["target"].release == old
    assert f"/environments/{environment.pk}/rollback/".encode() in response.content


def test_it_tells_a_member_why_there_is_no_rollback_button(
    client, member, broken, environment
):
    client.force_login(member)

    response = client.get("/environments/")

    assert b"/rollback/" not in response.content
    assert b"needs role approver or admin in team acme, has member" in response.content


def test_it_renders_the_live_fragment(client, teammate, broken):
    client.force_login(teammate)

    response = client.get("/environments/rows/")

    assert response.status_code == 200
    assert b"<html" not in response.content
    assert b"failed_verification" in response.content


def test_it_shows_outsiders_no_environment(client, outsider, broken, environment):
    client.force_login(outsider)

    for url in ("/environments/", "/environments/rows/"):
        response = client.get(url)
        assert response.context["rows"] == []
        assert str(environment).encode() not in response.content
