import csv
import io

from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.models import ModelFamily
from tests.controlplane.dashboard.builders import load_test_report


def _csv(response) -> list[dict]:
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_it_shows_the_load_test_as_money_per_release_and_workload(
    client, owner, awaiting, make_release
):
    release = awaiting("1.0.0", speed=1.3)
    make_release("2.0.0")  # no load test: no rows
    report = load_test_report(release.recipe, speed=1.3)
    client.force_login(owner)

    response = client.get("/cost/")

    rows = response.context["rows"]
    assert [(r["release"], r["workload"]) for r in rows] == [
        (str(release), w.profile) for w in report.workloads
    ]
    for row, workload in zip(rows, report.workloads, strict=True):
        assert row["cost_per_1m_output_tokens"] == workload.cost_per_1m_output_tokens
        assert row["requests_per_gpu_hour"] == workload.requests_per_gpu_hour
    assert response.context["charts"]["cost"]["data"][0]["name"] == str(release)


def test_it_exports_the_same_rows_as_csv(client, owner, awaiting):
    release = awaiting("1.0.0")
    client.force_login(owner)

    page = client.get("/cost/").context["rows"]
    response = client.get("/cost.csv")

    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert "attachment" in response["Content-Disposition"]
    rows = _csv(response)
    assert [r["workload"] for r in rows] == [r["workload"] for r in page]
    assert rows[0]["release"] == str(release)
    assert (
        float(rows[0]["cost_per_1m_output_tokens"])
        == (page[0]["cost_per_1m_output_tokens"])
    )


def test_it_filters_the_csv_like_the_page(client, owner, awaiting, make_model_family):
    awaiting("1.0.0")
    other = make_model_family("glm-search")
    client.force_login(owner)

    response = client.get(f"/cost.csv?model={other.pk}")

    assert _csv(response) == []


def test_it_defuses_spreadsheet_formulas_in_names(client, owner, awaiting):
    release = awaiting("1.0.0")
    ModelFamily.objects.filter(pk=release.model_id).update(name="=HYPERLINK(1)")
    client.force_login(owner)

    rows = _csv(client.get("/cost.csv"))

    assert rows[0]["release"] == "'=HYPERLINK(1)@1.0.0"


def test_it_refuses_a_csv_built_on_an_unreadable_report(client, owner, release):
    job = do_start_job(release, "load_test")
    do_finish_job(job, result={"workloads": "garbage"})
    client.force_login(owner)

    response = client.get("/cost.csv")
    page = client.get("/cost/")

    assert response.status_code == 409
    assert f"load_test job {job.pk} recorded an unreadable report".encode() in (
        response.content
    )
    assert b"recorded an unreadable report" in page.content


def test_it_refuses_a_bad_filter(client, owner, awaiting):
    awaiting("1.0.0")
    client.force_login(owner)

    assert client.get("/cost/?state=nope").status_code == 400
    assert client.get("/cost.csv?environment=999999").status_code == 400


def test_it_shows_outsiders_no_cost(client, outsider, awaiting):
    release = awaiting("1.0.0")
    client.force_login(outsider)

    assert client.get("/cost/").context["rows"] == []
    assert _csv(client.get("/cost.csv")) == []
    assert str(release).encode() not in client.get("/cost.csv").content
