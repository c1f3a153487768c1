from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from ninja import Query, Router, Status

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.errors import ApiError
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    ApproveIn,
    DecisionOut,
    JobOut,
    ObjectId,
    Page,
    PageParams,
    PromotionOut,
    RejectIn,
    ReleaseDetailOut,
    ReleaseFilters,
    ReleaseIn,
    ReleaseOut,
    RemeasureIn,
    ReopenIn,
)
from controlplane.api.scoping import (
    environments,
    get_release,
    model_families,
    page,
    principal_of,
    releases,
)
from controlplane.releases import evidence, pipeline
from controlplane.releases.actions.approvals import (
    do_approve_release,
    do_reject_release,
)
from controlplane.releases.actions.promotion import (
    do_reopen_release,
    do_request_promotion,
)
from controlplane.releases.actions.registration import do_register_release
from controlplane.releases.models import AFTER_DEPLOY_JOB_KINDS, Release
from controlplane.releases.timings import stage_timings

router = Router(tags=["releases"])


def unknown_reference(field: str, message: str) -> ApiError:
    """A 422 for a body field that names something the team does not have."""
    return ApiError(
        422,
        "validation_error",
        f"invalid input: {field}",
        fields=[
            {
                "field": field,
                "message": message,
                "type": "not_found",
                "location": "body",
            }
        ],
    )


def release_url(request: HttpRequest, release_id: int) -> str:
    return request.build_absolute_uri(
        reverse("api-v1:release-detail", kwargs={"release_id": release_id})
    )


@router.post(
    "/releases",
    auth=token_auth("register"),
    response={200: ReleaseOut, 201: ReleaseOut, **WRITE_ERRORS},
    summary="Register a release (idempotent)",
    description="201 with a new release; 200 with the existing one when the same "
    "model+version was registered with the same body; 409 when with a different body.",
)
def register_release(
    request: HttpRequest, payload: ReleaseIn, response: HttpResponse
) -> Status:
    principal = principal_of(request)
    family = model_families(principal).filter(name=payload.model).first()
    if family is None:
        raise unknown_reference("model", f"no model family named {payload.model!r}")
    environment = (
        environments(principal).filter(name=payload.target_environment).first()
    )
    if environment is None:
        raise unknown_reference(
            "target_environment",
            f"no environment named {payload.target_environment!r}",
        )
    parent = None
    if payload.parent is not None:
        parent = releases(principal).filter(pk=payload.parent).first()
        if parent is None:
            raise unknown_reference("parent", f"no release with id {payload.parent}")
    release, created = do_register_release(
        family,
        version=payload.version,
        source_uri=payload.source_uri,
        recipe=payload.recipe.model_dump(),
        target_environment=environment,
        actor=principal.token,
        parent=parent,
    )
    response["Location"] = release_url(request, release.pk)
    return Status(201 if created else 200, release.to_dict())


@router.get(
    "/releases",
    auth=read_auth(),
    response={200: Page[ReleaseOut], **READ_ERRORS},
    summary="List releases (filters: model, version, state, environment)",
)
def list_releases(request: HttpRequest, filters: Query[ReleaseFilters]) -> dict:
    queryset = releases(principal_of(request))
    if filters.model is not None:
        queryset = queryset.filter(model__name=filters.model)
    if filters.version is not None:
        queryset = queryset.filter(version=filters.version)
    if filters.state is not None:
        queryset = queryset.filter(state=filters.state)
    if filters.environment is not None:
        queryset = queryset.filter(target_environment__name=filters.environment)
    return page(queryset, filters)


@router.get(
    "/releases/{release_id}",
    auth=read_auth(),
    response={200: ReleaseDetailOut, **READ_ERRORS},
    url_name="release-detail",
    summary="A release with its jobs, gate results, approvals and deployments",
)
def get_release_detail(request: HttpRequest, release_id: ObjectId) -> dict:
    release = get_release(principal_of(request), release_id, detail=True)
    return release_detail_dict(request, release)


def release_detail_dict(request: HttpRequest, release: Release) -> dict:
    """The release with its relations (`to_dict(detail=True)`) and what is derived
    from them: the compress job's report, the stage timings, and its
    re-verifications counted."""
    history_url = request.build_absolute_uri(
        reverse("api-v1:release-reverifications", kwargs={"release_id": release.pk})
    )
    compression, problem = None, None
    try:
        made = evidence.compress_report(release)
    except evidence.EvidenceUnreadable as exc:
        problem = exc.message
    else:
        if made is not None:
            compression = {
                "weights": made.weights,
                "kv_cache_dtype": made.kv_cache_dtype,
                "head": made.report.recipe.head,
                "size_bytes": made.size_bytes,
                "source_size_bytes": made.source_size_bytes,
                "total_parameters": made.report.total_parameters,
                "active_parameters": made.report.active_parameters,
                "min_expert_tokens": made.report.min_expert_tokens,
                "rtn_fallback_experts": [
                    f.model_dump() for f in made.report.rtn_fallback_experts
                ],
            }
    return {
        **release.to_dict(detail=True),
        "compression": compression,
        "compression_problem": problem,
        "timings": stage_timings(release),
        "reverification": {
            **evidence.reverifications(release).to_dict(),
            "history_url": history_url,
        },
    }


@router.get(
    "/releases/{release_id}/reverifications",
    auth=read_auth(),
    response={200: Page[JobOut], **READ_ERRORS},
    url_name="release-reverifications",
    summary="The periodic re-verifications of a release's live copy, newest first",
)
def list_reverifications(
    request: HttpRequest, release_id: ObjectId, params: Query[PageParams]
) -> dict:
    release = get_release(principal_of(request), release_id)
    jobs = release.jobs.filter(kind__in=AFTER_DEPLOY_JOB_KINDS).select_related("agent")
    return page(jobs.order_by("-created", "-id"), params)


@router.post(
    "/releases/{release_id}/promote",
    auth=token_auth("promote"),
    response={202: PromotionOut, **WRITE_ERRORS},
    summary="Start the promotion pipeline",
    description="Queues the pipeline once the request commits; poll `status_url` "
    "(also in the Location header) for the release's state, jobs and gate results. "
    "A failed release is retried; an approved or deploying one has its deployment "
    "queued again (409 in any other state).",
)
def promote_release(
    request: HttpRequest, release_id: ObjectId, response: HttpResponse
) -> Status:
    principal = principal_of(request)
    release = get_release(principal, release_id)
    release = do_request_promotion(release, principal.token)
    status_url = release_url(request, release.pk)
    response["Location"] = status_url
    return Status(202, {"release": release.to_dict(), "status_url": status_url})


@router.post(
    "/releases/{release_id}/approve",
    auth=token_auth("approve"),
    response={200: DecisionOut, **WRITE_ERRORS},
    summary="Approve a release awaiting approval (approver role)",
    description="The approval is bound to `manifest_digest`, which must be the "
    "release's current digest (else 409). The user or token that registered the "
    "release cannot approve it (403).",
)
def approve_release(
    request: HttpRequest, release_id: ObjectId, payload: ApproveIn
) -> dict:
    principal = principal_of(request)
    release = get_release(principal, release_id)
    approval = do_approve_release(
        release,
        principal.user,
        token=principal.token,
        comment=payload.comment,
        manifest_digest=payload.manifest_digest,
    )
    return {"release": release.to_dict(), "approval": approval.to_dict()}


@router.post(
    "/releases/{release_id}/reject",
    auth=token_auth("approve"),
    response={200: DecisionOut, **WRITE_ERRORS},
    summary="Reject a release (approver role)",
    description="With `manifest_digest`, the rejection is of that manifest: 409 when "
    "the release's digest is another by then. The user or token that registered the "
    "release cannot reject it (403).",
)
def reject_release(
    request: HttpRequest, release_id: ObjectId, payload: RejectIn
) -> dict:
    principal = principal_of(request)
    release = get_release(principal, release_id)
    approval = do_reject_release(
        release,
        principal.user,
        token=principal.token,
        comment=payload.comment,
        manifest_digest=payload.manifest_digest,
    )
    return {"release": release.to_dict(), "approval": approval.to_dict()}


@router.post(
    "/releases/{release_id}/reopen",
    auth=token_auth("promote"),
    response={200: PromotionOut, **WRITE_ERRORS},
    summary="Reopen a rejected or failed release for another pass",
    description="Moves it back to registered (409 in any other state; a "
    "quarantined release needs a new version). Then promote it: the whole "
    "pipeline runs again and the result needs a new approval. Registering the "
    "same body again only returns the release as it is (registration is "
    "idempotent); a changed body needs a new version.",
)
def reopen_release(
    request: HttpRequest, release_id: ObjectId, payload: ReopenIn
) -> dict:
    principal = principal_of(request)
    release = get_release(principal, release_id)
    release = do_reopen_release(release, principal.token, reason=payload.reason)
    status_url = release_url(request, release.pk)
    return {"release": release.to_dict(), "status_url": status_url}


@router.post(
    "/releases/{release_id}/remeasure",
    auth=token_auth("promote"),
    response={202: PromotionOut, **WRITE_ERRORS},
    summary="Re-run a judged release's evaluate and/or load test, then its gate",
    description="For a release whose gate was inconclusive (gated), that awaits "
    "approval, or that its gate failed: the stages named run again (the load "
    "test under the environment's load plan in force) and the gate judges the "
    "new evidence; poll `status_url`. 409 in any other state or while a "
    "re-measure runs. Audited (`release.remeasure_requested`).",
)
def remeasure_release(
    request: HttpRequest,
    release_id: ObjectId,
    payload: RemeasureIn,
    response: HttpResponse,
) -> Status:
    principal = principal_of(request)
    release = get_release(principal, release_id)
    release = pipeline.remeasure(release, payload.stages, principal.token)
    status_url = release_url(request, release.pk)
    response["Location"] = status_url
    return Status(202, {"release": release.to_dict(), "status_url": status_url})
