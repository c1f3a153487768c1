"""The API against its own OpenAPI document: schemathesis generates requests from
/api/v1/openapi.json, valid and invalid ones, and sends them to the live Django app
(WSGI, in this process, on the test database) with a token holding every scope.
No answer may be a 5xx, and every answer must match the documented status codes,
content type, headers and schema. Bounded: a fixed number of examples per operation
and mode, derandomized so a failure reproduces.

Not run: schemathesis' positive-data-acceptance check (a schema-valid body may still
name a model family that doesn't exist or a folder outside the team's source roots:
a 422 no schema can foresee) and negative-data-rejection (a "wrong type" in a query
string is still a string, often a valid one). The rules a schema can state are
stated (NUL-free strings, the recipe's formats) and refused as stated.

(The schemathesis pytest plugin does not run under pytest 9, so the operations are
walked here, each through its hypothesis strategy.)"""

import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import CHECKS, load_all_checks

from controlplane.accounts.models import API_SCOPES

EXAMPLES_PER_OPERATION = 10
CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "ignored_auth",
)


@pytest.fixture
def api_schema(db):
    # As Django's test client does: a request must not close the test's
    # connection (its transaction holds the fixtures).
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi(
            "/api/v1/openapi.json", get_wsgi_application()
        )
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def full_scope_token(make_token, owner, release) -> str:
    # `release` (with its team's environment and model) gives ids that exist.
    return make_token(owner, *API_SCOPES)


@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode))
def test_it_answers_as_documented(api_schema, full_scope_token, mode):
    headers = {"Authorization": f"Bearer {full_scope_token}"}
    load_all_checks()
    checks = [c for c in CHECKS.get_all() if c.__name__ in CHECK_NAMES]
    assert len(checks) == len(CHECK_NAMES)
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15

    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def answers_as_documented(case) -> None:
            case.call_and_validate(headers=headers, checks=checks)

        answers_as_documented()
