"""Request and response schemas of the REST API (pydantic v2 through django-ninja).

Request bodies forbid unknown keys, so a typo is a 422 naming the key rather than a
silently ignored field (and a different registration digest). Responses mirror the
models' `to_dict()`; views return those dicts and ninja validates them here, which is
also what the OpenAPI document shows.
"""

import re
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any, Generic, Literal, TypeVar

from ninja import Field, Schema
from pydantic import (
    AwareDatetime,
    BeforeValidator,
    ConfigDict,
    field_validator,
    model_validator,
)

from controlplane.accounts.models import API_SCOPES, ROLES
from controlplane.costs.report import parse_targets
from controlplane.costs.spec import CostModel, Currency, Price
from controlplane.fleet.models import DEPLOYMENT_STATES
from controlplane.releases.gates import GatePolicy, LoadPolicy, QualityPolicy
from controlplane.releases.models import GATE_OUTCOMES, JOB_STATES, RELEASE_STATES
from gpuagent.protocol import (
    DEFAULT_MIN_EXPERT_TOKENS,
    HEAD_FORMATS,
    KV_CACHE_DTYPES,
    WEIGHT_FORMAT_PATTERN,
    LoadPlan,
)

ReleaseState = Literal[RELEASE_STATES]  # type: ignore[valid-type]
DeploymentState = Literal[DEPLOYMENT_STATES]  # type: ignore[valid-type]
JobState = Literal[JOB_STATES]  # type: ignore[valid-type]
GateOutcome = Literal[GATE_OUTCOMES]  # type: ignore[valid-type]
Scope = Literal[API_SCOPES]  # type: ignore[valid-type]
Role = Literal[ROLES]  # type: ignore[valid-type]
KvCacheDtype = Literal[KV_CACHE_DTYPES]  # type: ignore[valid-type]
HeadFormat = Literal[HEAD_FORMATS]  # type: ignore[valid-type]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]*$"  # semver build metadata too

# A primary key as the client may send it: bounded, so an absurd id is a 422 instead
# of a database overflow (bigint on PostgreSQL, INTEGER on SQLite).
ObjectId = Annotated[int, Field(ge=1, le=2**63 - 1)]

T = TypeVar("T")


# Documents the NUL rule below on every string a client sends (JSON Schema regex).
NO_NUL_PATTERN = "^[^\\u0000]*$"


def _document_no_nul(schema: dict[str, Any]) -> None:
    for prop in schema.get("properties", {}).values():
        for variant in (prop, *prop.get("anyOf", ())):
            if variant.get("type") == "string" and "pattern" not in variant:
                variant["pattern"] = NO_NUL_PATTERN


# A text path parameter (a team's slug, a username): storable like any client string.
PathText = Annotated[str, Field(pattern=NO_NUL_PATTERN, max_length=150)]


class ClientInput(Schema):
    """Anything a client sends: strings must be storable and comparable everywhere
    (PostgreSQL text cannot hold NUL, and would answer a 500)."""

    model_config = ConfigDict(json_schema_extra=_document_no_nul)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value


class RequestBody(ClientInput):
    """A JSON body: unknown keys are refused by name, and values are taken as the
    JSON types they are (strict): 0 is no boolean, "5" no id, 2.0 no count."""

    model_config = ConfigDict(
        extra="forbid", strict=True, json_schema_extra=_document_no_nul
    )


# -- errors ---------------------------------------------------------------------------


class FieldError(Schema):
    field: str = Field(description="dotted path of the input, e.g. recipe.weights")
    message: str
    type: str
    # Where the input was: body, query or path (absent for action-level errors).
    location: str | None = None


class ErrorDetail(Schema):
    model_config = ConfigDict(extra="allow")

    code: str = Field(description="stable machine-readable slug")
    message: str
    fields: list[FieldError] | None = None
    scope: Scope | None = Field(None, description="the scope a 403 says is missing")


class ErrorOut(Schema):
    error: ErrorDetail


# -- pagination -----------------------------------------------------------------------


def _query_int(value: Any) -> Any:
    """A query string's integer as decimal digits only: pydantic alone would also
    take "5.0", " 5" and "5_0"."""
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value):
        raise ValueError("must be a whole number in decimal digits")
    return value


QueryInt = Annotated[int, BeforeValidator(_query_int)]


def _query_datetime(value: Any) -> Any:
    """A query string's date-time as ISO 8601 only: pydantic alone would also
    take a number of seconds since 1970 ("0.5")."""
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(
            "must be an ISO 8601 date-time with a UTC offset, e.g. 2026-12-01T00:00:00Z"
        ) from None


class PageParams(ClientInput):
    limit: QueryInt = Field(50, ge=1, le=200)
    # Bounded like ObjectId: the database takes OFFSET as a signed 64-bit integer.
    offset: QueryInt = Field(0, ge=0, le=2**63 - 1)


class Page(Schema, Generic[T]):
    items: list[T]
    count: int = Field(description="matching objects in all pages")
    limit: int
    offset: int


# -- model families -------------------------------------------------------------------


class ModelFamilyIn(RequestBody):
    name: str = Field(min_length=1, max_length=100, pattern=NAME_PATTERN)
    description: str = Field("", max_length=5000)


class ModelFamilyOut(Schema):
    id: int
    team: str
    name: str
    description: str
    created: datetime


# -- releases -------------------------------------------------------------------------


class RecipeIn(RequestBody):
    """gpuagent.protocol.Recipe as the API documents it (the same constants; the
    action validates through Recipe itself)."""

    weights: str = Field(
        pattern=WEIGHT_FORMAT_PATTERN.pattern,
        description="bf16, fp16, w8a16 (int8), w4a16-g{32,64,128} (int4-g...) or fp8",
    )
    kv_cache_dtype: KvCacheDtype
    method: Literal["rtn", "gptq", "signround"] = "rtn"
    symmetric: bool = True
    act_order: bool = False
    observer: Literal["minmax", "mse"] = "minmax"
    awq: bool = False
    quantize_lm_head: bool = False
    quantize_shared_experts: bool = Field(
        True, description="MoE models: quantize the shared experts too"
    )
    quantize_dense_layers: bool = Field(
        True,
        description="MoE models: quantize the first_k_dense_replace layers' MLPs too",
    )
    min_expert_tokens: int = Field(
        DEFAULT_MIN_EXPERT_TOKENS,
        ge=1,
        strict=True,
        description="MoE models, gptq: routed experts sent fewer calibration tokens "
        "are rounded to nearest (named in the report)",
    )
    head: HeadFormat | None = Field(
        None,
        description="int weight formats (w8a16, w4a16-gN): the output head written "
        "as its own int8 (groups of 32, symmetric: llama.cpp's Q8_0 head; a tied "
        "head stored untied), served by the engine's int8 head kernel; none: the "
        "head stays bf16",
    )


class ReleaseIn(RequestBody):
    model: str = Field(
        min_length=1, max_length=100, description="name of a model family"
    )
    version: str = Field(min_length=1, max_length=100, pattern=VERSION_PATTERN)
    source_uri: str = Field(min_length=1, max_length=1000)
    recipe: RecipeIn
    target_environment: str = Field(
        min_length=1, max_length=50, description="name of an environment of the team"
    )
    parent: ObjectId | None = Field(
        None, description="id of the uncompressed parent release, if any"
    )


class ReleaseFilters(PageParams):
    model: str | None = Field(None, description="model family name")
    version: str | None = None
    state: ReleaseState | None = None
    environment: str | None = Field(None, description="target environment name")


class ArtifactOut(Schema):
    path: str
    size_bytes: int
    digest: str


class JobOut(Schema):
    id: int
    kind: str
    state: JobState
    agent: str | None
    progress: float
    attempts: int
    started: datetime | None
    finished: datetime | None
    lease_expires: datetime | None = Field(
        description="while running: until when its worker holds the job"
    )
    duration_s: float | None
    result: dict[str, Any]
    error: str


class GateResultOut(Schema):
    gate: str
    metric: str
    observed: float | None
    threshold: float | None
    outcome: GateOutcome
    reason: str
    policy_version: int = Field(
        description="the environment's gate-policy version it was held against"
    )
    created: datetime


class ApprovalOut(Schema):
    user: str
    via_token: str | None
    decision: Literal["approve", "reject"]
    comment: str
    manifest_digest: str
    created: datetime


class PlacementOut(Schema):
    devices: list[int] | None = Field(
        description="CUDA indices it runs on (its CUDA_VISIBLE_DEVICES); null: not "
        "placed, the agent's whole machine"
    )
    memory_budget_bytes: int = Field(description="what it may take on each device")
    memory_need_bytes: int = Field(description="what the release needs on each")
    note: str = Field(description="why so: what was stopped to make room, or why not")
    warm: bool = Field(description="a server it started may still run")
    unloaded: datetime | None = Field(description="when its server was stopped")


class RollbackReadinessOut(Schema):
    release_id: int
    warm: bool = Field(
        description="its server still runs (no restart); false: cold, kept verified "
        "on disk and restarted"
    )
    estimate_s: float | None = Field(description="about how long a rollback takes")
    basis: str


class DeploymentOut(Schema):
    id: int
    release_id: int
    release: str
    environment: str
    agent: str | None
    state: DeploymentState
    endpoint: str
    started: datetime
    ended: datetime | None
    reason: str = Field(
        description="why it failed; for a rollback that found no previous release "
        "still verifying, each release tried and why"
    )
    rollback: bool = Field(description="started by a rollback")
    placement: PlacementOut


class ReleaseOut(Schema):
    id: int
    team: str
    model: str
    version: str
    source_uri: str
    recipe: dict[str, Any]
    target_environment: str
    state: ReleaseState
    failure_reason: str
    manifest_digest: str
    parent_id: int | None
    created_by: str
    created: datetime
    updated: datetime


class StageTimingOut(Schema):
    kind: str
    state: JobState
    agent: str | None
    attempts: int
    queued: datetime
    started: datetime | None
    finished: datetime | None
    duration_s: float | None


class TimingsOut(Schema):
    stages: list[StageTimingOut] = Field(description="the latest pass, in order")
    time_to_deploy_s: float = Field(
        description="machine time of the pipeline: the union of its jobs' intervals "
        "up to the first successful deploy (or now); the wait for approval is not in it"
    )
    deployed: bool = Field(description="false: the pipeline is still on its way")
    integrity_s: float
    integrity_pct: float | None = Field(description="percent of time_to_deploy_s")
    quality_load_s: float
    quality_load_pct: float | None = Field(description="percent of time_to_deploy_s")


class ReverificationsOut(Schema):
    count: int = Field(description="re-verifications of the live copy so far")
    newest: JobOut | None = Field(description="the latest, finished or not")
    history_url: str = Field(description="all of them, newest first (paginated)")


class ExpertFallbackOut(Schema):
    layer: int
    expert: int
    tokens: int = Field(description="calibration tokens the router sent it")


class CompressionOut(Schema):
    """What the newest succeeded compress job reported."""

    weights: str
    kv_cache_dtype: str
    size_bytes: int
    source_size_bytes: int
    total_parameters: int | None = Field(
        description="MoE models: parameters in the checkpoint (None: not reported)"
    )
    active_parameters: int | None = Field(
        description="MoE models: parameters one token runs through (everything but "
        "the routed experts, plus top-k routed experts per MoE layer)"
    )
    head: HeadFormat | None = Field(
        description="the output head's own format the release was written with "
        "(the recipe's `head`; None: bf16, or with the weights)"
    )
    min_expert_tokens: int | None = Field(
        description="MoE + GPTQ: an expert routed fewer calibration tokens is "
        "rounded to nearest (None: not calibrated)"
    )
    rtn_fallback_experts: list[ExpertFallbackOut] = Field(
        description="MoE + GPTQ: the routed experts rounded to nearest for lack of "
        "calibration tokens (empty: none)"
    )


class ReleaseDetailOut(ReleaseOut):
    signature: str
    artifacts: list[ArtifactOut]
    jobs: list[JobOut] = Field(
        description="the pipeline's jobs; the re-verifications are `reverification`"
    )
    gate_results: list[GateResultOut]
    approvals: list[ApprovalOut]
    deployments: list[DeploymentOut]
    timings: TimingsOut
    reverification: ReverificationsOut
    compression: CompressionOut | None = Field(
        description="the compress job's report (None: none succeeded, or its "
        "result is unreadable: then `compression_problem` says why)"
    )
    compression_problem: str | None = Field(
        description="why the compress job's recorded result can't be read"
    )


class PromotionOut(Schema):
    release: ReleaseOut
    status_url: str = Field(description="poll this (GET) for state, jobs and gates")


class ApproveIn(RequestBody):
    manifest_digest: str = Field(
        min_length=1,
        max_length=200,
        description="the manifest digest the approver reviewed; must be the current",
    )
    comment: str = Field("", max_length=5000)


class RejectIn(RequestBody):
    comment: str = Field(min_length=1, max_length=5000, description="why")
    manifest_digest: str | None = Field(
        None, max_length=200, description="if given, must be the current digest"
    )


class RemeasureIn(RequestBody):
    stages: list[Literal["evaluate", "load_test"]] = Field(
        min_length=1,
        max_length=2,
        description="which evidence to measure again: evaluate, load_test or both",
    )

    @model_validator(mode="after")
    def _each_once(self) -> "RemeasureIn":
        if len(set(self.stages)) != len(self.stages):
            raise ValueError("stages must name each stage once")
        return self


class ReopenIn(RequestBody):
    reason: str = Field(min_length=1, max_length=5000, description="why again")


class DecisionOut(Schema):
    release: ReleaseOut
    approval: ApprovalOut


# -- environments and deployments -----------------------------------------------------


class EnvironmentOut(Schema):
    id: int
    team: str
    name: str
    live_release_id: int | None
    rollback_target: RollbackReadinessOut | None = Field(
        description="the release a rollback would bring back, warm or cold, and "
        "about how long it would take"
    )


class ServingBackendIn(RequestBody):
    """How the environment's deploy jobs serve: the project's engine, or an
    external OpenAI-compatible engine from a preset (vllm, or one a platform
    operator named: GET /serving-presets) or, for operators only, a command
    template (README: Serving). `kind` is required (the setting is stated whole);
    unknown keys are refused by name."""

    kind: Literal["engine", "external"]
    preset: str = Field("", max_length=50)
    command_template: str = Field("", max_length=2000)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=10_000_000,
        description="external: the context the engine plans for (null: 8192, "
        "capped at the model's max_position_embeddings)",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="external: fraction of the GPU's memory the engine may claim "
        "(null: 0.9)",
    )
    health_timeout_s: float | None = Field(
        None,
        ge=1,
        le=4 * 3600,
        description="how long a deploy waits for /health (null: 120 s for the "
        "engine, 1800 s for an external engine)",
    )
    kv_scale_strategy: Literal["tensor", "attn_head"] = Field(
        "tensor",
        description="fp8 KV scales of releases for this environment: per tensor "
        "(every vLLM attention backend) or attn_head (per kv head: only vLLM's "
        "FlashAttention 3/4, i.e. Hopper and newer)",
    )
    gate_evidence: Literal["in_process", "serving_backend"] = Field(
        "in_process",
        description="where the gate's quality and load evidence is measured: "
        "in_process (the agent's own engine in its process; small models) or "
        "serving_backend (the candidate and its parent started on this backend, "
        "side by side where memory allows, and measured over HTTP)",
    )


class ServingBackendChangeIn(ServingBackendIn):
    """The keys of the serving backend to change; every key left out keeps its
    current value (null puts a nullable one back to its default). The result is
    checked whole, as a PUT's body is."""

    kind: Literal["engine", "external"] = "engine"

    @model_validator(mode="after")
    def _names_a_change(self) -> "ServingBackendChangeIn":
        if not self.model_fields_set:
            raise ValueError(
                "name at least one key to change: " + ", ".join(type(self).model_fields)
            )
        return self


class ServingBackendOut(Schema):
    environment: str
    backend: ServingBackendIn


class ServingPresetOut(Schema):
    name: str
    command_template: str = Field(
        description="the operator's template; empty for the agent's own presets"
    )
    description: str


class ServingPresetsOut(Schema):
    presets: list[ServingPresetOut]


class GatePolicyIn(GatePolicy):
    """A whole policy, stated: `quality` and `load` are required (null: not gated
    on it); inside them a key left out takes its default, and null turns a
    threshold off."""

    quality: QualityPolicy | None
    load: LoadPolicy | None


class GatePolicyChangeIn(RequestBody):
    """The keys to change, as in the policy; the rest keep their current values. An
    object merges key by key, anything else (a number, a list, null) replaces: null
    turns a threshold off, `"quality": null` stops gating on quality."""

    quality: dict[str, Any] | None = Field(
        None, description="keys of the policy's `quality` to change"
    )
    load: dict[str, Any] | None = Field(
        None, description="keys of the policy's `load` to change"
    )
    auto_rollback_on_failed_verification: bool = False

    @model_validator(mode="after")
    def _names_a_change(self) -> "GatePolicyChangeIn":
        if not self.model_fields_set:
            raise ValueError(
                "name at least one key to change: " + ", ".join(type(self).model_fields)
            )
        return self


class GatePolicyOut(Schema):
    environment: str
    policy: GatePolicy
    version: int = Field(
        description="bumped by every change; gate results record the version they "
        "were held against, and an approval re-evaluates under a newer one"
    )
    is_default: bool = Field(description="no policy set: the defaults apply")


# -- cost and capacity ----------------------------------------------------------------


class CostModelIn(CostModel):
    """A whole cost model, stated: `currency` and `device_hourly_price` are
    required; any other key left out takes its default (README: Cost and
    capacity)."""

    currency: Currency
    device_hourly_price: Price


class CostModelChangeIn(RequestBody):
    """The keys to change; the rest keep their current values. `target_requests_
    per_s` merges key by key (a workload set to null loses its target); null
    clears an optional key."""

    currency: Any = None
    device_hourly_price: Any = None
    power_draw_w: Any = None
    electricity_price_per_kwh: Any = None
    devices_per_replica: Any = None
    target_requests_per_s: dict[str, Any] | None = None
    note: Any = None

    @model_validator(mode="after")
    def _names_a_change(self) -> "CostModelChangeIn":
        if not self.model_fields_set:
            raise ValueError(
                "name at least one key to change: " + ", ".join(type(self).model_fields)
            )
        return self


class LoadPlanIn(LoadPlan):
    """A whole load-test plan: `workloads` and `budget_s` are required; a key left
    out takes its default (README: Load-test plans)."""


class LoadPlanChangeIn(RequestBody):
    """The keys of the plan to change; the rest keep their current values. An
    object merges key by key (`{"sweeps": {"rates": null}}` drops the rate sweep),
    anything else replaces (a list of workloads replaces them all)."""

    workloads: list[dict[str, Any]] | None = None
    sweeps: dict[str, Any] | None = None
    budget_s: Any = None
    seed: Any = None

    @model_validator(mode="after")
    def _names_a_change(self) -> "LoadPlanChangeIn":
        if not self.model_fields_set:
            raise ValueError(
                "name at least one key to change: " + ", ".join(type(self).model_fields)
            )
        return self


class LoadPlanOut(Schema):
    environment: str
    load_plan: LoadPlan
    is_default: bool = Field(description="none set: the default plan runs")


class CostModelOut(Schema):
    environment: str
    cost_model: CostModel
    is_default: bool = Field(description="none set: a device-hour at 0 USD")
    device_hour_cost: Decimal = Field(
        description="price + electricity of one device for an hour, in `currency`"
    )
    priced: bool = Field(description="false: a device-hour costs 0, no cost is shown")
    warnings: list[str]


class WorkloadCostOut(Schema):
    workload: str
    slo_ttft_p99_ms: float | None = Field(description="from the gate policy")
    slo_tpot_p99_ms: float | None
    max_concurrency_at_slo: int | None = Field(description="the knee")
    max_goodput: float | None = Field(description="requests/s meeting the SLO")
    requests_per_s_at_slo: float | None = Field(
        description="the operating point: the run meeting the SLO with the most "
        "requests/s (one replica)"
    )
    output_tokens_per_s_at_slo: float | None
    ttft_p99_ms_at_slo: float | None
    tpot_p99_ms_at_slo: float | None
    prefix_cache_hit_rate_at_slo: float | None
    requests_per_device_hour: float | None
    cost_per_request: Decimal | None = Field(description="null: no price, or no SLO")
    cost_per_1m_input_tokens: Decimal | None
    cost_per_1m_output_tokens: Decimal | None


class PlanSideOut(Schema):
    requests_per_s_per_replica: float | None
    replicas: int | None
    devices: int | None
    monthly_cost: Decimal | None
    missing: str = Field(description="why there is no number ('' when there is)")


class PlanRowOut(Schema):
    workload: str
    target_requests_per_s: float
    candidate: PlanSideOut
    live: PlanSideOut | None = Field(description="null: nothing is live")
    device_difference: int | None = Field(description="candidate - live")
    monthly_cost_difference: Decimal | None = Field(description="candidate - live")


class AgentTimeOut(Schema):
    what: Literal["integrity", "quality", "load"]
    seconds: float
    devices: int
    cost: Decimal | None


class VerificationCostOut(Schema):
    currency: str
    seconds: float
    cost: Decimal | None
    parts: list[AgentTimeOut]


class CapacityPlanOut(Schema):
    release_id: int
    release: str
    environment: str
    live_release_id: int | None
    live_release: str | None
    currency: str
    device_hour_cost: Decimal
    cost_model_note: str
    hours_per_month: int
    warnings: list[str] = Field(description="a price of 0 or none set")
    notes: list[str]
    problems: list[str] = Field(description="recorded reports that don't validate")
    targets: dict[str, float] = Field(description="requests/s per workload")
    targets_source: Literal["environment", "request"]
    workloads: list[WorkloadCostOut] = Field(description="this release")
    live_workloads: list[WorkloadCostOut]
    plan: list[PlanRowOut]
    total: PlanRowOut | None = Field(description="all workloads on one shared pool")
    verification: VerificationCostOut


class CapacityPlanQuery(ClientInput):
    targets: str | None = Field(
        None,
        max_length=2000,
        description="requests/s per workload, e.g. chat:20,rag:5 (default: the "
        "environment's cost model)",
    )

    @field_validator("targets")
    @classmethod
    def _parses(cls, value: str | None) -> str | None:
        if value is not None:
            parse_targets(value)
        return value


class WebhookIn(RequestBody):
    url: str = Field(min_length=1, max_length=500, description="http(s) URL")


class WebhookOut(Schema):
    id: int
    environment: str
    url: str = Field(description="scheme and host; a path or query shows as /…")
    active: bool
    created: datetime


class WebhookCreatedOut(WebhookOut):
    secret: str = Field(description="the signing secret; shown this once only")
    full_url: str = Field(description="the URL as given; shown this once only")


class RollbackOut(Schema):
    environment: EnvironmentOut
    deployment: DeploymentOut
    status_url: str


class DeploymentFilters(PageParams):
    environment: str | None = Field(None, description="environment name")
    release: ObjectId | None = Field(None, description="release id")
    state: DeploymentState | None = None


class EnvironmentIn(RequestBody):
    name: str = Field(
        min_length=1,
        max_length=50,
        pattern=r"^[-a-zA-Z0-9_]+$",
        description="letters, digits, - and _ (e.g. staging)",
    )


# -- teams, members, users and tokens -------------------------------------------------

# Django's username rule (UnicodeUsernameValidator) and slugify's output.
USERNAME_PATTERN = r"^[\w.@+-]+$"
SLUG_PATTERN = r"^[a-z0-9_-]*$"


class TeamIn(RequestBody):
    name: str = Field(min_length=1, max_length=100)
    slug: str = Field(
        "", max_length=100, pattern=SLUG_PATTERN, description="default: from the name"
    )
    admin: str | None = Field(
        None,
        max_length=150,
        pattern=USERNAME_PATTERN,
        description="username of the team's first admin; default: the caller",
    )


class TeamOut(Schema):
    id: int
    name: str
    slug: str


class MembershipIn(RequestBody):
    role: Role


class MembershipOut(Schema):
    team: str
    user: str
    role: Role


class UserIn(RequestBody):
    username: str = Field(min_length=1, max_length=150, pattern=USERNAME_PATTERN)
    email: str = Field("", max_length=254)
    team: str = Field(
        min_length=1, max_length=100, description="slug of the token's team"
    )
    role: Role = "member"


class UserCreatedOut(MembershipOut):
    email: str
    set_password_url: str = Field(
        description="a one-time link where the person sets their password (valid "
        "for PASSWORD_RESET_TIMEOUT, 3 days by default, and until used); shown "
        "this once"
    )


class ApiTokenIn(RequestBody):
    name: str = Field(min_length=1, max_length=100, description="what it is for")
    scopes: list[Scope] = Field(
        min_length=1,
        description="each allowed by the user's role, and held by the calling token",
    )
    user: str | None = Field(
        None,
        max_length=150,
        pattern=USERNAME_PATTERN,
        description="username of the member it is for; default: the caller",
    )


class ApiTokenOut(Schema):
    id: int
    name: str
    prefix: str = Field(description="the secret's first characters, to tell it apart")
    team: str
    user: str
    scopes: list[Scope]
    created: datetime
    last_used: datetime | None
    revoked: datetime | None


class ApiTokenCreatedOut(ApiTokenOut):
    token: str = Field(
        description="the secret, for `Authorization: Bearer <token>`; shown this "
        "once (only its sha256 is stored)"
    )


# -- audit log ------------------------------------------------------------------------


class AuditEventOut(Schema):
    id: int
    team: str | None
    actor: str
    verb: str
    object_type: str
    object_id: str
    before: dict[str, Any]
    after: dict[str, Any]
    created: datetime
    seq: int | None = Field(
        description="its position in the audit log's hash chain; null (and the "
        "hashes empty) until it is chained, just after its transaction commits"
    )
    prev_hash: str = Field(description="the hash of the event chained before it")
    hash: str = Field(
        description="sha256 over prev_hash and this event's content: its link in "
        "the audit log's hash chain (manage.py verify_audit_chain checks it)"
    )


class AuditFilters(PageParams):
    verb: str | None = Field(None, description="exact verb, e.g. release.transition")
    object_type: str | None = Field(None, description="e.g. release, deployment")
    object_id: str | None = None
    actor: str | None = Field(None, description="substring of the actor name")
    # ISO 8601 with a UTC offset ("2026-12-01T00:00:00Z"): a naive time would be
    # ambiguous, and a bare number is no date-time.
    since: Annotated[AwareDatetime, BeforeValidator(_query_datetime)] | None = None
    until: Annotated[AwareDatetime, BeforeValidator(_query_datetime)] | None = None

    @field_validator("since", "until", mode="after")
    @classmethod
    def _in_utc(cls, value: datetime | None) -> datetime | None:
        return None if value is None else clamped_utc(value)


# The range every database takes: Python's datetime range, in UTC.
EARLIEST_UTC = datetime.min.replace(tzinfo=UTC)
LATEST_UTC = datetime.max.replace(tzinfo=UTC)


def clamped_utc(value: datetime) -> datetime:
    """`value` in UTC, clamped to the range every database stores. A valid time
    near the ends of that range can fall outside it once its offset is applied
    (0001-01-01T00:00:00+14:00 is in year 0 in UTC), and PostgreSQL refuses offsets
    beyond +-15:59 (-16:00 is valid ISO 8601): converted here, neither reaches it."""
    try:
        return value.astimezone(UTC)
    except OverflowError:
        return EARLIEST_UTC if value.year == datetime.min.year else LATEST_UTC


# Error responses documented on every operation (the bodies come from api/errors.py).
READ_ERRORS: dict[int, type[Schema]] = {c: ErrorOut for c in (401, 403, 404, 422)}
WRITE_ERRORS: dict[int, type[Schema]] = {
    c: ErrorOut for c in (400, 401, 403, 404, 409, 422)
}
