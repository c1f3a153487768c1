"""Assertions shared by the API tests."""

DIGEST = "sha256:" + "ab" * 32
STALE_DIGEST = "sha256:" + "cd" * 32


def error_of(response, status: int, code: str) -> dict:
    """Assert the one error body format and return its `error` object."""
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code, error
    assert error["message"]
    return error


def field_names(error: dict) -> set[str]:
    return {f["field"] for f in error["fields"]}


API_NAMESPACE = "api-v1"
# ninja's own views in the namespace: the schema, the docs page, and the root that
# only exists so reverse() can find the prefix.
NINJA_VIEWS = {"openapi-json", "openapi-view", "api-root"}


def api_routes() -> set[str]:
    """Every operation path under /api/v1/ as Django's URL resolver has it, written
    the OpenAPI way (/api/v1/releases/{release_id})."""
    import re

    from django.urls import URLPattern, URLResolver, get_resolver

    found: set[str] = set()

    def walk(patterns, prefix: str, namespaces: tuple[str, ...]) -> None:
        for entry in patterns:
            route = prefix + str(entry.pattern)
            if isinstance(entry, URLResolver):
                walk(entry.url_patterns, route, (*namespaces, entry.namespace))
            elif (
                isinstance(entry, URLPattern)
                and API_NAMESPACE in namespaces
                and entry.name not in NINJA_VIEWS
            ):
                found.add("/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route))

    walk(get_resolver().url_patterns, "", ())
    return found


def api_operations(client) -> set[tuple[str, str]]:
    """(path, METHOD) for every operation: routes from the resolver, methods from the
    Allow header of the 405 each route gives to an OPTIONS request."""
    operations = set()
    for path in api_routes():
        concrete = path.replace("{", "").replace("}", "")  # any value routes
        response = client.options(concrete)
        assert response.status_code == 405, (path, response.status_code)
        for method in response["Allow"].split(","):
            operations.add((path, method.strip().upper()))
    return operations


def concrete_path(path: str) -> str:
    """Fill every {param} with 1 so the request routes to the operation."""
    import re

    return re.sub(r"\{\w+\}", "1", path)


def put_json(api, path: str, body, token: str):
    """PUT `body` as JSON to `path` with a bearer token."""
    return api.client.put(
        path,
        body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
