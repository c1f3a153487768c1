from controlplane.audit.actions import chain_pending
from tests.controlplane.api.helpers import error_of, field_names

URL = "/api/v1/audit-events"


def verbs(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [e["verb"] for e in response.json()["items"]]


def test_it_reads_the_teams_audit_log_newest_first(api, owner_token, release):
    api.post(f"/api/v1/releases/{release.pk}/promote", token=owner_token)
    chain_pending()  # what the commits would (the test's transaction never commits)

    response = api.get(URL, token=owner_token)

    found = verbs(response)
    assert found.index("release.promotion_requested") < found.index(
        "release.registered"
    )
    promoted = response.json()["items"][0]
    assert promoted["verb"] == "release.promotion_requested"
    assert promoted["actor"].startswith("token:")
    assert promoted["object_type"] == "release"
    assert promoted["object_id"] == str(release.pk)
    # Each event's link in the hash chain, to pin or check outside.
    registered = response.json()["items"][1]
    assert promoted["prev_hash"] == registered["hash"]
    assert promoted["seq"] == registered["seq"] + 1
    assert len(promoted["hash"]) == 64


def test_it_filters(api, owner_token, release, make_release):
    other = make_release("5.0.0")

    by_verb = api.get(URL, token=owner_token, verb="release.registered")
    assert set(verbs(by_verb)) == {"release.registered"}
    assert by_verb.json()["count"] == 2
    by_object = api.get(
        URL, token=owner_token, object_type="release", object_id=str(other.pk)
    )
    assert [e["object_id"] for e in by_object.json()["items"]] == [str(other.pk)]
    assert verbs(api.get(URL, token=owner_token, actor="nobody-like-this")) == []
    assert verbs(api.get(URL, token=owner_token, since="2999-01-01T00:00:00Z")) == []


def test_it_paginates(api, owner_token, release, make_release):
    make_release("5.0.0")

    response = api.get(URL, token=owner_token, limit=1)

    assert len(verbs(response)) == 1
    assert response.json()["count"] >= 2


def test_it_shows_an_outsider_nothing_of_the_team(api, outsider_token, release):
    response = api.get(URL, token=outsider_token)

    assert all(e["team"] == "other" for e in response.json()["items"])
    assert "release.registered" not in verbs(response)


def test_it_names_a_bad_or_naive_timestamp(api, owner_token):
    response = api.get(
        URL, token=owner_token, since="yesterday", until="2026-01-01T00:00:00"
    )

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"since", "until"}


def test_it_takes_only_an_iso_date_time_not_a_number_of_seconds(api, owner_token):
    for value in ("0.5", "1700000000"):
        response = api.get(URL, token=owner_token, since=value, until=value)

        error = error_of(response, 422, "validation_error")
        assert field_names(error) == {"since", "until"}, value
        assert "ISO 8601" in error["fields"][0]["message"]


def test_it_takes_a_page_size_only_in_decimal_digits(api, owner_token):
    for value in ("5.0", " 5", "5_0"):
        response = api.get(URL, token=owner_token, limit=value, offset=value)

        error = error_of(response, 422, "validation_error")
        assert field_names(error) == {"limit", "offset"}, value


def test_it_needs_credentials(api, db):
    error_of(api.get(URL), 401, "not_authenticated")


def test_it_rejects_a_bad_token(api, db):
    error_of(api.get(URL, token="rg_nope"), 401, "not_authenticated")


def test_it_needs_the_read_scope(api, make_token, owner):
    response = api.get(URL, token=make_token(owner, "approve"))

    assert error_of(response, 403, "missing_scope")["scope"] == "read"


def test_it_takes_any_valid_offset_even_beyond_what_postgresql_stores(
    api, owner_token, release
):
    # PostgreSQL refuses a -16:00 displacement; the filter is converted to UTC first.
    response = api.get(URL, token=owner_token, until="2000-01-10T08:22:25-16:00")

    assert verbs(response) == []


def test_it_clamps_a_time_that_leaves_the_calendar_in_utc(api, owner_token, release):
    # Valid as written, but year 0 once converted to UTC.
    response = api.get(URL, token=owner_token, since="0001-01-01T00:00:00+14:00")

    assert "release.registered" in verbs(response)
    later = api.get(URL, token=owner_token, until="9999-12-31T23:59:59-14:00")
    assert "release.registered" in verbs(later)
