from django.http import HttpRequest, HttpResponse
from ninja import Query, Router, Status

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.releases import release_url
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    EnvironmentIn,
    EnvironmentOut,
    ObjectId,
    Page,
    PageParams,
    RollbackOut,
)
from controlplane.api.scoping import (
    environments,
    get_environment,
    page,
    principal_of,
)
from controlplane.fleet.actions import do_create_environment
from controlplane.fleet.models import Environment
from controlplane.releases.actions.rollbacks import (
    do_rollback_environment,
    previous_verified_deployment,
)
from controlplane.releases.timings import rollback_readiness

router = Router(tags=["environments"])


def environment_dict(environment: Environment) -> dict:
    live = environment.live_deployment
    target = (
        previous_verified_deployment(environment, live.release_id) if live else None
    )
    return {
        **environment.to_dict(),
        "live_release_id": live.release_id if live else None,
        "rollback_target": (
            {"release_id": target.release_id, **rollback_readiness(target)}
            if target
            else None
        ),
    }


@router.get(
    "/environments",
    auth=read_auth(),
    response={200: Page[EnvironmentOut], **READ_ERRORS},
    summary="List the team's environments and what is live in each",
)
def list_environments(request: HttpRequest, params: Query[PageParams]) -> dict:
    return page(environments(principal_of(request)), params, row=environment_dict)


@router.post(
    "/environments",
    auth=token_auth("admin"),
    response={201: EnvironmentOut, **WRITE_ERRORS},
    summary="Create an environment in the token's team (admin role)",
    description="Its gate policy is the default until one is set "
    "(PUT /environments/{id}/gate-policy). A name the team has is a 409.",
)
def create_environment(request: HttpRequest, payload: EnvironmentIn) -> Status:
    principal = principal_of(request)
    environment = do_create_environment(
        principal.token.team, payload.name, actor=principal.token
    )
    return Status(201, environment_dict(environment))


@router.post(
    "/environments/{environment_id}/rollback",
    auth=token_auth("promote"),
    response={202: RollbackOut, **WRITE_ERRORS},
    summary="Roll an environment back to its previous verified release",
    description="Needs the promote scope and the approver or admin role. The release "
    "that is live (or failed verification) is replaced by the newest superseded "
    "release that went live before it; 409 when there is none. `status_url` is the "
    "target release.",
)
def rollback_environment(
    request: HttpRequest, environment_id: ObjectId, response: HttpResponse
) -> Status:
    principal = principal_of(request)
    environment = get_environment(principal, environment_id)
    deployment = do_rollback_environment(environment, principal.token)
    status_url = release_url(request, deployment.release_id)
    response["Location"] = status_url
    body = {
        "environment": environment_dict(environment),
        "deployment": deployment.to_dict(),
        "status_url": status_url,
    }
    return Status(202, body)
