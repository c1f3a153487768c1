"""The NinjaAPI object: routers, auth and error handlers in one place.

Mounted at /api/v1/ by `controlplane.api.urls`; OpenAPI 3 at /api/v1/openapi.json,
Swagger UI at /api/v1/docs (assets served locally: "ninja" is an installed app).
"""

from ninja import NinjaAPI

from controlplane.api import (
    agents,
    audit,
    costs,
    deployments,
    environments,
    gate_policy,
    load_plans,
    model_families,
    releases,
    serving_backend,
    sizing,
    teams,
    tokens,
    webhooks,
)
from controlplane.api.auth import ApiTokenAuth
from controlplane.api.errors import install_error_handlers


class ReleasegateAPI(NinjaAPI):
    """States each operation's required token scope in the OpenAPI document: in its
    security requirement (OpenAPI 3.1 lets a non-OAuth scheme list role names
    there), as `x-required-scope`, and in its description."""

    def get_openapi_schema(self, **kwargs):
        document = super().get_openapi_schema(**kwargs)
        scopes = {
            self.get_openapi_operation_id(operation): auth.scope
            for _, router in self._routers
            for path_view in router.path_operations.values()
            for operation in path_view.operations
            for auth in operation.auth_callbacks
            if isinstance(auth, ApiTokenAuth)
        }
        for item in document["paths"].values():
            for operation in item.values():
                scope = scopes[operation["operationId"]]
                operation["x-required-scope"] = scope
                for requirement in operation["security"]:
                    if "ApiTokenAuth" in requirement:
                        requirement["ApiTokenAuth"] = [scope]
                note = f"Requires a token with the `{scope}` scope."
                if any("DashboardSessionAuth" in r for r in operation["security"]):
                    note += " A logged-in dashboard session may read too."
                operation["description"] = (
                    f"{operation.get('description', '')}\n\n{note}".strip()
                )
        return document


api = ReleasegateAPI(
    title="releasegate",
    version="1",
    description="Release registration, promotion, approval and rollback for CI. "
    "Authenticate with `Authorization: Bearer <token>`: make one on the "
    "dashboard's Tokens page (/tokens/), or `POST /tokens` with an admin token, or "
    "`manage.py create_api_token` on the server; each operation names the scope it "
    'needs. Every error body is `{"error": {"code", "message", ...}}`.',
    urls_namespace="api-v1",
    openapi_url="/openapi.json",
    docs_url="/docs",
)
install_error_handlers(api)

for module in (
    model_families,
    releases,
    environments,
    gate_policy,
    costs,
    load_plans,
    serving_backend,
    sizing,
    webhooks,
    deployments,
    audit,
    teams,
    tokens,
    agents,
):
    api.add_router("", module.router)
