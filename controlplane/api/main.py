"""The NinjaAPI object: routers, auth and error handlers in one place.

Mounted at /api/v1/ by `controlplane.api.urls`; OpenAPI 3 at /api/v1/openapi.json,
Swagger UI at /api/v1/docs (assets served locally: "ninja" is an installed app).
"""

from ninja import NinjaAPI

from controlplane.api import (
    audit,
    deployments,
    environments,
    gate_policy,
    model_families,
    releases,
    webhooks,
)
from controlplane.api.errors import install_error_handlers

api = NinjaAPI(
    title="releasegate",
    version="1",
    description="Release registration, promotion, approval and rollback for CI. "
    "Authenticate with `Authorization: Bearer <token>` (create one with "
    "`manage.py create_api_token`); each operation names the scope it needs. Every "
    'error body is `{"error": {"code", "message", ...}}`.',
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
    webhooks,
    deployments,
    audit,
):
    api.add_router("", module.router)
