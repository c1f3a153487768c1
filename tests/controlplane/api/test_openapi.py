from openapi_spec_validator import validate

from controlplane.accounts.models import API_SCOPES
from tests.controlplane.api.helpers import api_operations, concrete_path

URL = "/api/v1/openapi.json"


def test_it_serves_a_valid_openapi_3_document(client, db):
    response = client.get(URL)

    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.")
    validate(document)  # raises on any violation of the OpenAPI 3 schema


def test_it_lists_every_registered_operation(client, db):
    document = client.get(URL).json()
    documented = {
        (path, method.upper())
        for path, item in document["paths"].items()
        for method in item
        if method in ("get", "post", "put", "patch", "delete")
    }

    registered = api_operations(client)

    assert registered  # the resolver walk found the API at all
    assert documented == registered


def test_it_documents_auth_and_error_bodies_on_every_operation(client, db):
    document = client.get(URL).json()
    assert document["components"]["securitySchemes"]["ApiTokenAuth"] == {
        "type": "http",
        "scheme": "bearer",
    }
    for path, item in document["paths"].items():
        for method, operation in item.items():
            assert operation["security"], (method, path)
            for status in ("401", "403", "422"):
                content = operation["responses"][status]["content"]
                ref = content["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorOut"), (method, path, status)


def test_it_serves_browsable_docs_with_local_assets(client, db):
    response = client.get("/api/v1/docs")

    assert response.status_code == 200
    page = response.content.decode()
    assert "/api/v1/openapi.json" in page
    assert "swagger-ui-bundle.js" in page
    assert "cdn.jsdelivr" not in page  # no network needed to read the docs


def test_it_states_each_operations_scope_as_the_server_enforces_it(
    client, make_token, owner
):
    document = client.get(URL).json()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            scope = operation["x-required-scope"]
            assert scope in API_SCOPES, (method, path)
            assert {"ApiTokenAuth": [scope]} in operation["security"]
            assert f"`{scope}` scope" in operation["description"]
            others = [s for s in API_SCOPES if s != scope]
            token = make_token(owner, *others)

            response = client.generic(
                method.upper(),
                concrete_path(path),
                "{}",
                "application/json",
                headers={"Authorization": f"Bearer {token}"},
            )

            assert response.status_code == 403, (method, path, response.content)
            assert response.json()["error"]["scope"] == scope
