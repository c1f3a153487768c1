from django.http import HttpRequest
from ninja import Query, Router, Status

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    ModelFamilyIn,
    ModelFamilyOut,
    Page,
    PageParams,
)
from controlplane.api.scoping import model_families, page, principal_of
from controlplane.releases.actions.registration import do_create_model_family

router = Router(tags=["models"])


@router.post(
    "/models",
    auth=token_auth("register"),
    response={201: ModelFamilyOut, **WRITE_ERRORS},
    summary="Create a model family in the token's team",
)
def create_model(request: HttpRequest, payload: ModelFamilyIn) -> Status:
    principal = principal_of(request)
    family = do_create_model_family(
        principal.token.team,
        payload.name,
        actor=principal.token,
        description=payload.description,
    )
    return Status(201, family.to_dict())


@router.get(
    "/models",
    auth=read_auth(),
    response={200: Page[ModelFamilyOut], **READ_ERRORS},
    summary="List the team's model families",
)
def list_models(request: HttpRequest, params: Query[PageParams]) -> dict:
    return page(model_families(principal_of(request)), params)
