"""Bad input is the client's fault: every operation answers it with a 4xx in the one
error format, never a 500. Operations come from the URL resolver."""

import re

import pytest

from controlplane.accounts.models import API_SCOPES
from tests.controlplane.api.helpers import api_operations, error_of, field_names

BAD_BODIES = [
    "{not json",
    "[]",
    '"a string"',
    "null",
    "12",
    '{"model": {"nested": []}, "version": 7, "recipe": "int4"}',
    '{"manifest_digest": null, "comment": ["x"], "name": "' + "x" * 10_000 + '"}',
    "\ufeff{}",
    # PostgreSQL text can't hold NUL: must be refused before it reaches the database.
    '{"name": "a", "description": "\\u0000", "comment": "\\u0000", '
    '"manifest_digest": "\\u0000", "source_uri": "\\u0000"}',
]
BAD_IDS = ["0", "-1", "99999999999999999999999", "1e3", "%00"]
BAD_QUERIES = [
    {"limit": "many"},
    {"offset": "-3"},
    {"offset": "99999999999999999999999"},
    {"state": "nonsense", "since": "then", "release": "99999999999999999999999"},
    {"model": "%00", "environment": "%00", "verb": "%00", "actor": "%00"},
]


@pytest.fixture
def admin_token(make_token, owner) -> str:
    return make_token(owner, *API_SCOPES)


@pytest.fixture
def operations(client, db) -> set[tuple[str, str]]:
    return api_operations(client)


def send(client, method, path, token, body="", query=None):
    return client.generic(
        method,
        path,
        body,
        "application/json",
        headers={"Authorization": f"Bearer {token}"},
        QUERY_STRING="&".join(f"{k}={v}" for k, v in (query or {}).items()),
    )


def assert_client_error(response, what) -> None:
    assert 400 <= response.status_code < 500, (what, response.status_code)
    assert "error" in response.json(), what


def test_it_answers_bad_bodies_with_4xx(client, admin_token, release, operations):
    document = client.get("/api/v1/openapi.json").json()
    with_body = {
        (path, method.upper())
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if "requestBody" in operation
    }
    assert with_body  # (promote and rollback take none and ignore one)
    for path, method in operations & with_body:
        concrete = re.sub(r"\{\w+\}", str(release.pk), path)
        for body in BAD_BODIES:
            response = send(client, method, concrete, admin_token, body)
            assert_client_error(response, (method, path, body[:20]))


def test_it_answers_bad_ids_with_4xx(client, admin_token, operations):
    for path, method in operations:
        if "{" not in path:
            continue
        for bad in BAD_IDS:
            concrete = re.sub(r"\{\w+\}", bad, path)
            response = send(client, method, concrete, admin_token, "{}")
            assert_client_error(response, (method, concrete))


def test_it_never_fails_on_bad_queries(client, admin_token, operations):
    rejected = 0
    for path, method in operations:
        if method != "GET" or "{" in path:
            continue
        for query in BAD_QUERIES:
            response = send(client, method, path, admin_token, query=query)
            # A parameter an endpoint does not take is ignored (200); one it takes
            # with a bad value is a 4xx.
            assert response.status_code < 500, (path, query)
            if response.status_code >= 400:
                assert_client_error(response, (path, query))
                rejected += 1
    assert rejected >= 10  # limit/offset everywhere, plus the filters


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/models",
        "/api/v1/releases",
        "/api/v1/environments",
        "/api/v1/deployments",
        "/api/v1/audit-events",
    ],
)
def test_it_names_an_out_of_range_offset(api, admin_token, path):
    response = api.get(path, token=admin_token, offset=str(2**63))

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"offset"}


def test_it_answers_a_body_over_the_upload_limit_with_413(api, admin_token, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = {"name": "big", "description": "x" * 2000}

    response = api.post("/api/v1/models", body, token=admin_token)

    error_of(response, 413, "request_too_large")


def test_it_answers_too_many_query_fields_with_400(api, admin_token, settings):
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 10
    params = {f"x{i}": "1" for i in range(20)}

    response = api.get("/api/v1/releases", token=admin_token, **params)

    error_of(response, 400, "bad_request")


def test_it_names_an_out_of_range_id(api, admin_token):
    response = api.get("/api/v1/releases/99999999999999999999999", token=admin_token)

    error = error_of(response, 422, "validation_error")
    assert error["fields"][0]["field"] == "release_id"


def test_it_names_a_query_parameter_given_twice(api, admin_token):
    response = api.client.get(
        "/api/v1/releases?state=live&state=failed&limit=5",
        headers={"Authorization": f"Bearer {admin_token}"},
    )

    error = error_of(response, 422, "validation_error")
    assert field_names(error) == {"state"}


def test_it_documents_and_refuses_nul_in_strings(client, api, admin_token, release):
    document = client.get("/api/v1/openapi.json").json()
    description = document["components"]["schemas"]["ModelFamilyIn"]["properties"][
        "description"
    ]
    assert re.fullmatch(description["pattern"], "fine")
    assert not re.fullmatch(description["pattern"], "a\x00b")

    response = api.post(
        "/api/v1/models", {"name": "m", "description": "a\x00b"}, token=admin_token
    )

    assert field_names(error_of(response, 422, "validation_error")) == {"description"}
