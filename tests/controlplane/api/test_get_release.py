from django.utils import timezone

from controlplane.fleet.models import Deployment
from controlplane.releases.actions.gate_results import do_record_gate_result
from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.models import Approval
from tests.controlplane.api.helpers import DIGEST, error_of, field_names
from tests.controlplane.dashboard.builders import compress_result


def url(release_id) -> str:
    return f"/api/v1/releases/{release_id}"


def reverified(release, times: int, *, last_error: str = "") -> list:
    """`times` re-verifications of the release's live copy, as the agent answered
    them: all matched, but the last fails with `last_error` when given."""
    jobs = []
    for n in range(times):
        job = do_start_job(release, "reverify")
        error = last_error if n == times - 1 else ""
        jobs.append(do_finish_job(job, result={"ok": not error}, error=error))
    return jobs


def test_it_shows_a_release_with_jobs_gates_approvals_and_deployments(
    api, owner_token, teammate, environment, make_release
):
    release = make_release("3.0.0", state="live", manifest_digest=DIGEST)
    do_start_job(release, "verify_source")
    do_record_gate_result(
        release,
        gate="quality",
        metric="kld_mean",
        observed=0.01,
        threshold=0.03,
        outcome="pass",
    )
    Approval.objects.create(
        release=release, user=teammate, decision="approve", manifest_digest=DIGEST
    )
    Deployment.objects.create(
        release=release, environment=environment, state="live", started=timezone.now()
    )

    response = api.get(url(release.pk), token=owner_token)

    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["id"], data["state"], data["version"]) == (release.pk, "live", "3.0.0")
    assert data["manifest_digest"] == DIGEST
    assert [j["kind"] for j in data["jobs"]] == ["verify_source"]
    assert data["jobs"][0]["state"] == "running"
    assert [(g["gate"], g["outcome"]) for g in data["gate_results"]] == [
        ("quality", "pass")
    ]
    assert [(a["user"], a["decision"]) for a in data["approvals"]] == [
        ("bob", "approve")
    ]
    assert [(d["environment"], d["state"]) for d in data["deployments"]] == [
        ("staging", "live")
    ]


def test_it_lets_a_dashboard_user_read(client, teammate, release):
    client.force_login(teammate)

    response = client.get(url(release.pk))

    assert response.status_code == 200, response.content
    assert response.json()["id"] == release.pk


def test_it_needs_credentials(api, release):
    error_of(api.get(url(release.pk)), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, release):
    error_of(api.get(url(release.pk), token="rg_not-a-token"), 401, "not_authenticated")


def test_it_needs_the_read_scope(api, make_token, owner, release):
    token = make_token(owner, "register", "promote")

    error = error_of(api.get(url(release.pk), token=token), 403, "missing_scope")

    assert error["scope"] == "read"


def test_it_hides_the_release_from_an_outsider(api, outsider_token, release):
    error_of(api.get(url(release.pk), token=outsider_token), 404, "not_found")


def test_it_hides_the_release_from_an_outsider_session(client, outsider, release):
    client.force_login(outsider)

    error_of(client.get(url(release.pk)), 404, "not_found")


def test_it_answers_404_for_a_missing_release(api, owner_token, release):
    error_of(api.get(url(release.pk + 1000), token=owner_token), 404, "not_found")


def test_it_names_a_bad_id(api, owner_token):
    error = error_of(api.get(url("abc"), token=owner_token), 422, "validation_error")

    assert field_names(error) == {"release_id"}
    assert error["fields"][0]["location"] == "path"


def test_it_counts_the_re_verifications_instead_of_listing_them(
    api, owner_token, make_release
):
    release = make_release("3.0.0", state="live", manifest_digest=DIGEST)
    do_start_job(release, "verify_source")
    *_, last = reverified(release, 5, last_error="changed: config.json")

    data = api.get(url(release.pk), token=owner_token).json()

    assert [j["kind"] for j in data["jobs"]] == ["verify_source"]
    assert [s["kind"] for s in data["timings"]["stages"]] == ["verify_source"]
    summary = data["reverification"]
    assert summary["count"] == 5
    assert (summary["newest"]["id"], summary["newest"]["state"]) == (last.pk, "failed")
    assert summary["history_url"].endswith(
        f"/api/v1/releases/{release.pk}/reverifications"
    )


def test_it_shows_a_moe_releases_parameters_and_rtn_fallbacks(
    api, owner_token, make_release
):
    release = make_release("3.0.0")
    made = compress_result(
        release,
        parameters=(1_140_000, 420_000),
        fallbacks=((2, 5, 3),),
        min_expert_tokens=16,
    )
    do_finish_job(
        do_start_job(release, "compress"), result=made.model_dump(mode="json")
    )

    data = api.get(url(release.pk), token=owner_token).json()

    assert data["compression"] == {
        "weights": made.weights,
        "kv_cache_dtype": made.kv_cache_dtype,
        "head": None,
        "size_bytes": made.size_bytes,
        "source_size_bytes": made.source_size_bytes,
        "total_parameters": 1_140_000,
        "active_parameters": 420_000,
        "min_expert_tokens": 16,
        "rtn_fallback_experts": [{"layer": 2, "expert": 5, "tokens": 3}],
    }
    assert data["compression_problem"] is None


def test_it_shows_the_recipes_head_in_the_recipe_and_the_compression(
    api, owner_token, make_release
):
    recipe = {"weights": "w4a16-g128", "kv_cache_dtype": "int8", "head": "int8"}
    release = make_release("3.0.0", recipe=recipe)
    made = compress_result(release)
    do_finish_job(
        do_start_job(release, "compress"), result=made.model_dump(mode="json")
    )

    data = api.get(url(release.pk), token=owner_token).json()

    assert data["recipe"] == recipe
    assert data["compression"]["head"] == "int8"


def test_it_says_no_compression_yet_or_why_it_is_unreadable(
    api, owner_token, make_release
):
    release = make_release("3.0.0")
    assert api.get(url(release.pk), token=owner_token).json()["compression"] is None

    job = do_finish_job(do_start_job(release, "compress"), result={"candidate": 3})

    data = api.get(url(release.pk), token=owner_token).json()
    assert data["compression"] is None
    assert data["compression_problem"].startswith(
        f"compress job {job.pk} recorded an unreadable report"
    )
