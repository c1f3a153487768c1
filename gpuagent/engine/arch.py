"""The mixture-of-experts architectures beside Llama: `deepseek_v3` and `kimi_k2`
(DeepseekV3ForCausalLM: MLA attention, `gpuagent.engine.mla`) and `glm4_moe`
(Glm4MoeForCausalLM: GQA with partial rotary, optional qk norm and q/k/v bias),
both with `first_k_dense_replace` dense MLP layers and then MoE layers
(`gpuagent.engine.moe`).

`MoEConfig.from_hf_config` reads a `config.json` as the published checkpoints and
transformers 5 write it, refusing by name what this engine doesn't implement;
`MoETransformer` has the same interface as `model.Transformer` (`forward` over the
paged cache, `forward_dense` without one), so the engine, scheduler and cache
manager run it unchanged. The loader picks the class by `model_type`
(`config_for`, `build_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gpuagent.engine.mla import MLAAttention
from gpuagent.engine.model import (
    Attention,
    AttentionMetadata,
    Linear,
    LlamaConfig,
    RMSNorm,
    Transformer,
    apply_rope,
    rope_cos_sin,
)
from gpuagent.engine.moe import MoE, RouterConfig, swiglu

if TYPE_CHECKING:
    from gpuagent.engine.routing import RoutingRecorder
    from kernels.kv_quant import PagedKVCache

MOE_MODEL_TYPES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    # Kimi K2's text model: DeepSeek-V3's architecture and tensor names under its
    # own model_type (Moonshot's note: engines without it may read it as deepseek_v3)
    "kimi_k2": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
SUPPORTED_MODEL_TYPES = ("llama", *MOE_MODEL_TYPES)
MOE_ROPE_TYPES = ("default", "yarn")
# kept in float32 whatever the model dtype, as transformers keeps them
FP32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


@dataclass
class MoEConfig:
    """The subset of a DeepSeek-V3 / GLM-4.5 `config.json` these models need."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # GQA head size; for MLA qk_rope_head_dim, as transformers sets
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "yarn", ...} or None
    rotary_dim: int = 0  # dims of each head RoPE rotates
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    # multi-token-prediction layers after the decoder in the checkpoint (not run)
    num_nextn_predict_layers: int = 0
    # glm4_moe
    use_qk_norm: bool = False
    # deepseek_v3 (MLA)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rotary_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dims {self.rotary_dim} must be even for RoPE")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                f"[0, num_hidden_layers]"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} is negative")
        _ = self.router  # validates the routing numbers

    @property
    def router(self) -> RouterConfig:
        return RouterConfig(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    @property
    def is_mla(self) -> bool:
        return bool(self.kv_lora_rank)

    @property
    def softmax_scale(self) -> float:
        """MLA's score scale: (qk head dim)^-1/2, times YaRN's mscale^2 when the
        rope config has mscale_all_dim (DeepSeek-V3's long-context correction)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        mscale_all_dim = (self.rope_scaling or {}).get("mscale_all_dim")
        if mscale_all_dim:
            mscale = _yarn_mscale(self.rope_scaling["factor"], mscale_all_dim)
            scale *= mscale * mscale
        return scale

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoEConfig:
        """Build from a `config.json` dict; ValueError for what isn't implemented."""
        model_type = cfg.get("model_type")
        if model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a MoE architecture")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        # DeepSeek's original config names its routing choices; only V3's exists here
        for key, want in (
            ("scoring_func", "sigmoid"),
            ("topk_method", "noaux_tc"),
            ("moe_layer_freq", 1),
        ):
            if key in cfg and cfg[key] != want:
                raise ValueError(f"{key}={cfg[key]!r} is not supported (need {want!r})")

        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in MOE_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {rope_type!r}; supported: {MOE_ROPE_TYPES}"
            )
        partial = rope.pop("partial_rotary_factor", None)
        rope_scaling = rope if rope_type != "default" else None
        if rope_scaling is not None:
            rope_scaling["rope_type"] = rope_type
            rope_scaling.pop("type", None)
            missing = [k for k in ("factor", "original_max_position_embeddings")]
            missing = [k for k in missing if rope_scaling.get(k) is None]
            if missing:
                raise ValueError(f"rope_scaling 'yarn' lacks {missing}")

        heads = cfg["num_attention_heads"]
        common = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            n_routed_experts=cfg["n_routed_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
            num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0,
        )
        if model_type == "glm4_moe":
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            if partial is None:
                partial = cfg.get("partial_rotary_factor", 0.5)
            return cls(
                **common,
                head_dim=head_dim,
                rotary_dim=int(head_dim * partial),
                use_qk_norm=bool(cfg.get("use_qk_norm", False)),
            )
        if partial not in (None, 1.0) or cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor is not supported for MLA")
        rope_dim = cfg["qk_rope_head_dim"]
        return cls(
            **common,
            head_dim=rope_dim,
            rotary_dim=rope_dim,
            kv_lora_rank=cfg["kv_lora_rank"],
            q_lora_rank=cfg.get("q_lora_rank"),
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=rope_dim,
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )


def config_for(hf_config: dict[str, Any]) -> LlamaConfig | MoEConfig:
    """Our config object for a `config.json` of any supported model type."""
    if hf_config.get("model_type") in MOE_MODEL_TYPES:
        return MoEConfig.from_hf_config(hf_config)
    return LlamaConfig.from_hf_config(hf_config)


def build_model(config: LlamaConfig | MoEConfig) -> nn.Module:
    """The (uninitialised) decoder for a config from `config_for`."""
    if isinstance(config, MoEConfig):
        return MoETransformer(config)
    return Transformer(config)


def extra_checkpoint_layer(name: str, config: LlamaConfig | MoEConfig) -> bool:
    """Whether `name` belongs to one of the `num_nextn_predict_layers`
    multi-token-prediction layers DeepSeek-V3 and GLM-4.5 ship after the decoder
    (layers num_hidden_layers ..), which serving without speculative decoding
    doesn't run (transformers skips them too). Layers past those stay unexpected."""
    if not isinstance(config, MoEConfig) or not name.startswith("model.layers."):
        return False
    index = name.split(".")[2]
    first = config.num_hidden_layers
    return (
        index.isdigit()
        and first <= int(index) < first + config.num_nextn_predict_layers
    )


# ---------------------------------------------------------------------------- RoPE


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_parameters(config: MoEConfig) -> tuple[Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, cos/sin scale): plain RoPE,
    or YaRN (NTK-by-parts interpolation between `beta_fast` and `beta_slow`
    rotations, attention factor from `factor`, `mscale`, `mscale_all_dim`)."""
    dim, base = config.rotary_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    pos_freqs = base**exponents  # [dim // 2]
    if config.rope_scaling is None:
        return 1.0 / pos_freqs, 1.0
    params = config.rope_scaling
    factor = float(params["factor"])
    original = params["original_max_position_embeddings"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times in the original span
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((index - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


# -------------------------------------------------------------------------- layers


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first cos.shape[-1] dims of each head, the rest passed through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


class GLMAttention(Attention):
    """GLM-4.5 attention: Llama's paged GQA (every KV dtype `model.Attention`
    takes) with q/k/v bias when `attention_bias`, RMSNorm of q and k per head when
    `use_qk_norm`, and RoPE on the first `rotary_dim` dims of each head."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        if config.attention_bias:
            hidden = config.hidden_size
            q_dim = self.num_heads * self.head_dim
            kv_dim = self.num_kv_heads * self.head_dim
            self.q_proj = nn.Linear(hidden, q_dim, bias=True)
            self.k_proj = nn.Linear(hidden, kv_dim, bias=True)
            self.v_proj = nn.Linear(hidden, kv_dim, bias=True)
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def prepack(self) -> bool:
        # q/k/v carry biases and norms: only o_proj takes the packed GEMM
        return self.o_proj.prepack() if isinstance(self.o_proj, Linear) else False

    def _qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return partial_rope(q, cos, sin), partial_rope(k, cos, sin), v


class MoEBlock(nn.Module):
    """One decoder layer: attention (MLA or GLM's GQA), then a dense MLP for the
    first `first_k_dense_replace` layers and a MoE after."""

    def __init__(self, config: MoEConfig, index: int) -> None:
        super().__init__()
        self.index = index
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = MLAAttention(config) if config.is_mla else GLMAttention(config)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        if index < config.first_k_dense_replace:
            self.mlp = swiglu(hidden, config.intermediate_size)
        else:
            self.mlp = MoE(
                hidden,
                config.moe_intermediate_size,
                config.n_shared_experts,
                config.router,
            )

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: PagedKVCache,
        attn: AttentionMetadata,
        out_rows: Tensor | None = None,
        routing: RoutingRecorder | None = None,
    ) -> Tensor:
        attn_out = self.self_attn(
            self.input_layernorm(x), cos, sin, cache, attn, out_rows
        )
        if out_rows is not None:
            x = x[out_rows]
        x = x + attn_out
        return x + self._mlp(self.post_attention_layernorm(x), routing)

    def forward_dense(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        routing: RoutingRecorder | None = None,
    ) -> Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin)
        return x + self._mlp(self.post_attention_layernorm(x), routing)

    def _mlp(self, x: Tensor, routing: RoutingRecorder | None) -> Tensor:
        if routing is None or not isinstance(self.mlp, MoE):
            return self.mlp(x)
        return self.mlp(x, lambda ids: routing.record(self.index, ids))


class MoETransformer(nn.Module):
    """DeepSeek-V3 / GLM-4.5 decoder with `model.Transformer`'s interface."""

    checkpoint_kv_scales: list[tuple[Tensor, Tensor]] | None = None

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            MoEBlock(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # out of the state dict and of .to(dtype): angles are computed in float32
        self._inv_freq, self._rope_scale = rope_parameters(config)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # cos, signed sin [T, 1, rotary_dim] in the model's dtype, YaRN-scaled
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        cos, sin = rope_cos_sin(self._inv_freq, positions)
        dtype = self.embed_tokens.weight.dtype
        scale = self._rope_scale
        return (cos * scale).to(dtype), (sin * scale).to(dtype)

    def forward(
        self,
        input_ids: Tensor,  # [T]
        positions: Tensor,  # [T]
        kv_caches: list[PagedKVCache],
        attn: AttentionMetadata,
        all_logits: bool = False,
        routing: RoutingRecorder | None = None,
    ) -> Tensor:
        """Logits float32 [B, vocab] for each seq's last new token, or [T, vocab].

        `routing`: where each MoE layer records its router's expert ids (None:
        nothing recorded). With `all_logits` every token's; without, the last
        layer routes (and records) only each sequence's last new token."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} caches, got {len(kv_caches)}")
        h = self.embed_tokens(input_ids)
        cos, sin = self._rope(positions)
        last = None
        if not all_logits and not attn.decode_only:
            last = attn.query_start_loc[1:].long() - 1
        final = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(h, cos, sin, cache, attn, last if i == final else None, routing)
        return self.lm_head(self.norm(h)).float()

    def forward_dense(
        self, tokens: Tensor, routing: RoutingRecorder | None = None
    ) -> Tensor:
        """Causal logits float32 [B, T, vocab] for tokens [B, T], positions 0..T-1;
        `routing` records each MoE layer's expert ids of the B * T tokens, row
        b * T + t for token t of sequence b."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = self._rope(positions)
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer.forward_dense(h, cos, sin, routing)
        return self.lm_head(self.norm(h)).float()

    @property
    def moe_layers(self) -> list[int]:
        """The layers whose MLP routes experts (after first_k_dense_replace)."""
        return [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoE)]

    def prepack_cpu_weights(self) -> bool:
        """Pack the dense projections for oneDNN (see `model.prepack_weight`)."""
        if not isinstance(self.lm_head, Linear) or not self.lm_head.prepack():
            return False
        for layer in self.layers:
            layer.self_attn.prepack()
            layer.mlp.prepack()
        return True

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
