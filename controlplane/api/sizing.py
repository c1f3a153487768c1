"""POST /api/v1/sizing: a deployment's memory report from a config.json alone
(gpuagent.sizing), for a release manager sizing a model whose weights are nowhere
near this machine."""

from dataclasses import replace
from typing import Any, Literal

from django.http import HttpRequest
from ninja import Field, Router, Schema

from controlplane.api.auth import token_auth
from controlplane.api.errors import ApiError
from controlplane.api.schemas import ErrorOut, RequestBody
from gpuagent.sizing import (
    DevicePlan,
    Knobs,
    KVBytes,
    SizingError,
    WeightBytes,
    size_deployment,
)

router = Router(tags=["sizing"])
# 400: a body that is not JSON; 422: a knob or config key the sizing cannot take.
SIZING_ERRORS = {c: ErrorOut for c in (400, 401, 403, 422)}


class SizingIn(RequestBody):
    """A model's config.json object and the deployment's knobs. Unknown keys are
    refused by name (the config's own keys are read as transformers reads them)."""

    config: dict[str, Any] = Field(
        description="the model's config.json, as published (llama, deepseek_v3, "
        "kimi_k2, kimi_k25, glm4_moe)"
    )
    gpu_memory_gib: float = Field(gt=0, le=4096, description="memory of one device")
    devices: int = Field(1, ge=1, le=1024, description="tensor-parallel size")
    context_tokens: int = Field(32768, ge=1, le=2**24, description="--max-model-len")
    sessions: int = Field(
        1, ge=1, le=2**20, description="concurrent sequences at context_tokens"
    )
    weights: str = Field(
        "bf16",
        pattern=r"^(bf16|fp8|w8a16|w4a16-g(32|64|128)(-asym)?)$",
        description="bf16, fp8, w8a16 or w4a16-gN (N 32/64/128, -asym: zero point)",
    )
    kv_cache_dtype: Literal["bf16", "fp8", "int8", "int4", "int4c"] = Field(
        "bf16", description="int4c: Llama models only"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_headroom_gib: float = Field(
        4.0, ge=0, le=4096, description="per device, for activations and CUDA graphs"
    )
    keep_bf16: list[Literal["attention", "shared_experts", "dense_mlp"]] = Field(
        [],
        max_length=3,
        description="classes the recipe leaves in bf16 (router, embeddings, head "
        "and norms always are)",
    )
    parallelism: Literal["tensor", "data"] = Field(
        "tensor",
        description="tensor: one tensor-parallel group over the devices; data: "
        "data-parallel attention with the experts split over the devices (vLLM "
        "--data-parallel-size --enable-expert-parallel)",
    )


class SizingOut(Schema):
    model_type: str
    architecture: dict[str, Any]
    total_params: int
    active_params: int = Field(description="per token, embeddings and head included")
    active_params_no_embeddings: int
    params_by_class: dict[str, int]
    active_params_by_class: dict[str, int]
    mtp_params: int = Field(description="multi-token-prediction layers, not counted")
    weights: list[WeightBytes]
    published_weights: WeightBytes | None = Field(
        description="the checkpoint as its config.json says it ships (fp8 blocks)"
    )
    kv: list[KVBytes]
    sessions_by_kv_dtype: dict[str, int] = Field(
        description="sessions at context_tokens this deployment holds per KV dtype"
    )
    knobs: Knobs
    deployment: DevicePlan
    devices_needed: DevicePlan | None = Field(
        description="the fewest devices holding `sessions`; null: none up to 64"
    )
    vllm_argv: list[str] = Field(description="empty: vLLM lacks the KV dtype")
    vllm_command: str
    vllm_note: str
    notes: list[str]


@router.post(
    "/sizing",
    auth=token_auth("read"),
    response={200: SizingOut, **SIZING_ERRORS},
    summary="Size a deployment from a config.json alone",
    description="Parameters (total and active per token, by class), weight bytes "
    "per format in the compressed-tensors layout the compress job writes, KV bytes "
    "per token per KV dtype (MLA: the latent against expanded K/V), sessions at the "
    "context per device, devices needed, and the vllm preset's command line. "
    "Nothing is stored. README: Sizing.",
)
def post_sizing(request: HttpRequest, payload: SizingIn) -> dict:
    knobs = Knobs(**payload.model_dump(exclude={"config", "keep_bf16"}))
    knobs = replace(knobs, keep_bf16=tuple(dict.fromkeys(payload.keep_bf16)))
    try:
        report = size_deployment(payload.config, knobs)
    except SizingError as e:
        raise ApiError(422, "invalid_config", str(e)) from None
    return report.to_dict()
