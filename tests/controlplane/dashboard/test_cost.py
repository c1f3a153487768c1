import csv
import io
from decimal import ROUND_HALF_UP, Decimal

from controlplane.releases.actions.jobs import do_finish_job, do_start_job
from controlplane.releases.models import ModelFamily
from tests.controlplane.dashboard.builders import load_test_report, set_price

# Every column finance asked for, money and capacity, in the CSV's header.
MONEY_COLUMNS = {
    "currency",
    "cost_per_1m_output_tokens",
    "cost_per_1m_input_tokens",
    "cost_per_request",
    "requests_per_device_hour",
    "target_requests_per_s",
    "devices_needed",
    "live_devices_needed",
    "device_difference",
    "monthly_cost",
    "monthly_cost_difference",
    "device_hour_cost",
    "price_note",
}


def _csv(response) -> list[dict]:
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def at_slo(workload):
    """The run meeting the default gate policy (p99 TTFT <= 2000 ms, TPOT <= 100
    ms) with the most requests/s."""
    meeting = [
        r for r in workload.runs if r.ttft_ms.p99 <= 2000 and r.tpot_ms.p99 <= 100
    ]
    return max(meeting, key=lambda r: r.request_throughput)


def per_million(hourly: str, per_s: float) -> Decimal:
    cost = Decimal(hourly) / (Decimal(repr(per_s)) * 3600) * 1_000_000
    return cost.quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)


def test_it_prices_each_workload_with_the_environments_cost_model(
    client, owner, awaiting, make_release, environment
):
    set_price(environment, owner, "2.50", note="example price")
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
        run = at_slo(workload)
        assert row["currency"] == "USD"
        assert row["cost_per_1m_output_tokens"] == per_million(
            "2.50", run.output_tokens_per_s
        )
        # Not the agent's own price (the report says 2.5 USD too, at another load).
        assert row["requests_per_s_at_slo"] == run.request_throughput
        assert row["price_note"] == "example price"
    assert b"example price" in response.content
    assert response.context["warnings"] == []
    assert response.context["charts"]["cost"]["data"][0]["name"] == (f"{release} (USD)")


def test_it_warns_at_a_price_of_zero_instead_of_showing_zero_costs(
    client, owner, awaiting, environment
):
    awaiting("1.0.0")
    client.force_login(owner)

    unset = client.get("/cost/")
    set_price(environment, owner, "0")
    zero = client.get("/cost/")

    assert "No device price is set for acme/staging" in unset.content.decode()
    assert "priced at 0.00 USD" in zero.content.decode()
    for response in (unset, zero):
        rows = response.context["rows"]
        assert rows and all(r["cost_per_request"] is None for r in rows)
        assert b"price-warning" in response.content
        assert b"0.000000" not in response.content
        assert "cost" not in response.context["charts"]


def test_it_exports_the_same_rows_as_csv_with_money_and_capacity_columns(
    client, owner, teammate, awaiting, make_live, environment
):
    set_price(environment, owner, "4500", currency="KRW")
    make_live("0.9.0", speed=0.8)
    release = awaiting("1.0.0")
    client.force_login(owner)

    page = client.get("/cost/?targets=chat:20").context["rows"]
    response = client.get("/cost.csv?targets=chat:20")

    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert "attachment" in response["Content-Disposition"]
    header = next(csv.reader(io.StringIO(response.content.decode())))
    assert MONEY_COLUMNS <= set(header)
    rows = _csv(response)
    assert [(r["release"], r["workload"]) for r in rows] == [
        (r["release"], r["workload"]) for r in page
    ]
    mine = next(r for r in rows if r["release"] == str(release))
    shown = next(r for r in page if r["release"] == str(release))
    for key in header:
        assert mine[key] == ("" if shown[key] is None else str(shown[key])), key
    chat = next(
        r for r in rows if r["release"] == str(release) and r["workload"] == "chat"
    )
    assert chat["currency"] == "KRW"
    assert chat["live_release"].endswith("@0.9.0")
    assert int(chat["devices_needed"]) >= 1
    assert int(chat["device_difference"]) == int(chat["devices_needed"]) - int(
        chat["live_devices_needed"]
    )
    assert "." not in chat["monthly_cost"]  # KRW has no minor unit


def test_it_plans_capacity_for_the_traffic_typed_on_the_page(
    client, owner, awaiting, environment
):
    set_price(environment, owner, target_requests_per_s={"chat": 5.0})
    awaiting("1.0.0")
    client.force_login(owner)

    default = client.get("/cost/").context["rows"]
    typed = client.get("/cost/?targets=rag:3").context["rows"]
    bad = client.get("/cost/?targets=rag:-3")

    by_workload = {r["workload"]: r for r in default}
    assert by_workload["chat"]["target_requests_per_s"] == 5.0
    assert by_workload["rag"]["target_requests_per_s"] is None
    by_workload = {r["workload"]: r for r in typed}
    assert by_workload["chat"]["target_requests_per_s"] is None
    assert by_workload["rag"]["target_requests_per_s"] == 3.0
    assert bad.status_code == 400
    assert "the rate must be above 0" in bad.content.decode()


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
    assert client.get("/cost.csv?targets=chat").status_code == 400


def test_it_shows_what_each_releases_verification_cost(
    client, owner, awaiting, environment
):
    set_price(environment, owner, "3600")  # 1 USD per device-second
    release = awaiting("1.0.0")
    client.force_login(owner)

    [costs] = client.get("/cost/").context["releases"]

    seconds = sum(
        job.duration_s
        for job in release.jobs.all()
        if job.kind in ("verify_source", "sign", "verify", "evaluate", "load_test")
    )
    assert costs.verification.seconds == seconds
    assert costs.verification.cost == Decimal(repr(seconds)).quantize(
        Decimal("0.000001"), rounding=ROUND_HALF_UP
    )


def test_it_shows_outsiders_no_cost(client, outsider, awaiting):
    release = awaiting("1.0.0")
    client.force_login(outsider)

    assert client.get("/cost/").context["rows"] == []
    assert _csv(client.get("/cost.csv")) == []
    assert str(release).encode() not in client.get("/cost.csv").content
