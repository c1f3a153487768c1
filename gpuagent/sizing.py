"""Sizing a deployment from a config.json alone: parameters, weight bytes per format,
KV bytes per token per KV dtype, sessions per GPU budget, devices needed, and the
vLLM preset's command line. Pure Python (no torch): the control plane imports it.

Architectures (`model_type`): llama, deepseek_v3 and kimi_k2 (MLA + MoE; a kimi_k25
config's `text_config`), glm4_moe (GQA + MoE). The tensors are enumerated as
transformers names them (`model_tensors`), each in one class:

- attention: the projections (MLA: q_a/q_b or q, kv_a_proj_with_mqa, kv_b, o;
  GQA: q/k/v/o and their biases);
- routed_experts, shared_experts, router (the gate and its score-correction bias,
  which DeepSeek-V3's noaux_tc routing has: a config without `topk_method` is
  transformers' own, whose router always holds it),
  dense_mlp (the first_k_dense_replace layers, or every layer of a dense model);
- embeddings (embed_tokens and lm_head), norms (every RMSNorm weight:
  input/post-attention/final, MLA's q_a/kv_a layernorms, GLM's q/k norms; the
  classes of gpuagent.compress.size_report, which reads them from the checkpoint's
  names).

Multi-token-prediction layers (`num_nextn_predict_layers`) are counted apart
(`mtp_params`): neither transformers nor vLLM loads them unless speculative decoding
asks for them.

Active parameters per token: every tensor except the routed experts, plus
num_experts_per_tok of n_routed_experts in each MoE layer; `active_params` counts
embeddings and head as Kimi's model card does (32B), `active_params_no_embeddings`
leaves them out as GLM-4.5's does (32B).

Weight bytes follow the compressed-tensors layout gpuagent.compress writes
(gpuagent/compress/checkpoint.py): for a quantized Linear [N, K], int formats store
`weight_packed` int32 [N, ceil(K bits / 32)], `weight_scale` bf16 [N, K / group]
([N, 1] per channel), `weight_shape` int64 [2], and asymmetric int4 a packed int32
`weight_zero_point` [ceil(N / 8), K / group]; fp8 stores `weight` e4m3 [N, K] and
`weight_scale` bf16 [N, 1]. The int4 group of a Linear is the recipe's rule
(gpuagent.compress.recipes: the largest of the recipe's group, halved down to 32,
that divides K). Router gates, embeddings, lm_head, norms and biases stay bf16 (the
recipe's `ignore`).

KV bytes per token follow kernels/kv_quant.py: a head vector of D values is 2 D
bytes in bf16, D in fp8 (one static float32 scale per head per layer), D + 2 in
int8 and ceil(D / 2) + 2 in int4 (one float16 scale per token per head). GQA caches
K and V per kv head; MLA caches one vector per token per layer, the latent and the
decoupled RoPE key (kv_lora_rank + qk_rope_head_dim), against the expanded K
(heads x (qk_nope + qk_rope)) and V (heads x v_head_dim) a naive cache would hold.
int4 adds the engine's bf16 window of the newest tokens per sequence
(gpuagent.engine.engine.DEFAULT_KV_WINDOW). int4c (gpuagent.engine.kv_int4c) has
int4's bytes and window row, plus one float32 key mean [kv_heads, D] per layer; it
is for Llama attention only (its keys are RoPE'd over the whole head).

Per device under tensor parallelism (vLLM's layers): sharded weights / tp plus the
replicated ones (norms, the router, MLA's q_a_proj and kv_a_proj_with_mqa, which
vLLM runs unsplit); KV: a GQA rank holds ceil(kv_heads / tp) heads, an MLA rank the
whole latent (vLLM replicates the MLA cache on every tensor-parallel rank). The
activation headroom (what vLLM's profiling run and CUDA graphs take) is a knob.
Under data-parallel attention (`parallelism="data"`, vLLM's --data-parallel-size with
--enable-expert-parallel) a device holds every non-expert weight, 1/N of the routed
experts, and the whole-model KV of its own sessions, so MLA's latent is no longer
repeated on every device: the deployment holds N times the sessions of one device.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpuagent.serving.errors import TemplateError
from gpuagent.serving.templates import PRESETS, quantization_args, render_command

GIB = 2**30
TENSOR_CLASSES = (
    "attention",
    "routed_experts",
    "shared_experts",
    "router",
    "dense_mlp",
    "embeddings",
    "norms",
)
ARCHITECTURES = ("llama", "deepseek_v3", "kimi_k2", "glm4_moe")
MLA_TYPES = ("deepseek_v3", "kimi_k2")
# Weight formats the report tables; any w4a16-gN(-asym) with N in 32/64/128 is taken.
REPORTED_WEIGHT_FORMATS = ("bf16", "fp8", "w8a16", "w4a16-g128")
INT4_GROUPS = (32, 64, 128)
MIN_GROUP_SIZE = 32
KV_DTYPES = ("bf16", "fp8", "int8", "int4", "int4c")
# KV dtypes for some architectures only (model_type); the others take every one.
KV_DTYPE_MODEL_TYPES = {"int4c": ("llama",)}
# kernels/kv_quant.py: one float16 scale per token per head vector (int8, int4,
# int4c), one float32 scale per head per layer (fp8), one float32 key mean per
# element of a head per layer (int4c).
KV_TOKEN_SCALE_BYTES = 2
KV_STATIC_SCALE_BYTES = 4
KV_KEY_MEAN_BYTES = 4
# gpuagent.engine.engine.DEFAULT_KV_WINDOW for the dtypes only the engine serves
# (vLLM's fp8 has no window): newest tokens per sequence also kept in bf16 (int4c's
# row: the newest 17 and the first).
KV_WINDOW_TOKENS = {"int4": 18, "int4c": 18}
VLLM_BLOCK_TOKENS = 16  # vLLM's default --block-size: a sequence takes whole blocks
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
MAX_DEVICES_NEEDED = 64
# "tensor": one tensor-parallel group over the devices; "data": vLLM's data-parallel
# attention (tensor-parallel size 1, --data-parallel-size N) with the routed experts
# split over all N devices (--enable-expert-parallel): every device holds the
# non-expert weights whole and the KV of its own sessions only.
PARALLELISMS = ("tensor", "data")
# Classes a recipe may leave in bf16 (Kimi K2 Thinking's int4 checkpoint keeps
# attention and the shared experts in bf16, its `ignore`); router gates,
# embeddings, lm_head and norms always are.
KEEP_BF16_CLASSES = ("attention", "shared_experts", "dense_mlp")


class SizingError(ValueError):
    """A config or a knob the sizing cannot take; the message names it."""


# -- the model's shape -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What sizing reads from config.json (module docstring)."""

    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    attention_bias: bool
    intermediate_size: int
    max_position_embeddings: int | None = None
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    router_bias: bool = False
    use_qk_norm: bool = False
    num_mtp_layers: int = 0
    remote_code: bool = False

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_TYPES

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.is_moe
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def num_moe_layers(self) -> int:
        """Layers i in [first_k_dense_replace, num_layers) with i % freq == 0."""
        if not self.is_moe or self.first_k_dense_replace >= self.num_layers:
            return 0
        freq = self.moe_layer_freq
        return -(-self.num_layers // freq) - -(-self.first_k_dense_replace // freq)


# Larger than any published dimension by far; bounds what a pasted config costs.
MAX_CONFIG_INT = 2**32


def _int(config: Mapping[str, Any], key: str, *, minimum: int = 1) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise SizingError(f"config.json: {key!r} must be an integer, got {shown}")
    if not minimum <= value <= MAX_CONFIG_INT:
        raise SizingError(
            f"config.json: {key!r} must be in [{minimum}, {MAX_CONFIG_INT}], "
            f"got {value}"
        )
    return value


def _opt_int(config: Mapping[str, Any], key: str, default: int | None, minimum=0):
    if config.get(key) is None:
        return default
    return _int(config, key, minimum=minimum)


def _bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise SizingError(
            f"config.json: {key!r} must be true or false, got {json.dumps(value)}"
        )
    return value


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """The shape of a published config.json (a mapping as json.load gives it).
    Raises SizingError naming the key that is missing or wrong, or the
    model_type it does not know."""
    if not isinstance(config, Mapping):
        raise SizingError("config.json must be a JSON object")
    if config.get("model_type") == "kimi_k25":
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise SizingError("config.json: kimi_k25 needs a 'text_config' object")
        config = {**text, "auto_map": config.get("auto_map")}
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise SizingError(
            f"config.json: model_type {json.dumps(model_type)} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)} (and kimi_k25's text_config)"
        )
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    common = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_layers": _int(config, "num_hidden_layers"),
        "vocab_size": _int(config, "vocab_size"),
        "num_heads": heads,
        "num_kv_heads": _opt_int(config, "num_key_value_heads", heads, minimum=1),
        "tie_word_embeddings": _bool(config, "tie_word_embeddings", False),
        "attention_bias": _bool(config, "attention_bias", False),
        "intermediate_size": _int(config, "intermediate_size"),
        "max_position_embeddings": _opt_int(
            config, "max_position_embeddings", None, minimum=1
        ),
        "remote_code": bool(config.get("auto_map")),
    }
    if model_type not in MLA_TYPES:
        kv_heads = common["num_kv_heads"]
        if kv_heads > heads or heads % kv_heads:
            raise SizingError(
                f"config.json: num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
    if model_type == "llama":
        head_dim = _opt_int(config, "head_dim", None, minimum=1)
        if head_dim is None:
            if hidden % heads:
                raise SizingError(
                    "config.json: hidden_size is not a multiple of "
                    "num_attention_heads and no 'head_dim' is given"
                )
            head_dim = hidden // heads
        return ModelShape(head_dim=head_dim, **common)
    moe = {
        "n_routed_experts": _int(config, "n_routed_experts"),
        "n_shared_experts": _opt_int(config, "n_shared_experts", 0),
        "num_experts_per_tok": _int(config, "num_experts_per_tok"),
        "moe_intermediate_size": _int(config, "moe_intermediate_size"),
        "first_k_dense_replace": _opt_int(config, "first_k_dense_replace", 0),
        "num_mtp_layers": _opt_int(config, "num_nextn_predict_layers", 0),
    }
    if moe["num_experts_per_tok"] > moe["n_routed_experts"]:
        raise SizingError(
            "config.json: num_experts_per_tok "
            f"{moe['num_experts_per_tok']} > n_routed_experts "
            f"{moe['n_routed_experts']}"
        )
    if model_type == "glm4_moe":
        return ModelShape(
            head_dim=_int(config, "head_dim"),
            use_qk_norm=_bool(config, "use_qk_norm", False),
            # transformers' Glm4MoeTopkRouter always holds e_score_correction_bias
            router_bias=True,
            **moe,
            **common,
        )
    rope = _int(config, "qk_rope_head_dim")
    return ModelShape(
        head_dim=_int(config, "qk_nope_head_dim") + rope,
        q_lora_rank=_opt_int(config, "q_lora_rank", None, minimum=1),
        kv_lora_rank=_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=rope,
        v_head_dim=_int(config, "v_head_dim"),
        moe_layer_freq=_opt_int(config, "moe_layer_freq", 1, minimum=1),
        # transformers' DeepseekV3TopkRouter always holds e_score_correction_bias
        # (its configs name no topk_method); DeepSeek's own name noaux_tc
        router_bias=config.get("topk_method", "noaux_tc") == "noaux_tc",
        **moe,
        **common,
    )


# -- the tensors -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorGroup:
    """Tensors of one kind: `count` instances in the model, `active` of them on a
    token's path. A Linear's weight has `in_features`; a 1-D tensor (norm, bias)
    has in_features None and `out_features` values. `replicated`: every
    tensor-parallel rank holds it whole (vLLM), else it is split across ranks."""

    name: str
    tensor_class: str
    out_features: int
    in_features: int | None
    count: int
    active: int
    replicated: bool = False

    @property
    def numel(self) -> int:
        return self.out_features * (self.in_features or 1)

    @property
    def quantizable(self) -> bool:
        """A Linear the recipe quantizes (router gates and lm_head are ignored)."""
        return self.in_features is not None and self.tensor_class not in (
            "router",
            "embeddings",
        )


_rep = {"replicated": True}


def _linear(name, cls, out_f, in_f, count, bias=False, replicated=False, active=None):
    active = count if active is None else active
    groups = [TensorGroup(name, cls, out_f, in_f, count, active, replicated)]
    if bias:
        groups.append(TensorGroup(f"{name}.bias", cls, out_f, None, count, active))
    return groups


def _mlp(prefix: str, cls: str, hidden: int, inter: int, count: int, active: int):
    return [
        g
        for proj, out_f, in_f in (
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        )
        for g in _linear(f"{prefix}.{proj}", cls, out_f, in_f, count, active=active)
    ]


def _attention(s: ModelShape, layers: int) -> list[TensorGroup]:
    h, a = s.hidden_size, "attention"
    p = "model.layers.*.self_attn"
    if s.is_mla:
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        groups = []
        if s.q_lora_rank:
            groups += _linear(f"{p}.q_a_proj", a, s.q_lora_rank, h, layers, **_rep)
            groups.append(
                TensorGroup(
                    f"{p}.q_a_layernorm",
                    "norms",
                    s.q_lora_rank,
                    None,
                    layers,
                    layers,
                    True,
                )
            )
            groups += _linear(
                f"{p}.q_b_proj", a, s.num_heads * qk, s.q_lora_rank, layers
            )
        else:
            groups += _linear(f"{p}.q_proj", a, s.num_heads * qk, h, layers)
        latent = s.kv_lora_rank + s.qk_rope_head_dim
        groups += _linear(f"{p}.kv_a_proj_with_mqa", a, latent, h, layers, **_rep)
        groups.append(
            TensorGroup(
                f"{p}.kv_a_layernorm",
                "norms",
                s.kv_lora_rank,
                None,
                layers,
                layers,
                True,
            )
        )
        kv_b_out = s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)
        groups += _linear(f"{p}.kv_b_proj", a, kv_b_out, s.kv_lora_rank, layers)
        groups += _linear(f"{p}.o_proj", a, h, s.num_heads * s.v_head_dim, layers)
        return groups
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    bias = s.attention_bias
    groups = (
        _linear(f"{p}.q_proj", a, q_out, h, layers, bias=bias)
        + _linear(f"{p}.k_proj", a, kv_out, h, layers, bias=bias)
        + _linear(f"{p}.v_proj", a, kv_out, h, layers, bias=bias)
        # transformers' Glm4MoeAttention has no o_proj bias; Llama's follows the flag
        + _linear(
            f"{p}.o_proj", a, h, q_out, layers, bias=bias and s.model_type == "llama"
        )
    )
    if s.use_qk_norm:
        for norm in ("q_norm", "k_norm"):
            groups.append(
                TensorGroup(
                    f"{p}.{norm}", "norms", s.head_dim, None, layers, layers, True
                )
            )
    return groups


def _feed_forward(
    s: ModelShape, dense_layers: int, moe_layers: int
) -> list[TensorGroup]:
    h, p = s.hidden_size, "model.layers.*.mlp"
    groups = []
    if dense_layers:
        groups += _mlp(
            p, "dense_mlp", h, s.intermediate_size, dense_layers, dense_layers
        )
    if moe_layers:
        routed = moe_layers * s.n_routed_experts
        active = moe_layers * s.num_experts_per_tok
        groups += _mlp(
            f"{p}.experts.*",
            "routed_experts",
            h,
            s.moe_intermediate_size,
            routed,
            active,
        )
        if s.n_shared_experts:
            inter = s.moe_intermediate_size * s.n_shared_experts
            groups += _mlp(
                f"{p}.shared_experts",
                "shared_experts",
                h,
                inter,
                moe_layers,
                moe_layers,
            )
        groups += _linear(
            f"{p}.gate", "router", s.n_routed_experts, h, moe_layers, **_rep
        )
        if s.router_bias:
            groups.append(
                TensorGroup(
                    f"{p}.gate.e_score_correction_bias",
                    "router",
                    s.n_routed_experts,
                    None,
                    moe_layers,
                    moe_layers,
                    True,
                )
            )
    return groups


def model_tensors(s: ModelShape) -> list[TensorGroup]:
    """Every tensor of the model as transformers names it (MTP layers apart)."""
    h, layers = s.hidden_size, s.num_layers
    moe_layers = s.num_moe_layers
    groups = [TensorGroup("model.embed_tokens", "embeddings", s.vocab_size, h, 1, 1)]
    groups += _attention(s, layers)
    groups += _feed_forward(s, layers - moe_layers, moe_layers)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        groups.append(
            TensorGroup(
                f"model.layers.*.{norm}", "norms", h, None, layers, layers, True
            )
        )
    groups.append(TensorGroup("model.norm", "norms", h, None, 1, 1, True))
    if not s.tie_word_embeddings:
        groups.append(TensorGroup("lm_head", "embeddings", s.vocab_size, h, 1, 1))
    return groups


def mtp_tensors(s: ModelShape) -> list[TensorGroup]:
    """The multi-token-prediction layers' own tensors (embeddings and head shared):
    enorm, hnorm, eh_proj [H, 2H], a full decoder layer (MoE), its final norm."""
    n = s.num_mtp_layers
    if not n:
        return []
    h = s.hidden_size
    groups = [
        TensorGroup(f"mtp.{norm}", "norms", h, None, n, n, True)
        for norm in (
            "enorm",
            "hnorm",
            "input_layernorm",
            "post_attention_layernorm",
            "shared_head.norm",
        )
    ]
    groups.append(TensorGroup("mtp.eh_proj", "attention", h, 2 * h, n, n))
    return groups + _attention(s, n) + _feed_forward(s, 0, n)


# -- parameters ------------------------------------------------------------------------


def params_by_class(
    groups: Sequence[TensorGroup], active: bool = False
) -> dict[str, int]:
    """Parameters per tensor class (all of TENSOR_CLASSES, zeros included)."""
    out = dict.fromkeys(TENSOR_CLASSES, 0)
    for g in groups:
        out[g.tensor_class] += g.numel * (g.active if active else g.count)
    return out


# -- weight formats --------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    name: str
    kind: str  # "dense", "int" or "float"
    bits: int
    group_size: int | None = None  # int4: the recipe's group; None: per channel
    symmetric: bool = True

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"

    def group_for(self, in_features: int) -> int | None:
        """gpuagent.compress.recipes.WeightScheme.group_size_for, torch-free."""
        if self.group_size is None:
            return None
        group = self.group_size
        while group >= MIN_GROUP_SIZE and in_features % group:
            group //= 2
        if group < MIN_GROUP_SIZE:
            raise SizingError(
                f"{self.name}: in_features={in_features} is not a multiple of any "
                f"int4 group size vLLM's kernels take ({MIN_GROUP_SIZE} to "
                f"{self.group_size}); use w8a16 (per channel) for this model"
            )
        return group


def weight_format(name: str) -> WeightFormat:
    """bf16, fp8, w8a16, or w4a16-gN[-asym] (N in 32, 64, 128)."""
    if name == "bf16":
        return WeightFormat(name, "dense", 16)
    if name == "fp8":
        return WeightFormat(name, "float", 8)
    if name == "w8a16":
        return WeightFormat(name, "int", 8)
    if isinstance(name, str) and name.startswith("w4a16-g"):
        rest = name.removeprefix("w4a16-g")
        symmetric = not rest.endswith("-asym")
        rest = rest.removesuffix("-asym")
        if rest.isdigit() and int(rest) in INT4_GROUPS:
            return WeightFormat(name, "int", 4, int(rest), symmetric)
    raise SizingError(
        f"unknown weights format {name!r}; known: bf16, fp8, w8a16, w4a16-gN "
        f"(N in {', '.join(map(str, INT4_GROUPS))}, '-asym' for a zero point)"
    )


def linear_weight_bytes(fmt: WeightFormat, out_f: int, in_f: int) -> int:
    """Bytes one quantized Linear [out_f, in_f] takes in `fmt` (module docstring)."""
    if fmt.kind == "dense":
        return 2 * out_f * in_f
    if fmt.kind == "float":
        return out_f * in_f + 2 * out_f
    group = fmt.group_for(in_f)
    packed = 4 * out_f * math.ceil(in_f * fmt.bits / 32)
    scales = 2 * out_f * (in_f // group if group else 1)
    total = packed + scales + 16  # weight_shape: int64 [2]
    if not fmt.symmetric:
        total += 4 * math.ceil(out_f * fmt.bits / 32) * (in_f // group)
    return total


def group_bytes(
    g: TensorGroup, fmt: WeightFormat, keep_bf16: Sequence[str] = ()
) -> int:
    """Bytes of one instance of `g` in `fmt` (bf16 where the recipe ignores it, or
    its class is in `keep_bf16`)."""
    if g.quantizable and fmt.quantized and g.tensor_class not in keep_bf16:
        return linear_weight_bytes(fmt, g.out_features, g.in_features)
    return 2 * g.numel


def fp8_block_bytes(g: TensorGroup, block: tuple[int, int]) -> int:
    """Bytes of one instance of `g` as DeepSeek-V3 / Kimi K2 publish their weights
    (quant_method fp8, weight_block_size [bn, bk]): a Linear's `weight` e4m3 [N, K]
    and `weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)]; router gates,
    embeddings, head and norms bf16."""
    if not g.quantizable:
        return 2 * g.numel
    n, k = g.out_features, g.in_features
    return n * k + 4 * math.ceil(n / block[0]) * math.ceil(k / block[1])


@dataclass(frozen=True)
class WeightBytes:
    format: str
    total_bytes: int
    active_bytes_per_token: int  # weights read per token at batch 1 (decode)
    by_class: dict[str, int]
    replicated_bytes: int  # held whole by every tensor-parallel rank

    def per_device_bytes(self, devices: int, parallelism: str = "tensor") -> int:
        """What one of `devices` holds: tensor parallel, the split tensors' share
        and the replicated ones whole; data parallel (expert parallel), the routed
        experts' share and everything else whole."""
        if parallelism == "data":
            routed = self.by_class["routed_experts"]
            return self.total_bytes - routed + math.ceil(routed / devices)
        split = self.total_bytes - self.replicated_bytes
        return math.ceil(split / devices) + self.replicated_bytes


def weight_bytes(
    groups: Sequence[TensorGroup], fmt: WeightFormat, keep_bf16: Sequence[str] = ()
) -> WeightBytes:
    """The model's weights in `fmt`, the classes in `keep_bf16` left in bf16."""
    return _sum_bytes(groups, fmt.name, lambda g: group_bytes(g, fmt, keep_bf16))


def published_weight_bytes(
    groups: Sequence[TensorGroup], config: Mapping[str, Any]
) -> WeightBytes | None:
    """The checkpoint as published, where config.json says it is fp8 in blocks
    (DeepSeek-V3, Kimi K2); None for any other quantization_config or none."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(type(b) is int and 1 <= b <= MAX_CONFIG_INT for b in block)
    ):
        return None
    name = f"fp8-block{block[0]}x{block[1]} (published)"
    return _sum_bytes(groups, name, lambda g: fp8_block_bytes(g, tuple(block)))


def _sum_bytes(groups, name: str, bytes_of) -> WeightBytes:
    by_class = dict.fromkeys(TENSOR_CLASSES, 0)
    active = replicated = 0
    for g in groups:
        one = bytes_of(g)
        by_class[g.tensor_class] += one * g.count
        active += one * g.active
        replicated += one * g.count if g.replicated else 0
    return WeightBytes(name, sum(by_class.values()), active, by_class, replicated)


# -- KV cache --------------------------------------------------------------------------


def kv_vector_bytes(kv_dtype: str, dim: int) -> int:
    """Bytes of one cached head vector of `dim` values, its per-token scale included."""
    if kv_dtype == "bf16":
        return 2 * dim
    if kv_dtype == "fp8":
        return dim
    if kv_dtype == "int8":
        return dim + KV_TOKEN_SCALE_BYTES
    if kv_dtype in ("int4", "int4c"):
        return math.ceil(dim / 2) + KV_TOKEN_SCALE_BYTES
    raise SizingError(
        f"unknown KV cache dtype {kv_dtype!r}; known: {', '.join(KV_DTYPES)}"
    )


@dataclass(frozen=True)
class KVBytes:
    """Per token, all layers, the whole model (every head), unless named per layer."""

    kv_dtype: str
    bytes_per_token_per_layer: int
    bytes_per_token: int
    # MLA only: the expanded K/V a naive cache would hold, and latent / expanded
    expanded_bytes_per_token: int | None
    window_tokens: int  # newest tokens per sequence also kept in bf16 (engine)
    window_bytes_per_sequence: int
    static_bytes: int  # per-layer scales, whatever the number of tokens


def kv_dtypes(s: ModelShape) -> tuple[str, ...]:
    """The KV dtypes `s`'s architecture takes (KV_DTYPE_MODEL_TYPES)."""
    return tuple(
        d
        for d in KV_DTYPES
        if s.model_type in KV_DTYPE_MODEL_TYPES.get(d, (s.model_type,))
    )


def kv_bytes(s: ModelShape, kv_dtype: str) -> KVBytes:
    """KV bytes per token of `s` in `kv_dtype` (module docstring)."""
    if kv_dtype in KV_DTYPES and kv_dtype not in kv_dtypes(s):
        raise SizingError(
            f"{kv_dtype} KV is for model_type "
            f"{', '.join(KV_DTYPE_MODEL_TYPES[kv_dtype])}, not {s.model_type}"
        )
    window = KV_WINDOW_TOKENS.get(kv_dtype, 0)
    if s.is_mla:
        latent = s.kv_lora_rank + s.qk_rope_head_dim
        per_layer = kv_vector_bytes(kv_dtype, latent)
        expanded = s.num_heads * (
            kv_vector_bytes(kv_dtype, s.qk_nope_head_dim + s.qk_rope_head_dim)
            + kv_vector_bytes(kv_dtype, s.v_head_dim)
        )
        window_per_layer = 2 * latent * window
        static = KV_STATIC_SCALE_BYTES if kv_dtype == "fp8" else 0
    else:
        per_layer = 2 * s.num_kv_heads * kv_vector_bytes(kv_dtype, s.head_dim)
        expanded = None
        window_per_layer = 2 * 2 * s.num_kv_heads * s.head_dim * window
        static = 2 * s.num_kv_heads * KV_STATIC_SCALE_BYTES if kv_dtype == "fp8" else 0
        if kv_dtype == "int4c":
            static = s.num_kv_heads * s.head_dim * KV_KEY_MEAN_BYTES
    layers = s.num_layers
    return KVBytes(
        kv_dtype=kv_dtype,
        bytes_per_token_per_layer=per_layer,
        bytes_per_token=per_layer * layers,
        expanded_bytes_per_token=None if expanded is None else expanded * layers,
        window_tokens=window,
        window_bytes_per_sequence=window_per_layer * layers,
        static_bytes=static * layers,
    )


def kv_heads_per_rank(s: ModelShape, tp: int) -> int:
    """KV heads one tensor-parallel rank caches (vLLM replicates a head over the
    ranks when tp > kv heads); MLA's latent counts as one head held by every rank."""
    if s.is_mla:
        return 1
    return math.ceil(s.num_kv_heads / tp)


def kv_bytes_per_rank(s: ModelShape, kv: KVBytes, tp: int) -> tuple[int, int, int]:
    """(bytes per token, window bytes per sequence, static bytes) on one rank."""
    if s.is_mla:
        return kv.bytes_per_token, kv.window_bytes_per_sequence, kv.static_bytes
    share = kv_heads_per_rank(s, tp)
    n = s.num_kv_heads
    return (
        kv.bytes_per_token * share // n,
        kv.window_bytes_per_sequence * share // n,
        kv.static_bytes * share // n,
    )


# -- deployment ------------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    """What a release manager picks. `sessions`: concurrent sequences wanted at
    `context_tokens` each (for devices_needed)."""

    gpu_memory_gib: float
    devices: int = 1
    context_tokens: int = 32768
    sessions: int = 1
    weights: str = "bf16"
    kv_cache_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    activation_headroom_gib: float = 4.0
    parallelism: str = "tensor"
    keep_bf16: tuple[str, ...] = ()

    def check(self) -> None:
        """Raises SizingError naming every knob out of range."""
        problems = []
        if not 0 < self.gpu_memory_gib <= 4096:
            problems.append("gpu_memory_gib must be in (0, 4096]")
        if not 1 <= self.devices <= 1024:
            problems.append("devices must be in [1, 1024]")
        if not 1 <= self.context_tokens <= 2**24:
            problems.append("context_tokens must be in [1, 16777216]")
        if not 1 <= self.sessions <= 2**20:
            problems.append("sessions must be in [1, 1048576]")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append("gpu_memory_utilization must be in (0, 1]")
        if not 0 <= self.activation_headroom_gib < self.gpu_memory_gib:
            problems.append("activation_headroom_gib must be in [0, gpu_memory_gib)")
        unknown = sorted(set(self.keep_bf16) - set(KEEP_BF16_CLASSES))
        if unknown:
            problems.append(
                f"keep_bf16 takes {', '.join(KEEP_BF16_CLASSES)}, not "
                f"{', '.join(map(str, unknown))}"
            )
        if self.parallelism not in PARALLELISMS:
            problems.append(f"parallelism must be one of {', '.join(PARALLELISMS)}")
        if self.kv_cache_dtype not in KV_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}")
        try:
            weight_format(self.weights)
        except SizingError as e:
            problems.append(str(e))
        if problems:
            raise SizingError("; ".join(problems))


@dataclass(frozen=True)
class DevicePlan:
    """A deployment over `devices` GPUs: memory per device, capacity (tokens,
    sessions) of the whole deployment."""

    devices: int
    parallelism: str
    budget_bytes: int  # per device: gpu memory x utilization
    weight_bytes: int  # per device
    activation_headroom_bytes: int  # per device
    kv_budget_bytes: int  # per device, left for the KV cache (<= 0: does not fit)
    kv_bytes_per_token: int  # per device, every layer
    token_capacity: int  # the deployment's
    context_tokens: int
    sessions_at_context: int  # the deployment's
    fits_weights: bool
    valid_layout: bool  # tensor: the attention heads split over the devices
    note: str = ""


def plan_devices(
    s: ModelShape, weights: WeightBytes, kv: KVBytes, knobs: Knobs, devices: int
) -> DevicePlan:
    """`knobs` deployed on `devices` GPUs as `knobs.parallelism` says."""
    budget = int(knobs.gpu_memory_gib * GIB * knobs.gpu_memory_utilization)
    headroom = int(knobs.activation_headroom_gib * GIB)
    if knobs.parallelism == "data":
        on_device = weights.per_device_bytes(devices, "data")
        per_token, window, static = (
            kv.bytes_per_token,
            kv.window_bytes_per_sequence,
            kv.static_bytes,
        )
        replicas, valid = devices, True
    else:
        on_device = weights.per_device_bytes(devices)
        per_token, window, static = kv_bytes_per_rank(s, kv, devices)
        replicas, valid = 1, s.num_heads % devices == 0
    free = budget - on_device - headroom - static
    padded = math.ceil(knobs.context_tokens / VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    note = ""
    if not valid:
        note = f"{s.num_heads} attention heads do not split over {devices} devices"
    elif free <= 0:
        note = "the weights and the activation headroom do not fit"
    elif knobs.parallelism == "data" and s.n_routed_experts % devices:
        note = f"{s.n_routed_experts} experts do not split evenly over {devices}"
    return DevicePlan(
        devices=devices,
        parallelism=knobs.parallelism,
        budget_bytes=budget,
        weight_bytes=on_device,
        activation_headroom_bytes=headroom,
        kv_budget_bytes=free,
        kv_bytes_per_token=per_token,
        token_capacity=replicas * (max(free, 0) // per_token),
        context_tokens=knobs.context_tokens,
        sessions_at_context=replicas * (max(free, 0) // (padded * per_token + window)),
        fits_weights=free > 0,
        valid_layout=valid,
        note=note,
    )


def devices_needed(
    s: ModelShape, weights: WeightBytes, kv: KVBytes, knobs: Knobs
) -> DevicePlan | None:
    """The fewest devices (tensor: TP_CANDIDATES; data: any count) that hold
    `knobs.sessions` sequences of `knobs.context_tokens`; None if 64 do not."""
    counts = (
        TP_CANDIDATES
        if knobs.parallelism == "tensor"
        else range(1, MAX_DEVICES_NEEDED + 1)
    )
    for devices in counts:
        plan = plan_devices(s, weights, kv, knobs, devices)
        if plan.valid_layout and plan.sessions_at_context >= knobs.sessions:
            return plan
    return None


def vllm_command(s: ModelShape, knobs: Knobs, devices: int) -> tuple[list[str], str]:
    """(argv, note) of the vllm preset for this deployment; argv is empty (and the
    note says why) for a KV dtype vLLM does not offer. MoE models get
    --enable-expert-parallel: experts split over the ranks whole rather than each
    expert's matrices split, as vLLM recommends for DeepSeek-V3-class models; data
    parallelism renders tensor-parallel size 1 and --data-parallel-size."""
    template, kv_map = PRESETS["vllm"]
    if knobs.kv_cache_dtype not in kv_map:
        return [], (
            f"vLLM has no {knobs.kv_cache_dtype} KV cache (it offers "
            f"{', '.join(sorted(kv_map))}); serve it with the project's engine or "
            "pick fp8"
        )
    # a compressed folder, or dense weights with fp8 KV scales, has a
    # quantization_config (gpuagent.compress.checkpoint)
    quantized = knobs.weights != "bf16" or knobs.kv_cache_dtype == "fp8"
    values = {
        "model_dir": "MODEL_DIR",
        "host": "0.0.0.0",
        "port": "8000",
        "kv_cache_dtype": kv_map[knobs.kv_cache_dtype],
        "max_model_len": str(knobs.context_tokens),
        "gpu_memory_utilization": f"{knobs.gpu_memory_utilization:g}",
        "tensor_parallel_size": str(1 if knobs.parallelism == "data" else devices),
        "quantization_args": quantization_args(quantized),
        "served_model_names": ["MODEL_NAME"],
    }
    try:
        argv = render_command(template, values)
    except TemplateError as e:  # the preset and this module disagree: a bug
        raise SizingError(f"the vllm preset cannot be rendered: {e}") from e
    notes = []
    if knobs.parallelism == "data":
        argv += ["--data-parallel-size", str(devices)]
    if s.is_moe:
        argv.append("--enable-expert-parallel")
    if s.remote_code:
        notes.append(
            "config.json names remote code (auto_map), which the integrity gate "
            "refuses: serve the folder python -m gpuagent.models.import_published "
            "makes from it (no *.py, no auto_map, tokenizer.json), without "
            "--trust-remote-code"
            + (
                "; transformers has no config class for model_type kimi_k2 (the "
                "project's engine serves it)"
                if s.model_type == "kimi_k2"
                else ""
            )
        )
    if s.max_position_embeddings and knobs.context_tokens > s.max_position_embeddings:
        notes.append(
            f"--max-model-len {knobs.context_tokens} exceeds the config's "
            f"max_position_embeddings {s.max_position_embeddings}"
        )
    return argv, "; ".join(notes)


# -- the report ------------------------------------------------------------------------


@dataclass(frozen=True)
class SizingReport:
    model_type: str
    architecture: dict[str, Any]
    total_params: int
    active_params: int
    active_params_no_embeddings: int
    params_by_class: dict[str, int]
    active_params_by_class: dict[str, int]
    mtp_params: int
    weights: list[WeightBytes]
    # the checkpoint as its config.json says it ships (fp8 blocks), when it says so
    published_weights: WeightBytes | None
    kv: list[KVBytes]
    # sessions at context_tokens this deployment holds with each KV dtype
    sessions_by_kv_dtype: dict[str, int]
    knobs: Knobs
    deployment: DevicePlan
    devices_needed: DevicePlan | None
    vllm_argv: list[str]
    vllm_command: str
    vllm_note: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def size_deployment(config: Mapping[str, Any], knobs: Knobs) -> SizingReport:
    """The memory report of `config` (a config.json object) deployed as `knobs`
    says. Raises SizingError naming a bad config key or knob."""
    knobs.check()
    s = model_shape(config)
    groups = model_tensors(s)
    total = params_by_class(groups)
    active = params_by_class(groups, active=True)
    formats = list(REPORTED_WEIGHT_FORMATS)
    if knobs.weights not in formats:
        formats.append(knobs.weights)
    keep, weights, notes = knobs.keep_bf16, [], []
    for f in formats:
        try:
            weights.append(weight_bytes(groups, weight_format(f), keep))
        except SizingError as e:  # a width no int4 group divides
            if f == knobs.weights:
                raise
            notes.append(f"{f} not shown: {e}")
    chosen = next(w for w in weights if w.format == knobs.weights)
    kv = kv_bytes(s, knobs.kv_cache_dtype)  # refuses a dtype `s` does not take
    kvs = [kv_bytes(s, d) for d in kv_dtypes(s)]
    plan = plan_devices(s, chosen, kv, knobs, knobs.devices)
    needed = devices_needed(s, chosen, kv, knobs)
    argv, note = vllm_command(s, knobs, knobs.devices)
    if s.num_mtp_layers:
        notes.append(
            f"{s.num_mtp_layers} multi-token-prediction layer(s) in the checkpoint "
            "are not counted (loaded only for speculative decoding)"
        )
    architecture = {
        k: v for k, v in asdict(s).items() if k not in ("model_type", "remote_code")
    }
    architecture.update(
        attention="MLA" if s.is_mla else "GQA", num_moe_layers=s.num_moe_layers
    )
    return SizingReport(
        model_type=s.model_type,
        architecture=architecture,
        total_params=sum(total.values()),
        active_params=sum(active.values()),
        active_params_no_embeddings=sum(active.values()) - active["embeddings"],
        params_by_class=total,
        active_params_by_class=active,
        mtp_params=sum(g.numel * g.count for g in mtp_tensors(s)),
        weights=weights,
        published_weights=published_weight_bytes(groups, config),
        kv=kvs,
        sessions_by_kv_dtype={
            k.kv_dtype: plan_devices(
                s, chosen, k, knobs, knobs.devices
            ).sessions_at_context
            for k in kvs
        },
        knobs=knobs,
        deployment=plan,
        devices_needed=needed,
        vllm_argv=argv,
        vllm_command=shlex.join(argv),
        vllm_note=note,
        notes=notes,
    )


# -- CLI -------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def format_report(r: SizingReport) -> str:
    """The report as text for a terminal."""
    lines = [
        f"{r.model_type}: {r.total_params / 1e9:,.2f}B parameters, "
        f"{r.active_params / 1e9:,.2f}B active per token "
        f"({r.active_params_no_embeddings / 1e9:,.2f}B without embeddings/head)",
        "",
        f"{'class':<16}{'params':>18}{'active':>18}",
    ]
    for c in TENSOR_CLASSES:
        lines.append(
            f"{c:<16}{r.params_by_class[c]:>18,}{r.active_params_by_class[c]:>18,}"
        )
    if r.mtp_params:
        lines.append(f"{'(mtp, apart)':<16}{r.mtp_params:>18,}")
    rows = [*r.weights, *([r.published_weights] if r.published_weights else [])]
    width = max(len(w.format) for w in rows) + 2
    lines += ["", f"{'weights':<{width}}{'total':>14}{'active/token':>16}"]
    for w in rows:
        total, active = _gib(w.total_bytes), _gib(w.active_bytes_per_token)
        lines.append(f"{w.format:<{width}}{total:>14}{active:>16}")
    lines += [
        "",
        f"{'kv dtype':<10}{'bytes/token':>14}{'per layer':>11}{'expanded':>12}"
        f"{'sessions':>10}",
    ]
    for k in r.kv:
        expanded = (
            ""
            if k.expanded_bytes_per_token is None
            else f"{k.expanded_bytes_per_token:,}"
        )
        lines.append(
            f"{k.kv_dtype:<10}{k.bytes_per_token:>14,}{k.bytes_per_token_per_layer:>11,}"
            f"{expanded:>12}{r.sessions_by_kv_dtype[k.kv_dtype]:>10,}"
        )
    for title, p in (
        ("deployment", r.deployment),
        ("devices needed", r.devices_needed),
    ):
        lines.append("")
        if p is None:
            lines.append(
                f"{title}: {r.knobs.sessions} sessions of {r.knobs.context_tokens} "
                f"tokens do not fit on {MAX_DEVICES_NEEDED} devices"
            )
            continue
        lines.append(
            f"{title}: {p.devices} x {r.knobs.gpu_memory_gib:g} GiB "
            f"({p.parallelism} parallel), weights "
            f"{_gib(p.weight_bytes)}/device, KV {_gib(max(p.kv_budget_bytes, 0))}"
            f"/device, {p.token_capacity:,} tokens, {p.sessions_at_context:,} "
            f"sessions of {p.context_tokens:,}" + (f" ({p.note})" if p.note else "")
        )
    lines += ["", r.vllm_command or "(no vLLM command)"]
    lines += [n for n in (r.vllm_note, *r.notes) if n]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuagent.sizing",
        description="Size a deployment from a config.json alone.",
    )
    parser.add_argument("config", type=Path, help="a model's config.json")
    parser.add_argument("--gpu-memory-gib", type=float, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--context", type=int, default=32768, help="tokens")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--kv", default="bf16", choices=KV_DTYPES)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--activation-headroom-gib", type=float, default=4.0)
    parser.add_argument(
        "--keep-bf16",
        default="",
        help="comma-separated classes left in bf16: " + ", ".join(KEEP_BF16_CLASSES),
    )
    parser.add_argument(
        "--parallelism",
        default="tensor",
        choices=PARALLELISMS,
        help="tensor: one tensor-parallel group; data: data-parallel attention with "
        "expert parallelism (vLLM --data-parallel-size)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    from gpuagent.integrity.strict_json import Rejected, strict_json_loads

    try:
        config = strict_json_loads(args.config.read_text(encoding="utf-8"), 32)
    except (OSError, UnicodeDecodeError, ValueError, Rejected) as e:
        print(f"error: cannot read {args.config}: {e}", file=sys.stderr)
        return 2
    knobs = Knobs(
        gpu_memory_gib=args.gpu_memory_gib,
        devices=args.devices,
        context_tokens=args.context,
        sessions=args.sessions,
        weights=args.weights,
        kv_cache_dtype=args.kv,
        gpu_memory_utilization=args.gpu_memory_utilization,
        activation_headroom_gib=args.activation_headroom_gib,
        parallelism=args.parallelism,
        keep_bf16=tuple(c for c in args.keep_bf16.split(",") if c),
    )
    try:
        report = size_deployment(config, knobs)
    except SizingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        json.dumps(report.to_dict(), indent=2) if args.json else format_report(report)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
