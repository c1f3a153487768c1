"""Message schemas shared by the control plane and the agent (torch-free, pydantic v2).

The control plane sends job requests to agent queues by task name; agents answer with a
JSON result that validates against one of the `*Result` models here. Nothing in this
module imports torch or Django, so both sides can import it.
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

KV_CACHE_DTYPES = ("bf16", "fp16", "fp8", "fp8-per-token", "int8", "int4", "int4c")
# Layouts of the fp8 KV scales a compressed checkpoint carries (compressed-tensors
# kv_cache_scheme strategies; gpuagent.compress.kv_scales): one per layer, which
# every vLLM attention backend reads, or one per kv head (FlashAttention 3/4 only).
KV_SCALE_STRATEGIES = ("tensor", "attn_head")
# Weight formats a recipe may ask for; int4 carries its quantization group size.
# w8a16 / w4a16-gN / fp8 are the compressed-tensors schemes (`gpuagent.compress`);
# int8 and int4-gN are the older names of w8a16 and w4a16-gN.
WEIGHT_FORMAT_PATTERN = re.compile(
    r"^(bf16|fp16|int8|int4-g(32|64|128)|w8a16|w4a16-g(32|64|128)|fp8)$"
)
WEIGHT_METHODS = ("rtn", "gptq", "signround")
# MoE + gptq: a routed expert routed fewer calibration tokens than this is
# rounded to nearest (a recipe option, `Recipe.min_expert_tokens`).
DEFAULT_MIN_EXPERT_TOKENS = 32
# Output-head formats a recipe may ask for (`Recipe.head`): "int8" is llama.cpp's
# Q8_0 head (groups of HEAD_GROUP_SIZE inputs, symmetric, float32 scales), written
# by compress as its own config group (gpuagent.compress.head) and loaded by the
# engine into its int8 head kernel (gpuagent.engine.weights.Int8Head).
HEAD_FORMATS = ("int8",)
HEAD_GROUP_SIZE = 32

JobKind = Literal[
    "inspect",
    "verify_source",
    "compress",
    "sign",
    "verify",
    "evaluate",
    "load_test",
    "gate",
    "deploy",
    "undeploy",
    "reverify",
]
JOB_KINDS: tuple[str, ...] = JobKind.__args__  # type: ignore[attr-defined]
# The jobs whose results are the gates' evidence: a QualityReport and a
# LoadTestReport as their JobResult payloads.
QUALITY_JOB_KIND = "evaluate"
LOAD_TEST_JOB_KIND = "load_test"


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Recipe(_Message):
    """How a release is compressed: weight format, how the weights are rounded, and
    the KV-cache dtype. Unknown options are refused (extra="forbid")."""

    weights: str = Field(
        description="bf16, fp16, w8a16 (int8), w4a16-g{32,64,128} (int4-g...) or fp8"
    )
    kv_cache_dtype: str = Field(description="one of " + ", ".join(KV_CACHE_DTYPES))
    method: Literal["rtn", "gptq", "signround"] = Field(
        "rtn",
        description="round-to-nearest, GPTQ on calibration text, or signround "
        "(rounding and scales tuned per layer by signed gradient descent on "
        "calibration text; symmetric int formats)",
    )
    symmetric: bool = Field(
        True, description="int4 only: False adds a zero point per group"
    )
    act_order: bool = Field(False, description="gptq only: columns by Hessian diag")
    observer: Literal["minmax", "mse"] = Field(
        "minmax",
        description="int formats: each scale from the range's absmax (minmax), or "
        "the shrink of the range that rounds with the least squared error, weighted "
        "per input channel by the calibration inputs' mean square under gptq (mse)",
    )
    awq: bool = Field(
        False,
        description="activation-aware input-channel scales (searched on calibration "
        "text, folded into the norms and up_proj) before rtn or gptq",
    )
    quantize_lm_head: bool = Field(
        False, description="quantize lm_head too (untied heads only)"
    )
    quantize_shared_experts: bool = Field(
        True,
        description="MoE models (deepseek_v3, kimi_k2, glm4_moe): quantize the "
        "shared experts too (False: kept in bf16, listed in `ignore`)",
    )
    quantize_dense_layers: bool = Field(
        True,
        description="MoE models: quantize the dense MLPs of the first "
        "first_k_dense_replace layers too (False: kept in bf16, listed in `ignore`)",
    )
    min_expert_tokens: int = Field(
        DEFAULT_MIN_EXPERT_TOKENS,
        ge=1,
        strict=True,
        description="MoE models, gptq: a routed expert the router sends fewer "
        "calibration tokens than this is rounded to nearest instead (named in the "
        "report)",
    )
    head: str | None = Field(
        None,
        description="the output head's own format: int8 (groups of 32 inputs, "
        "symmetric, float32 scales: llama.cpp's Q8_0 head; a tied head is stored "
        "untied, the embeddings unchanged), for int weight formats; None: the "
        "head stays bf16 (or quantized with the weights: quantize_lm_head)",
    )

    @field_validator("weights")
    @classmethod
    def _check_weights(cls, value: str) -> str:
        if not WEIGHT_FORMAT_PATTERN.match(value):
            raise ValueError(
                f"unknown weight format {value!r}; expected bf16, fp16, int8 or "
                "int4-g32/int4-g64/int4-g128"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {value!r}; expected one of "
                + ", ".join(KV_CACHE_DTYPES)
            )
        return value

    @field_validator("head")
    @classmethod
    def _check_head(cls, value: str | None, info: ValidationInfo) -> str | None:
        # the fields declared before `head` are in info.data once they validated
        if value is None:
            return value
        if value not in HEAD_FORMATS:
            raise ValueError(
                f"unknown head format {value!r}; expected one of "
                + ", ".join(HEAD_FORMATS)
                + " (or none: the head stays in the dense dtype)"
            )
        weights = info.data.get("weights")
        if weights in ("bf16", "fp16"):
            raise ValueError(
                f"head {value!r} needs quantized weights: weights {weights!r} keep "
                "every tensor dense (the engine's --quantize-head quantizes a dense "
                "release's head at serve time)"
            )
        if weights == "fp8":
            raise ValueError(
                f"head {value!r} is offered for int weight formats (w8a16, "
                "w4a16-gN) only: an fp8 release's Linears are float-quantized, and "
                "one release mixing two compression formats is not written"
            )
        if info.data.get("quantize_lm_head"):
            raise ValueError(
                f"head {value!r} and quantize_lm_head=true both set the head's "
                "format; give one"
            )
        return value


class TensorClassSize(_Message):
    """Bytes of one class of tensors (attention, mlp, embeddings, other) before and
    after compression."""

    tensor_class: str
    bytes_before: int = Field(ge=0)
    bytes_after: int = Field(ge=0)
    bytes_bf16: int = Field(ge=0, description="the same tensors in bf16")


class ExpertFallback(_Message):
    """A routed expert GPTQ could not calibrate: too few calibration tokens were
    routed to it, so its projections were rounded to nearest instead."""

    layer: int = Field(ge=0)
    expert: int = Field(ge=0)
    tokens: int = Field(ge=0, description="calibration tokens the router sent it")


class CompressResult(_Message):
    """What `gpuagent.compress.compress` wrote: the folder, the recipe, per-class
    sizes and the GPU memory its weights take loaded by the engine."""

    out_dir: str
    recipe: Recipe
    quantized_layers: int = Field(ge=0)
    sizes: list[TensorClassSize]
    total_bytes_before: int = Field(ge=0)
    total_bytes_after: int = Field(ge=0)
    expected_gpu_weight_bytes: int = Field(ge=0)
    kv_scales: bool = Field(description="k_scale/v_scale written")
    kv_scale_strategy: Literal["tensor", "attn_head"] | None = Field(
        None,
        description="layout of the KV scales written (None: none written): tensor "
        "(one per layer) or attn_head (one per kv head)",
    )
    group_sizes: dict[str, int] = Field(
        default={}, description="int4: group size per projection kind"
    )
    rtn_fallback_experts: list[ExpertFallback] = Field(
        default=[],
        description="MoE + gptq: routed experts that got too few calibration "
        "tokens and were rounded to nearest (layer, expert, tokens seen)",
    )
    min_expert_tokens: int | None = Field(
        None, description="MoE + gptq: the token count below which an expert falls back"
    )
    total_parameters: int | None = Field(
        None, ge=0, description="parameters in the checkpoint (MoE models)"
    )
    active_parameters: int | None = Field(
        None,
        ge=0,
        description="MoE models: parameters one token runs through (everything "
        "but the routed experts, plus top-k routed experts per MoE layer)",
    )
    seconds: float = Field(ge=0)


class FileDigest(_Message):
    """One file of a model folder: path relative to the folder, size and digest."""

    path: str
    size_bytes: int = Field(ge=0)
    digest: str = Field(description="'<algorithm>:<hex>', e.g. sha256:ab12...")


# --- Load-test plans -----------------------------------------------------------------
# What the load_test job measures, per environment (the control plane stores one and
# sends it in JobRequest.load_plan; the report carries the plan that ran). Lengths are
# in tokens of the server's own tokenizer, times in seconds unless named _ms.

PLAN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MAX_PLAN_TOKENS = 1_048_576


class Lengths(_Message):
    """A length distribution: uniform over tokens x (1 - spread) .. tokens x (1 +
    spread), drawn per prompt variant (seeded); spread 0 is a fixed length."""

    tokens: int = Field(ge=1, le=MAX_PLAN_TOKENS)
    spread: float = Field(0.0, ge=0, lt=1)


class SessionModel(_Message):
    """How a workload's requests chain: a session of `turns` requests, each turn's
    prompt starting with a system prompt of `system_prompt_tokens` shared by every
    session, then (with carry_history) every earlier turn and its answer. A turn
    is sent `think_time_s` after the answer before it. This is what sets the
    prefix-cache reuse a workload offers."""

    turns: int = Field(1, ge=1, le=64)
    system_prompt_tokens: int = Field(0, ge=0, le=MAX_PLAN_TOKENS)
    carry_history: bool = True
    think_time_s: float = Field(0.0, ge=0, le=600)


class WorkloadPlan(_Message):
    """One workload: what its prompts are (task and language pick the text and the
    instruction), their lengths per turn, its session model and its SLO."""

    name: str = Field(pattern=PLAN_NAME_PATTERN)
    task: Literal["chat", "rag", "code"]
    language: Literal["en", "ko"]
    prompt: Lengths = Field(description="each turn's new user message")
    output: Lengths = Field(description="each answer (max_tokens, EOS ignored)")
    session: SessionModel = Field(default_factory=lambda: SessionModel())
    slo_ttft_p99_ms: float = Field(2000.0, gt=0, le=3_600_000)
    slo_tpot_p99_ms: float = Field(150.0, gt=0, le=3_600_000)
    temperature: float | None = Field(0.0, ge=0, le=2)


class ConcurrencySweep(_Message):
    """Closed loop: `stepped` runs `levels` (empty: 1, 2, 4, ... max_concurrency)
    until the SLO breaks; `search` doubles until it breaks, then bisects between
    the last level that met it and the first that didn't. Either way the knee is
    the highest concurrency that met the SLO, and every level run is the curve."""

    mode: Literal["stepped", "search"] = "search"
    levels: list[int] = Field(default=[], max_length=64)
    max_concurrency: int = Field(64, ge=1, le=4096)
    requests_per_level: int = Field(
        16, ge=1, le=100_000, description="at least 2 x concurrency are sent"
    )
    max_seconds_per_level: float = Field(60.0, gt=0, le=86_400)
    retries: int = Field(
        1, ge=0, le=5, description="runs again of a level whose client fell behind"
    )
    workloads: list[str] = Field(default=[], description="empty: every workload")

    @field_validator("levels")
    @classmethod
    def _check_levels(cls, value: list[int]) -> list[int]:
        if any(c < 1 or c > 4096 for c in value):
            raise ValueError("levels must be concurrencies from 1 to 4096")
        if value != sorted(set(value)):
            raise ValueError("levels must be increasing, each once")
        return value


class ContextSweep(_Message):
    """The same workload at longer contexts (prompt + answer per request) at one
    concurrency; lengths past the server's max_model_len are skipped (the report
    names them). `max_model_len` in the list stands for the server's own."""

    context_tokens: list[int | Literal["max_model_len"]] = Field(
        default=[512, 1024, 2048, 4096, "max_model_len"], min_length=1, max_length=32
    )
    concurrency: int = Field(1, ge=1, le=4096)
    requests_per_level: int = Field(4, ge=1, le=100_000)
    max_seconds_per_level: float = Field(60.0, gt=0, le=86_400)
    workloads: list[str] = Field(
        default=[], description="empty: every workload whose task is rag"
    )

    @field_validator("context_tokens")
    @classmethod
    def _check_lengths(cls, value: list) -> list:
        numbers = [v for v in value if v != "max_model_len"]
        if any(not 1 <= v <= MAX_PLAN_TOKENS for v in numbers):
            raise ValueError(f"context lengths must be 1 .. {MAX_PLAN_TOKENS} tokens")
        return value


class RateSweep(_Message):
    """Open loop: requests arrive at each rate (requests/s; Poisson, or gamma of
    shape `burstiness`), whatever is in flight; goodput is the requests/s that met
    the SLO. A client that falls behind its schedule says so (the run is invalid)
    and the level is retried up to `retries` times while the budget lasts."""

    rates: list[float] = Field(min_length=1, max_length=32)
    burstiness: float | None = Field(None, gt=0, le=100)
    requests_per_level: int = Field(16, ge=1, le=100_000)
    max_seconds_per_level: float = Field(60.0, gt=0, le=86_400)
    retries: int = Field(1, ge=0, le=5)
    workloads: list[str] = Field(default=[], description="empty: every workload")

    @field_validator("rates")
    @classmethod
    def _check_rates(cls, value: list[float]) -> list[float]:
        if any(not 0 < r <= 100_000 for r in value):
            raise ValueError("rates must be requests/s above 0 (at most 100000)")
        return value


class Sweeps(_Message):
    concurrency: ConcurrencySweep | None = Field(
        default_factory=lambda: ConcurrencySweep()
    )
    context: ContextSweep | None = Field(default_factory=lambda: ContextSweep())
    rates: RateSweep | None = None


class LoadPlan(_Message):
    """What a load test measures and for how long at most: every workload under
    the sweeps, stopped at `budget_s` (the report lists the points skipped)."""

    workloads: list[WorkloadPlan] = Field(min_length=1, max_length=32)
    sweeps: Sweeps = Field(default_factory=lambda: Sweeps())
    budget_s: float = Field(gt=0, le=86_400, description="the whole test's time")
    seed: int = Field(0, ge=0, le=2**31 - 1)

    @model_validator(mode="after")
    def _check_names(self) -> LoadPlan:
        names = [w.name for w in self.workloads]
        doubled = sorted({n for n in names if names.count(n) > 1})
        if doubled:
            raise ValueError(f"workload names must be unique: {doubled} repeat")
        for key in ("concurrency", "context", "rates"):
            sweep = getattr(self.sweeps, key)
            unknown = sorted(set(sweep.workloads) - set(names)) if sweep else []
            if unknown:
                raise ValueError(
                    f"sweeps.{key}.workloads names {unknown}, not in the plan's "
                    f"workloads {names}"
                )
        return self

    def sweep_applies(self, sweep: str, workload: str) -> bool:
        """Whether sweeps.`sweep` runs for `workload` (an empty list: every one; for
        the context sweep every rag one)."""
        chosen = getattr(self.sweeps, sweep)
        if chosen is None:
            return False
        if chosen.workloads:
            return workload in chosen.workloads
        if sweep == "context":
            return any(w.name == workload and w.task == "rag" for w in self.workloads)
        return True


def default_load_plan() -> LoadPlan:
    """The three workloads a team measures first (multi-turn chat, RAG/long
    context, code), each in English and Korean, sized to run on the demo model
    on two CPU cores within the budget; an environment replaces it with its own.
    A chat turn is long enough for its instruction and a chat template that adds
    its own system prompt when measured alone (SmolLM2's: 77 tokens in Korean)."""
    chat = dict(
        task="chat",
        prompt=Lengths(tokens=128, spread=0.25),
        output=Lengths(tokens=12),
        session=SessionModel(turns=3, system_prompt_tokens=64, think_time_s=0.0),
    )
    rag = dict(
        task="rag",
        prompt=Lengths(tokens=320, spread=0.2),
        output=Lengths(tokens=8),
        slo_ttft_p99_ms=5000.0,
    )
    code = dict(task="code", prompt=Lengths(tokens=256), output=Lengths(tokens=16))
    workloads = [
        WorkloadPlan(name=name + suffix, language=language, **spec)
        for suffix, language in (("", "en"), ("-ko", "ko"))
        for name, spec in (("chat", chat), ("rag", rag), ("code", code))
    ]
    order = {name: i for i, name in enumerate(LOAD_PROFILES)}
    workloads.sort(key=lambda w: order.get(w.name, len(order)))
    return LoadPlan(
        workloads=workloads,
        sweeps=Sweeps(
            concurrency=ConcurrencySweep(
                mode="search",
                max_concurrency=8,
                requests_per_level=8,
                max_seconds_per_level=10.0,
            ),
            context=ContextSweep(
                context_tokens=[256, 512, 1024, "max_model_len"],
                concurrency=1,
                requests_per_level=2,
                max_seconds_per_level=10.0,
            ),
            rates=RateSweep(
                rates=[2.0], requests_per_level=6, max_seconds_per_level=8.0
            ),
        ),
        budget_s=80.0,
        seed=0,
    )


class JobRequest(_Message):
    """What the control plane sends to an agent task (`gpuagent.run_job`).

    `attempt` counts the control plane's dispatches of this job: a result is recorded
    only for the attempt in force, so a redelivered old message changes nothing.
    `candidate` is the candidate folder relative to the artifact store (shared by
    the agents), empty until the compress job made one. `signature` is the
    candidate's signature file (JSON text) for verify and deploy. `deployment_id`
    is the control plane's deployment; `serving_id` the agent's own id of its
    server (DeployResult.deployment_id) for undeploy and reverify; `backend` is
    how the target environment serves (deploy). `quarantined_digests` are the
    digests the control plane has quarantined (deploy): refused even by an agent
    that never saw the incident."""

    job_id: int
    release_id: int
    kind: JobKind
    attempt: int = Field(1, ge=1)
    source_uri: str
    recipe: Recipe | None = None
    manifest_digest: str = ""
    model: str = ""
    version: str = ""
    candidate: str = ""
    signature: str = ""
    deployment_id: int | None = None
    serving_id: str = ""
    backend: BackendSpec = Field(default_factory=lambda: BackendSpec())
    quarantined_digests: list[str] = []
    load_plan: LoadPlan | None = Field(
        None, description="load_test: the environment's plan (None: the default)"
    )
    placement: Placement | None = Field(
        None,
        description="deploy: the devices and memory budget the control plane "
        "gave it (None: the agent's whole machine, as before placement)",
    )


class DeviceInfo(_Message):
    """One device of an agent as its heartbeat reports it: a GPU by its CUDA index
    (as CUDA_VISIBLE_DEVICES names it), or on a CPU agent the one "cpu" device
    with the host's memory. Only the free memory of a device the agent's
    enrollment records is believed (controlplane.fleet.enrollment)."""

    index: int = Field(ge=0, le=1023)
    model: str = Field(max_length=100)
    memory_total_bytes: int = Field(ge=0)
    memory_free_bytes: int = Field(ge=0)


class Placement(_Message):
    """Where on its agent a deployment runs (controlplane.fleet.placement): the
    devices it may use (the server's CUDA_VISIBLE_DEVICES, in this order; an
    external engine's tensor_parallel_size must equal their count) and the memory
    it may take on each of them (`memory_budget_bytes`; the engine caps its
    weights + KV pool to it, an external engine gets it as
    --gpu-memory-utilization = budget / `device_memory_total_bytes`, the smallest
    enrolled total of the set). `stop_first`: this agent's servers (serving ids)
    to stop before the new one starts, because the budget does not hold both (a
    rollback target gone cold: kept verified on disk, restarted on rollback)."""

    devices: list[int] = Field(min_length=1, max_length=1024)
    memory_budget_bytes: int = Field(gt=0)
    device_memory_total_bytes: int = Field(gt=0)
    stop_first: list[str] = []

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: list[int]) -> list[int]:
        if any(i < 0 for i in value) or len(set(value)) != len(value):
            raise ValueError(f"devices {value} must be distinct indices >= 0")
        return value

    @model_validator(mode="after")
    def _check_budget(self) -> Placement:
        if self.memory_budget_bytes > self.device_memory_total_bytes:
            raise ValueError(
                f"memory_budget_bytes {self.memory_budget_bytes} exceeds the "
                f"device's memory ({self.device_memory_total_bytes} bytes)"
            )
        return self

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(i) for i in self.devices)


class Heartbeat(_Message):
    """What an agent says about itself every few seconds."""

    agent: str
    queue: str
    pool_queue: str
    incarnation: str = Field(
        default="",
        max_length=64,
        description="random per start of the agent's process: another one under "
        "the same name means it restarted (empty: an agent from before incarnations)",
    )
    started: datetime | None = Field(
        default=None, description="when this incarnation started"
    )
    device: Literal["cuda", "cpu"]
    gpu_model: str = Field(description="the GPU's name, or the CPU's on a CPU agent")
    memory_total_bytes: int = Field(ge=0)
    memory_free_bytes: int = Field(ge=0)
    running_jobs: list[int] = []
    deployments: list[DeploymentInfo] = Field(
        default=[], description="the servers this agent runs now"
    )
    devices: list[DeviceInfo] = Field(
        default=[],
        max_length=1024,
        description="every device it sees, with its free memory now (empty: an "
        "agent from before per-device reports)",
    )
    can_sign: bool = False
    public_key: str = Field(
        default="",
        pattern=r"^([0-9a-f]{64})?$",
        description="this agent's Ed25519 identity public key (raw, hex): what a "
        "pending enrollment shows; the beat's seal must verify against it",
    )
    signing_public_key: str = Field(
        default="",
        max_length=4096,
        description="PEM public key of the release-signing key this agent holds: "
        "shown in its pending enrollment; trusted only once an operator enrolls it",
    )


class Seal(_Message):
    """Who sent a message and what it binds (gpuagent.integrity.identity): the message
    `type`, the job, attempt, job kind and release it belongs to (None/"" for a
    heartbeat), the sender's key fingerprint, the sha256 of the body's canonical
    encoding, when (unix seconds) and a random nonce; `signature` (base64
    Ed25519) is over the canonical encoding of all the other fields."""

    type: Literal["job", "result", "progress", "heartbeat"]
    job_id: int | None = None
    attempt: int | None = None
    kind: str = ""
    release_id: int | None = None
    signer: str = Field(pattern=r"^[0-9a-f]{64}$")
    body_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    timestamp: float
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$")
    signature: str = Field(max_length=200)


class CompressJobResult(_Message):
    """The candidate the compress job made: where in the artifact store, in which
    weight format, the source's manifest digest (its parent), and what
    `gpuagent.compress` reported (`report.out_dir` is the candidate's name in the
    store, never an agent path)."""

    candidate: str
    weights: str
    kv_cache_dtype: str
    source_manifest_digest: str
    size_bytes: int = Field(ge=0)
    source_size_bytes: int = Field(ge=0)
    report: CompressResult


class InspectResult(_Message):
    """Structure check of a source folder: files, formats, anything refused."""

    ok: bool
    files: list[FileDigest] = []
    problems: list[str] = []
    manifest_digest: str = ""


class HashResult(_Message):
    """A manifest over the candidate's files; `manifest_digest` names the algorithm.
    `signature` is the signature file's text, `signer` the signing key's
    fingerprint."""

    manifest_digest: str
    files: list[FileDigest]
    signature: str = ""
    signer: str = ""


class VerifyResult(_Message):
    """Outcome of re-hashing a copy against an expected manifest digest (and, for
    the verify job, its signature: `signer` is who signed it)."""

    ok: bool
    manifest_digest: str
    signer: str = ""
    missing: list[str] = []
    extra: list[str] = []
    changed: list[str] = []
    error: str = Field("", description="why the copy could not be checked, if so")


class MetricResult(_Message):
    """One measured number from an evaluate or load-test job."""

    metric: str
    value: float
    unit: str = ""


class EvaluateResult(_Message):
    metrics: list[MetricResult]


SERVING_BACKENDS = ("engine", "external")
# Defaults both sides size with: the KV pool the agent gives the project's engine
# when the environment sets none, and an external engine's planned context and
# share of the GPU (gpuagent.serving.deploy; controlplane.fleet.placement).
ENGINE_KV_MEMORY_GB = 0.05
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def engine_kv_budget_bytes(kv_memory_gb: float | None) -> int:
    """The KV pool the project's engine is started with for a backend's
    `kv_memory_gb` (None: the agent's default), in bytes as the engine counts
    them (`--kv-memory-gb` in GiB)."""
    return int((kv_memory_gb or ENGINE_KV_MEMORY_GB) * 2**30)


# Command templates (BackendSpec.command_template, a ServingPreset's template): the
# grammar both sides check; gpuagent.serving.templates renders them on the agent.
TEMPLATE_PLACEHOLDERS = (
    "python",  # the agent's interpreter (sys.executable)
    "model_dir",
    "host",
    "port",
    "kv_cache_dtype",
    "served_model_name",  # the name answers carry
    "served_model_names",  # every name it answers to, the first that one
    "tensor_parallel_size",
    "manifest_digest",
    "quantization_args",  # the folder's format flags (serving.templates)
    "max_model_len",  # the context the engine plans for (BackendSpec.max_model_len)
    "gpu_memory_utilization",  # fraction of the GPU the engine may claim
)
# Placeholders whose value is several words: one argument each.
TEMPLATE_LIST_PLACEHOLDERS = ("served_model_names", "quantization_args")


def command_template_words(template: str) -> list[str]:
    """Split a command template into its argv words (shlex: quotes group words;
    never run through a shell) and check every placeholder. ValueError names the
    problem: empty, unbalanced quotes or braces, unknown or malformed
    placeholders (all of them named), a list placeholder inside a word, or a
    program that is not a literal word or `{python}`."""
    if not template or not template.strip():
        raise ValueError("empty command template")
    try:
        words = shlex.split(template)
    except ValueError as e:
        raise ValueError(f"command template cannot be split: {e}") from None
    unknown: list[str] = []
    for word in words:
        for name in template_fields(word):
            if name not in TEMPLATE_PLACEHOLDERS and name not in unknown:
                unknown.append(name)
    if unknown:
        raise ValueError(
            "unknown placeholder(s) in command template: "
            + ", ".join("{" + n + "}" for n in unknown)
            + "; known: "
            + ", ".join("{" + n + "}" for n in TEMPLATE_PLACEHOLDERS)
        )
    for word in words:
        for name in template_fields(word):
            if name in TEMPLATE_LIST_PLACEHOLDERS and word != "{" + name + "}":
                raise ValueError(
                    f"{{{name}}} must stand alone as an argument (it becomes one "
                    f"argument per name), not inside {word!r}"
                )
    if template_fields(words[0]) and words[0] != "{python}":
        raise ValueError(
            f"the program {words[0]!r} must be a literal command or {{python}}"
        )
    return words


def template_fields(word: str) -> list[str]:
    """Placeholder names in one word of a template; malformed ones (positional,
    format spec, conversion) raise ValueError."""
    try:
        parsed = list(string.Formatter().parse(word))
    except ValueError as e:
        raise ValueError(f"bad placeholder in {word!r}: {e}") from None
    names = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name == "" or spec or conversion:
            raise ValueError(
                f"bad placeholder in {word!r}: only plain {{name}} fields are "
                "allowed (no positional, format spec or conversion)"
            )
        names.append(name)
    return names


# The agent's own named presets' templates (gpuagent.serving.templates adds how
# each maps our KV-cache dtypes): here so that the control plane, which sends
# them by name, checks an enrolled agent's allowed shapes as the agent does.
AGENT_PRESET_TEMPLATES: dict[str, str] = {
    "vllm": (
        "vllm serve {model_dir} {quantization_args} "
        "--kv-cache-dtype {kv_cache_dtype} --max-model-len {max_model_len} "
        "--gpu-memory-utilization {gpu_memory_utilization} --tensor-parallel-size "
        "{tensor_parallel_size} --host {host} --port {port} "
        "--served-model-name {served_model_names}"
    ),
}


def allowed_shape_problem(
    template: str,
    allowed_programs: Collection[str],
    presets: Mapping[str, str],
    *,
    holder: str = "this agent allows",
) -> str:
    """Why `template` is not one of `allowed_programs` word for word ("" when it
    is). Each entry is a whole argument shape: the name of one of `presets` (its
    template) or a command template of its own; words are compared as written,
    placeholders included. A program is never allowed with free arguments:
    `{python}` alone allows the bare interpreter and nothing more, so `{python}
    -c '...'` is refused. `holder` says whose list it is in the reason.
    ValueError for a template the grammar refuses."""
    words = command_template_words(template)
    for entry in allowed_programs:
        shape = presets.get(entry, entry)
        try:
            if command_template_words(shape) == words:
                return ""
        except ValueError:
            continue  # a malformed entry allows nothing
    return (
        f"the command {shlex.join(words)!r} is not an argument shape {holder} "
        f"(allowed: {'; '.join(sorted(allowed_programs)) or 'none'})"
    )


class BackendSpec(_Message):
    """How an environment serves a release (see `gpuagent.serving`).

    `engine`: the project's engine (`python -m gpuagent.engine serve`, verify-on-load);
    `kv_memory_gb`, `max_num_seqs`, `threads` and `device` are its settings.
    `external`: any OpenAI-compatible engine started from `command_template` (an argv
    template, split like a shell line but never run through one) or from a named
    `preset` (e.g. "vllm"); exactly one of the two. `max_model_len` and
    `gpu_memory_utilization` are its settings (None: the defaults of
    gpuagent.serving.deploy, a context capped at 8192 tokens and 0.9 of the GPU).

    Both: `health_timeout_s`, how long a deploy waits for `/health` (None: 120 s for
    the engine, 1800 s for an external engine, whose cold start loads, compiles and
    captures graphs); `kv_scale_strategy`, the fp8 KV-scale layout compression
    writes for releases aimed at this environment (attn_head only where the
    engine's attention backend reads per-head scales); `gate_evidence`, whether the
    evaluate and load_test jobs score in the agent's process (in_process, the
    default) or start the candidate and its parent on this backend and measure them
    over HTTP (serving_backend: the engine that will serve)."""

    kind: Literal["engine", "external"] = "engine"
    preset: str = ""
    command_template: str = ""
    tensor_parallel_size: int = Field(1, ge=1)
    host: str = Field("127.0.0.1", description="address the server listens on")
    advertise_host: str = Field(
        "", description="host name in the reported endpoint (default: host)"
    )
    # The engine's own settings (None: the engine's default); an external engine
    # takes its settings in its template, so there they must stay None.
    kv_memory_gb: float | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1)
    device: str | None = None
    # An external engine's settings (None: gpuagent.serving.deploy's defaults); the
    # project's engine does not read them, so there they must stay None.
    max_model_len: int | None = Field(None, ge=16, le=10_000_000)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # Both kinds.
    health_timeout_s: float | None = Field(None, ge=1, le=4 * 3600)
    kv_scale_strategy: Literal["tensor", "attn_head"] = "tensor"
    # Where the gate's quality and load evidence comes from (the agent's evaluate
    # and load_test jobs; deploy does not read it): the project's engine in the
    # agent's process (small models), or this backend's own servers over HTTP.
    gate_evidence: Literal["in_process", "serving_backend"] = "in_process"


class DeploySpec(_Message):
    """What a deploy job asks the agent to serve, bound to the approved digest.

    `release` is the binding a signature must carry (model, version, recipe as
    signed); `approved_files` (the manifest's per-file digests, as `HashResult`
    gives them) lets a refusal name the changed files when there is no signature.
    `port` pins a port; else the first free one of `port_range` (inclusive). The
    server answers to `served_model_name` (default: `release_model`) and to
    `release_model@release_version`."""

    manifest_digest: str = Field(min_length=1)
    recipe: Recipe
    backend: BackendSpec = BackendSpec()
    served_model_name: str = ""
    port: int | None = Field(None, ge=1, le=65535)
    port_range: tuple[int, int] = (8100, 8199)
    health_timeout_s: float = Field(300.0, gt=0)
    release_model: str = ""
    release_version: str = ""
    release_recipe: str = ""
    release_parent_digest: str = ""
    approved_files: list[FileDigest] = []
    quarantined_digests: list[str] = []
    placement: Placement | None = None

    @field_validator("port_range")
    @classmethod
    def _check_range(cls, value: tuple[int, int]) -> tuple[int, int]:
        low, high = value
        if not 1 <= low <= high <= 65535:
            raise ValueError(f"port_range {value} is not 1 <= low <= high <= 65535")
        return value


# DeployResult.error_code values that say the agent's copy is not the approved
# bytes: files differ from the manifest, the files or the signature give another
# digest, the signature binds another release, or the folder changed while the
# server started. The control plane marks such a release failed_verification
# (its digest untrusted); any other code (a recipe the checkpoint doesn't match, a
# server that didn't start, a quarantined digest) is a failed deploy.
VERIFICATION_ERROR_CODES = (
    "manifest-mismatch",
    "manifest-digest-mismatch",
    "binding-mismatch",
    "changed-during-start",
)


class ServingEngine(_Message):
    """The server that produced a piece of evidence: the engine's name and version
    as it reports them (`/v1/models` owned_by, `/version`), and its command line
    as the agent rendered it, secrets replaced by "***"."""

    name: str
    version: str = ""
    backend: Literal["engine", "external"]
    command: list[str] = []


class DeployResult(_Message):
    ok: bool
    endpoint: str = ""
    manifest_digest: str = ""
    error: str = ""
    # Filled by gpuagent.serving: which deployment, and on an integrity refusal
    # the files that differ from the approved manifest.
    deployment_id: str = ""
    backend: str = ""
    error_code: str = ""
    missing: list[str] = []
    extra: list[str] = []
    changed: list[str] = []
    pid: int | None = None
    command: list[str] = Field(
        default=[], description="the server's command line, secrets as ***"
    )


class DeploymentInfo(_Message):
    """One running deployment of an agent (for heartbeats and undeploy)."""

    deployment_id: str
    manifest_digest: str
    endpoint: str
    backend: str
    served_model_name: str
    model_dir: str
    pid: int
    started: datetime


class RollbackCheck(_Message):
    """Whether a deployment can take traffic back: its copy re-hashed now and its
    `/health` answered."""

    ok: bool
    reason: str = ""
    verify: VerifyResult | None = None
    healthy: bool = False


class UndeployResult(_Message):
    deployment_id: int
    stopped: bool = Field(description="False when nothing was running for it")


class JobResult(_Message):
    """Envelope every agent job returns; `payload` holds the kind-specific result."""

    job_id: int
    kind: JobKind
    ok: bool
    agent: str = ""
    started: datetime | None = None
    finished: datetime | None = None
    error: str = ""
    payload: dict = {}


# --- Evidence the gates judge -------------------------------------------------------
# The evaluate job returns a QualityReport, the load-test job a LoadTestReport (as the
# JobResult payload). Gates in the control plane read exactly these fields; the
# dashboard charts them. Fractions are in [0, 1]; times in milliseconds.

QUALITY_SLICES = ("english", "code", "korean", "long_context")
LOAD_PROFILES = ("chat", "rag", "code", "chat-ko", "rag-ko", "code-ko")


class Interval(_Message):
    """A 95% confidence interval."""

    low: float
    high: float


class SliceQuality(_Message):
    """Candidate vs reference on the same token positions of one eval slice
    (`name` is one of QUALITY_SLICES, or "overall")."""

    name: str
    num_tokens: int = Field(ge=0)
    mean_kld: float = Field(ge=0)
    mean_kld_ci95: Interval | None = None
    p99_kld: float = Field(ge=0)
    max_kld: float = Field(ge=0)
    same_top1: float = Field(ge=0, le=1)
    same_top1_ci95: Interval | None = None
    ppl_candidate: float = Field(gt=0)
    ppl_reference: float = Field(gt=0)
    ppl_ratio: float = Field(gt=0)
    num_continuations: int = Field(ge=0, description="greedy continuations compared")
    exact_match: float = Field(ge=0, le=1, description="continuations identical")
    flips: int = Field(ge=0, description="continuations whose greedy answer changed")
    retrieval_ok: bool | None = Field(
        None, description="long_context only: the fact was retrieved"
    )
    reference_retrieval_ok: bool | None = Field(
        None,
        description="long_context only: the reference retrieved it (a candidate "
        "miss is a regression only where the reference didn't miss)",
    )
    mean_kld_lower: float | None = Field(
        None,
        ge=0,
        description="http_top_n only: the KL with the reference's tail (outside "
        "its top-N and the actual token) as one bucket, a lower bound of the true "
        "KL; mean_kld adds the divergence inside the tail as estimated "
        "(gpuagent.evaluate.metrics)",
    )
    tail_mass_mean: float | None = Field(
        None,
        ge=0,
        le=1,
        description="http_top_n only: the reference's probability outside its "
        "top-N and the actual token, mean over positions: the weight of the one "
        "term of KL the lower bound leaves out",
    )
    tail_mass_max: float | None = Field(None, ge=0, le=1)


class LayerRouting(_Message):
    """Router agreement and expert-load shift of one MoE layer: the candidate's
    expert choices against the reference's on the same tokens (teacher-forced,
    the same inputs on both sides)."""

    layer: int = Field(ge=0, description="decoder layer index")
    num_tokens: int = Field(ge=1, description="tokens routed on both sides")
    router_agreement: float = Field(
        ge=0, le=1, description="share of tokens whose top-k expert set is the same"
    )
    router_agreement_ci95: Interval | None = Field(
        None, description="block-bootstrap interval, as the slices' (None: too few)"
    )
    mean_jaccard: float = Field(
        ge=0, le=1, description="mean |A and B| / |A or B| of the two expert sets"
    )
    load_shift: float = Field(
        ge=0,
        le=1,
        description="total-variation distance between the two per-expert load "
        "distributions (shares of the routed token-slots)",
    )
    max_load_change: float = Field(
        ge=0,
        description="largest |candidate - reference| load of one expert, relative "
        "to the reference's load of it, or to the mean load where that is smaller",
    )
    max_load_change_expert: int = Field(ge=0, description="the expert it is")


ROUTING_STATUSES = ("measured", "not_applicable", "unknown")


class RoutingReport(_Message):
    """The MoE regression of a quality report: per MoE layer, how often the
    candidate's router picks the reference's top-k expert set, and how far the
    load over experts moved; the worst layer of each. `not_applicable`: a dense
    model (no router). `unknown`: routing could not be seen (an HTTP endpoint
    returns no routing): `reason` says why. Only `measured` is evidence."""

    status: Literal["measured", "not_applicable", "unknown"]
    reason: str = ""
    num_experts: int | None = Field(None, ge=1)
    top_k: int | None = Field(None, ge=1)
    layers: list[LayerRouting] = []
    min_router_agreement: float | None = Field(None, ge=0, le=1)
    worst_agreement_layer: int | None = None
    max_load_shift: float | None = Field(None, ge=0, le=1)
    worst_load_shift_layer: int | None = None
    max_load_change: float | None = Field(None, ge=0)

    @classmethod
    def measured(
        cls, layers: list[LayerRouting], num_experts: int, top_k: int
    ) -> RoutingReport:
        """A measured report over `layers`, its worst-layer summary filled in."""
        worst = min(layers, key=lambda e: e.router_agreement)
        shifted = max(layers, key=lambda e: e.load_shift)
        return cls(
            status="measured",
            num_experts=num_experts,
            top_k=top_k,
            layers=layers,
            min_router_agreement=worst.router_agreement,
            worst_agreement_layer=worst.layer,
            max_load_shift=shifted.load_shift,
            worst_load_shift_layer=shifted.layer,
            max_load_change=max(e.max_load_change for e in layers),
        )

    @model_validator(mode="after")
    def _summary_matches_layers(self) -> RoutingReport:
        if self.status != "measured":
            filled = [
                name
                for name in (
                    "num_experts",
                    "top_k",
                    "min_router_agreement",
                    "worst_agreement_layer",
                    "max_load_shift",
                    "worst_load_shift_layer",
                    "max_load_change",
                )
                if getattr(self, name) is not None
            ]
            if self.layers or filled:
                raise ValueError(f"a {self.status} routing report carries no numbers")
            if not self.reason:
                raise ValueError(f"a {self.status} routing report says why")
            return self
        if not self.layers or self.num_experts is None or self.top_k is None:
            raise ValueError("a measured routing report has layers, experts and top_k")
        indices = [entry.layer for entry in self.layers]
        if indices != sorted(set(indices)):
            raise ValueError("routing layers must be distinct and in layer order")
        worst = min(self.layers, key=lambda e: e.router_agreement)
        shifted = max(self.layers, key=lambda e: e.load_shift)
        expected = {
            "min_router_agreement": worst.router_agreement,
            "worst_agreement_layer": worst.layer,
            "max_load_shift": shifted.load_shift,
            "worst_load_shift_layer": shifted.layer,
            "max_load_change": max(e.max_load_change for e in self.layers),
        }
        wrong = [name for name, v in expected.items() if getattr(self, name) != v]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} must be the worst over the layers")
        return self


class QualityReport(_Message):
    """Quality regression of a candidate against its reference (the uncompressed parent
    with bf16 KV). `method` says how the KL divergence was measured: over the full
    distributions in-process, or over the top-N logprobs of an HTTP endpoint plus the
    remaining mass."""

    candidate: str
    reference: str
    method: Literal["in_process", "http_top_n"]
    top_n: int | None = None
    seed: int
    slices: list[SliceQuality]
    candidate_kv_cache_dtype: str | None = Field(
        None, description="in-process only (an endpoint's is its own)"
    )
    reference_kv_cache_dtype: str | None = None
    routing: RoutingReport | None = Field(
        None,
        description="router agreement and expert-load shift (MoE); None in reports "
        "made before routing was measured, which the gate can't read as dense",
    )
    candidate_engine: ServingEngine | None = Field(
        None, description="the server that scored the candidate (None: in-process)"
    )
    reference_engine: ServingEngine | None = None
    servers: Literal["side_by_side", "one_after_other"] | None = Field(
        None,
        description="how the agent ran the two servers: at once where memory "
        "allowed both, else the reference's first",
    )


class Percentiles(_Message):
    p50: float
    p90: float
    p95: float
    p99: float


class LoadRun(_Message):
    """One load level of one workload: closed loop at `concurrency`, or open loop at
    `request_rate` (requests/s)."""

    concurrency: int | None = None
    request_rate: float | None = None
    num_requests: int = Field(ge=0)
    num_errors: int = Field(ge=0)
    duration_s: float = Field(ge=0)
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    request_throughput: float = Field(ge=0, description="completed requests/s")
    output_tokens_per_s: float = Field(ge=0)
    goodput: float = Field(ge=0, description="requests/s meeting the SLO")
    meets_slo: bool
    valid: bool = Field(description="False when the client fell behind its schedule")
    preemptions: int = Field(0, ge=0)
    peak_concurrent_sequences: int = Field(
        0,
        ge=0,
        description="most sequences one engine step of the run ran, from the "
        "server's engine_iteration_num_requests_running histogram (0: unknown)",
    )
    arrival: Literal["closed", "poisson", "gamma"] = "closed"
    burstiness: float | None = Field(
        None, description="gamma arrivals' shape (1 is Poisson; lower is burstier)"
    )
    prompt_tokens: int = Field(
        0, ge=0, description="mean prompt tokens per request, from usage"
    )
    output_tokens: int = Field(0, ge=0, description="all output tokens, from usage")
    errors: list[str] = Field(default=[], description="distinct errors (first 5)")
    max_schedule_lag_ms: float = Field(
        0.0, ge=0, description="latest send behind the open-loop schedule"
    )
    loop_lag_p99_ms: float = Field(
        0.0, ge=0, description="the client's event-loop lag, p99"
    )
    client_cpu_s: float = Field(0.0, ge=0, description="CPU the client itself used")
    client_cpu_us_per_token: float = Field(0.0, ge=0)
    prefix_cache_hit_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="prefix-cache hits / queries over the run, as the server's "
        "/metrics counted them, else its usage.prompt_tokens_details.cached_tokens "
        "over prompt tokens (None: the server reported neither; no evidence)",
    )
    prefix_cache_hit_rate_source: Literal["metrics", "usage"] | None = None
    cached_tokens: int | None = Field(
        None, ge=0, description="sum of usage cached_tokens (None: not reported)"
    )
    implied_prefix_cache_hit_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="what the plan's session model implies: each prompt's full "
        "blocks shared with an earlier one (system prompt, carried history)",
    )
    kv_blocks_used_peak: int = Field(
        0, ge=0, description="most KV blocks in use in /metrics samples (0: unknown)"
    )
    kv_memory_bytes_peak: int = Field(
        0, ge=0, description="kv_blocks_used_peak in bytes (0: unknown)"
    )
    retries: int = Field(
        0, ge=0, description="times the level was run again: its client fell behind"
    )
    cut_by_budget: bool = Field(
        False, description="the plan's budget ended the level before its requests"
    )


class WorkloadReport(_Message):
    """One named workload profile (one of LOAD_PROFILES or a user's own) swept over
    load. The headline numbers are taken at the highest load that meets the SLO (None
    where no load met it)."""

    profile: str
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    context_tokens: int = Field(ge=0, description="prompt + output per request")
    slo_ttft_p99_ms: float
    slo_tpot_p99_ms: float
    runs: list[LoadRun]
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    max_concurrency_at_slo: int | None = None
    output_tokens_per_s_at_slo: float | None = None
    max_sessions_at_context: int = Field(
        ge=0, description="sessions of context_tokens the KV budget holds"
    )
    # The agent's own pricing at LoadTestReport.gpu_hourly_usd. The control plane
    # ignores these (and gpus_for_target_rate): it prices the physical numbers
    # above with the environment's cost model (controlplane/costs), in Decimal.
    cost_per_1m_output_tokens: float | None = None
    cost_per_request: float | None = None
    requests_per_gpu_hour: float | None = None
    sessions_per_gpu_at_slo: float | None = Field(
        None, description="closed-loop concurrency at the SLO, per GPU"
    )
    target_request_rate: float | None = Field(None, description="requests/s asked for")
    gpus_for_target_rate: int | None = Field(
        None, description="GPUs to serve target_request_rate at the SLO"
    )
    context_sweep: list[LoadRun] = Field(
        default=[], description="runs at other prompt lengths, same concurrency"
    )
    knee_concurrency: int | None = Field(
        None, description="the highest closed-loop concurrency that met the SLO"
    )
    max_goodput: float | None = Field(
        None, description="open loop: the most requests/s that met the SLO"
    )
    turns_per_session: int = Field(1, ge=1)
    system_prompt_tokens: int = Field(0, ge=0)


class LoadTestReport(_Message):
    """Load test of one endpoint under the same load for every workload, with the
    server-side memory numbers read from its /metrics."""

    endpoint: str
    gpu_hourly_usd: float = Field(
        ge=0, description="the agent's price; the control plane ignores it"
    )
    gpu_count: int = Field(ge=1)
    weights_bytes: int = Field(ge=0)
    kv_budget_bytes: int = Field(ge=0)
    kv_bytes_per_token: int = Field(ge=0)
    kv_cache_dtype: str
    workloads: list[WorkloadReport]
    model: str = ""
    kv_blocks_total: int = Field(0, ge=0)
    kv_block_size_tokens: int = Field(0, ge=0)
    max_model_len: int = Field(0, ge=0)
    plan: LoadPlan | None = Field(None, description="the plan that ran")
    budget_s: float | None = Field(None, ge=0)
    wall_s: float | None = Field(None, ge=0, description="the whole test's time")
    skipped_for_budget: list[str] = Field(
        default=[], description="the points the budget left unmeasured"
    )
    # Not "skipped": a job result with that key is one that measured nothing
    # (controlplane.releases.evidence).
    unmeasured: list[str] = Field(
        default=[], description="points not run for another reason, with it"
    )
    engine: ServingEngine | None = Field(
        None, description="the server under load, as the agent started it"
    )


# Defined above the models they name.
JobRequest.model_rebuild()
Heartbeat.model_rebuild()
