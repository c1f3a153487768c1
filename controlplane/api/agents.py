"""Agent enrollment for the platform's operators (staff accounts, admin-scope
token): list the keys waiting, enroll one (its name, pool and capabilities are
the operator's, never what the agent says), reject one, revoke an agent (its
messages refused at once, its jobs sent elsewhere). Compare the fingerprint
(sha256 of the raw public key, hex) with the one the agent logs at start."""

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Router, Schema
from pydantic import Field

from controlplane.api.auth import read_auth, token_auth
from controlplane.api.schemas import (
    READ_ERRORS,
    WRITE_ERRORS,
    ObjectId,
    PathText,
    RequestBody,
)
from controlplane.api.scoping import principal_of
from controlplane.fleet.enrollment import (
    check_operator,
    do_enroll_agent,
    do_reject_enrollment,
)
from controlplane.fleet.models import Agent, EnrollmentRequest
from controlplane.releases.intake import revoke_agent

router = Router(tags=["agents"])


class DeviceOut(Schema):
    index: int = Field(description="CUDA index (CUDA_VISIBLE_DEVICES); 0 on a CPU")
    model: str
    memory_total_bytes: int


class DeviceStateOut(DeviceOut):
    memory_free_bytes: int | None = Field(
        description="as its latest heartbeat reported (null: not reported)"
    )


class EnrollmentOut(Schema):
    id: int
    fingerprint: str = Field(description="sha256 of the raw Ed25519 public key, hex")
    public_key: str
    requested_name: str
    requested_pool: str
    can_sign: bool = Field(description="it presented a release-signing key")
    device: str
    gpu_model: str
    devices: list[DeviceOut] = Field(description="every device it reported")
    state: str
    first_seen: str | None
    last_seen: str | None
    agent: str | None


class EnrollIn(RequestBody):
    name: str | None = Field(None, max_length=100, description="default: requested")
    pool_queue: str | None = Field(None, max_length=100)
    can_sign: bool = False
    allowed_programs: list[str] | None = None
    devices: list[int] | None = Field(
        None,
        description="indices of the devices it may use (default: every one it "
        "reported)",
    )


class EnrolledAgentOut(Schema):
    id: int
    name: str
    queue: str
    pool_queue: str
    enrollment: str
    fingerprint: str
    can_sign: bool
    allowed_programs: list[str] | None
    enrolled_devices: list[DeviceOut]
    devices: list[DeviceStateOut] = Field(
        description="the enrolled devices' state in its latest heartbeat"
    )
    devices_outside_enrollment: list[int] = Field(
        description="devices a heartbeat named that the enrollment does not hold "
        "(never used)"
    )
    state: str
    enrolled_at: str | None


@router.get(
    "/agents/enrollments",
    auth=read_auth(),
    response={200: list[EnrollmentOut], **READ_ERRORS},
    summary="Agent keys waiting for enrollment (staff; others see none)",
)
def list_enrollments(request: HttpRequest) -> list[dict]:
    user = principal_of(request).user
    if not (user.is_staff or user.is_superuser):
        return []  # the fleet's enrollment is the operators' business
    pending = EnrollmentRequest.objects.filter(state="pending").select_related("agent")
    return [r.to_dict() for r in pending]


@router.post(
    "/agents/enrollments/{enrollment_id}/enroll",
    auth=token_auth("admin"),
    response={200: EnrolledAgentOut, **WRITE_ERRORS},
    summary="Enroll a pending agent key (staff)",
    description="The agent is `name` (default: the name it asked for) from now on, "
    "takes jobs from `pool_queue`, may sign only with `can_sign` (and a signing "
    "key it presented), may start only `allowed_programs` (preset names or "
    "command templates, each a whole argument shape: deploys of an external "
    "backend go only to an agent allowed to start its command; `[]`: none; null: "
    "the agent's own list decides), and may serve on `devices` (default: every "
    "device it reported). 409 when the name belongs to another enrolled agent.",
)
def enroll(request: HttpRequest, enrollment_id: ObjectId, payload: EnrollIn) -> dict:
    principal = principal_of(request)
    pending = get_object_or_404(EnrollmentRequest, pk=enrollment_id)
    fields = payload.model_dump(exclude_none=True)
    agent = do_enroll_agent(pending, actor=principal.token, **fields)
    return agent.to_dict()


@router.post(
    "/agents/enrollments/{enrollment_id}/reject",
    auth=token_auth("admin"),
    response={200: EnrollmentOut, **WRITE_ERRORS},
    summary="Reject a pending agent key (staff)",
)
def reject(request: HttpRequest, enrollment_id: ObjectId) -> dict:
    principal = principal_of(request)
    pending = get_object_or_404(EnrollmentRequest, pk=enrollment_id)
    return do_reject_enrollment(pending, actor=principal.token).to_dict()


@router.post(
    "/agents/{name}/revoke",
    auth=token_auth("admin"),
    response={200: EnrolledAgentOut, **WRITE_ERRORS},
    summary="Revoke an enrolled agent (staff): refused from now on",
    description="Its messages are refused at once and, in the same transaction, "
    "the jobs it holds (running, or waiting on its own queue) are sent to another "
    "agent with a new attempt.",
)
def revoke(request: HttpRequest, name: PathText) -> dict:
    principal = principal_of(request)
    check_operator(principal.token)
    agent = get_object_or_404(Agent, name=name)
    return revoke_agent(agent, actor=principal.token).to_dict()
