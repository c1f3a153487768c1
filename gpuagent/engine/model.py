"""Llama-family decoder in one file: RMSNorm, RoPE (plain or Llama-3 scaled), GQA,
SwiGLU MLP, tied or untied embeddings.

Two ways to run it:

- `Transformer.forward` — the serving path. Takes the new tokens of every sequence in
  the batch flattened into one `[T]` vector, writes their K/V into the paged cache
  through `kernels.write_kv` and attends over the cache with
  `kernels.paged_decode_attention` / `kernels.paged_prefill_attention`.
- `Transformer.forward_dense` — plain causal attention over `[B, T]` tokens with no
  cache; used for training the demo model and as a cross-check of the paged path.

Submodule names follow the Hugging Face Llama layout (`layers.N.self_attn.q_proj`, ...)
so a HF state dict maps onto this module by dropping the `model.` prefix.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import int4_cpu, int4_layer
from kernels.kv_quant import (
    CENTERED_DTYPES,
    allocate_kv_cache,
    hadamard,
    write_kv,
    write_window,
)
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention

if TYPE_CHECKING:
    from kernels.kv_quant import PagedKVCache

SUPPORTED_ROPE_TYPES = ("default", "llama3")
POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass
class AttentionMetadata:
    """Where the new tokens of one step go in the paged cache, and what they see."""

    slot_mapping: Tensor  # [T] int64, cache slot of each new token
    block_tables: Tensor  # [B, max_blocks] int32
    query_start_loc: Tensor  # [B+1] int32, seq b owns tokens qsl[b]:qsl[b+1]
    context_lens: Tensor  # [B] int32, tokens in cache per seq AFTER this step
    decode_only: bool  # every sequence has exactly one new token
    # A cache with a full-precision window: [T] int64 ring slot per new token (-1:
    # not among its sequence's newest) and [B] int32 window row per sequence.
    window_slots: Tensor | None = None
    window_rows: Tensor | None = None
    # int4c caches (engine.kv_int4c): [T] int64 position of each new token and the
    # RoPE inverse frequencies; `Transformer.forward` sets both
    positions: Tensor | None = None
    rope_inv_freq: Tensor | None = None


@dataclass
class LlamaConfig:
    """The subset of a HF Llama `config.json` this model needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    # None for plain RoPE, else {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get(
                "rope_type", self.rope_scaling.get("type")
            )
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}; "
                    f"supported: {SUPPORTED_ROPE_TYPES}"
                )
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if rope_type == "llama3" and missing:
                raise ValueError(f"rope_scaling {rope_type!r} lacks {missing}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Build from a HF `config.json` dict (transformers 4.x or 5.x layout).

        transformers 5 writes `rope_parameters` ({"rope_theta", "rope_type", ...});
        older checkpoints write `rope_theta` and `rope_scaling` separately. Both are
        read. Raises ValueError for features this model does not implement (biases,
        activations other than SiLU, rope types other than default/llama3).
        """
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"{flag}=true is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")

        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = rope if rope and rope_type != "default" else None

        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=cfg.get("eos_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict that transformers' LlamaForCausalLM accepts."""
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        rope_parameters.update(self.rope_scaling or {})
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            # both spellings, so transformers 4.x and 5.x read the same RoPE
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }


@functools.cache
def _rotation(dim: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    # one Hadamard matrix per (size, device, dtype), made once; a normal tensor even
    # when first asked for under inference_mode, so autograd callers can use it too
    with torch.inference_mode(False):
        return hadamard(dim, device).to(dtype)


# ---------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: LlamaConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] float32, Llama-3 scaled when configured."""
    dim = config.head_dim
    # always on the CPU, also when the module is built under torch.device("meta")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [dim // 2]
    if config.rope_scaling is None:
        return inv_freq
    return _llama3_scale_inv_freq(inv_freq, config.rope_scaling)


def _llama3_scale_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between is interpolated smoothly (same arithmetic as transformers, for parity).
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and signed sin [..., 1, head_dim] float32 for integer `positions` [...].

    The singleton axis broadcasts over heads. sin's first half is negated, which is
    the sign `rotate_half` would put on x's second half: `apply_rope` then needs no
    negation per layer, and the products are bit-for-bit the textbook ones.
    """
    freqs = positions.float()[..., None] * inv_freq  # [..., head_dim // 2]
    sin = freqs.sin()
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    signed_sin = torch.cat((-sin, sin), dim=-1)  # [..., head_dim]
    return emb.cos().unsqueeze(-2), signed_sin.unsqueeze(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., T, H, D] by cos / signed sin [..., T, 1, D] from
    `rope_cos_sin` (HF's non-interleaved layout: x * cos + rotate_half(x) * sin)."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1) [..., T, H, D]
    return x * cos + swapped * sin


# -------------------------------------------------------------------------- layers


def can_prepack(weight: Tensor) -> bool:
    """Whether `weight` can take oneDNN's prepacked GEMM (`prepack_weight`): a
    float32 CPU tensor, or a bfloat16 one where oneDNN has bf16 kernels (AVX-512
    BF16/AMX CPUs), on a torch built with oneDNN (the CPU builds are)."""
    if not (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def prepack_weight(weight: Tensor) -> Tensor | None:
    """`weight` [out, in] reordered once into oneDNN's blocked GEMM layout, or None
    where that path doesn't apply (not a float32/bfloat16 CPU tensor, torch without
    oneDNN). It then multiplies inputs of the weight's dtype.

    The multiply is the same GEMM as `F.linear`, minus re-laying the weight
    out on every call: 2-2.5x faster at decode batch sizes on AVX-512 CPUs, results
    equal to float32 rounding. The packed copy is a snapshot, so pack after the
    weights are final (the engine does, once, at start); the dense weights stay for
    the state dict and for training.
    """
    if not can_prepack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    """x [..., in] @ W^T -> [..., out] with W from `prepack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that runs through `packed_linear` once `prepack()`ed (the
    projections packed alone: o_proj, down_proj, lm_head; q/k/v and gate/up are
    packed fused by their modules)."""

    packed_weight: Tensor | None = None

    def prepack(self) -> bool:
        """Pack the weight (see `prepack_weight`); False where that doesn't apply."""
        if self.bias is None:
            self.packed_weight = prepack_weight(self.weight)
        return self.packed_weight is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed_weight is None or x.dtype != self.weight.dtype:
            return super().forward(x)
        return packed_linear(x, self.packed_weight)


def _dense(*modules: nn.Module) -> bool:
    # quantized layers (gpuagent.engine.weights.QuantLinear) replace nn.Linear
    return all(isinstance(m, nn.Linear) for m in modules)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # one op
        # normalize in float32 whatever the weight dtype, as transformers does
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.softmax_scale = config.head_dim**-0.5
        hidden, q_dim = config.hidden_size, self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = Linear(q_dim, hidden, bias=False)
        self.qkv_packed: Tensor | None = None  # [q_dim + 2 kv_dim, hidden], packed
        # int4 q/k/v fused for the CPU decode kernel (engine.weights.fuse_projections)
        self.qkv_int4: nn.Module | None = None

    def prepack(self) -> bool:
        """Pack q/k/v as one GEMM, and o_proj (CPU; see `prepack_weight`)."""
        if not _dense(self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            return False  # quantized projections (engine.weights) run their kernels
        qkv = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        self.qkv_packed = prepack_weight(torch.cat(qkv))  # [(H + 2 KVH) * D, hidden]
        return self.o_proj.prepack() and self.qkv_packed is not None

    def _qkv(
        self, x: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        # x [..., T, hidden] -> q [..., T, H, D], k/v [..., T, KVH, D], RoPE on q, k
        fused = self.qkv_int4
        if (self.qkv_packed is not None and x.dtype == self.q_proj.weight.dtype) or (
            fused is not None and fused.runs_int4_cpu(x)
        ):
            h, kvh = self.num_heads, self.num_kv_heads
            qkv = fused(x) if fused is not None else packed_linear(x, self.qkv_packed)
            qkv = qkv.unflatten(-1, (-1, self.head_dim))
            # [..., T, H + 2 KVH, D]: q and k rotate together, as one tensor
            q, k = apply_rope(qkv[..., : h + kvh, :], cos, sin).split((h, kvh), -2)
            return q, k, qkv[..., h + kvh :, :]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        cos: Tensor,  # [T, 1, D]
        sin: Tensor,
        cache: PagedKVCache,
        attn: AttentionMetadata,
        out_rows: Tensor | None = None,  # [B] rows to compute; None: all T
    ) -> Tensor:
        q, k, v = self._qkv(x, cos, sin)  # [T, H, D], [T, KVH, D], [T, KVH, D]
        if cache.dtype in CENTERED_DTYPES:  # engine.kv_int4c writes and attends
            from gpuagent.engine import kv_int4c  # imports this module

            scale = self.softmax_scale
            out = kv_int4c.attention(q, k, v, cache, attn, scale, out_rows)
            return self.o_proj(out.to(x.dtype).flatten(-2))
        rotation = None
        if cache.rotated:
            # The cache holds K and V in the Hadamard basis (kernels.kv_quant):
            # q.k and the attention-weighted sum of V are the same there.
            rotation = _rotation(self.head_dim, q.device, q.dtype)  # [D, D]
            q, k, v = q @ rotation, k @ rotation, v @ rotation
        decode = out_rows is not None or attn.decode_only
        if cache.window and not decode:
            # Prefill reads the window row as it was before the chunk (each query
            # takes the chunk's own K/V from k, v): the row is written after.
            write_kv(cache, k, v, attn.slot_mapping, blocks_only=True)
        else:
            write_kv(cache, k, v, attn.slot_mapping, attn.window_slots)
        if decode:
            # Each kept row is its sequence's last new token, which sees the whole
            # context: that is decode attention. [B, H, D]
            out = paged_decode_attention(
                q if out_rows is None else q[out_rows],
                cache,
                attn.block_tables,
                attn.context_lens,
                self.softmax_scale,
                attn.window_rows,
            )
        else:
            out = paged_prefill_attention(
                q,
                cache,
                attn.block_tables,
                attn.query_start_loc,
                attn.context_lens,
                self.softmax_scale,
                attn.window_rows,
                k if cache.window else None,
                v if cache.window else None,
            )
            if cache.window:
                write_window(cache, k, v, attn.window_slots)
        if rotation is not None:
            out = out.to(x.dtype) @ rotation.T  # back from the rotated basis
        out = out.to(x.dtype).flatten(-2)  # [T or B, H, D] -> [T or B, H * D]
        return self.o_proj(out)

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # x [B, T, hidden], cos/sin [T, 1, D]
        q, k, v = self._qkv(x, cos, sin)  # [B, T, H, D], [B, T, KVH, D]
        groups = self.num_heads // self.num_kv_heads
        # kv head h // groups serves query head h
        k = k.repeat_interleave(groups, dim=2)  # [B, T, H, D]
        v = v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, H, T, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.softmax_scale,
        )  # [B, H, T, D]
        out = out.transpose(1, 2).flatten(-2)  # [B, T, H * D]
        return self.o_proj(out)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.gate_up_packed: Tensor | None = None  # [2 * inter, hidden], packed
        # int4 gate/up fused for the CPU decode kernel (engine.weights)
        self.gate_up_int4: nn.Module | None = None

    def prepack(self) -> bool:
        """Pack gate and up as one GEMM, and down (CPU; see `prepack_weight`)."""
        if not _dense(self.gate_proj, self.up_proj, self.down_proj):
            return False
        gate_up = torch.cat((self.gate_proj.weight, self.up_proj.weight))
        self.gate_up_packed = prepack_weight(gate_up)  # [2 * inter, hidden]
        return self.down_proj.prepack() and self.gate_up_packed is not None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_packed is not None and x.dtype == self.gate_proj.weight.dtype:
            # [..., 2 * inter] -> gate, up [..., inter]
            gate, up = packed_linear(x, self.gate_up_packed).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        fused = self.gate_up_int4
        if fused is not None and fused.runs_int4_cpu(x):
            gate, up = fused(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = FeedForward(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: PagedKVCache,
        attn: AttentionMetadata,
        out_rows: Tensor | None = None,  # [B] rows to compute; None: all T
    ) -> Tensor:
        # K/V of every token are written; only `out_rows` go on through the block.
        attn_out = self.self_attn(
            self.input_layernorm(x), cos, sin, cache, attn, out_rows
        )
        if out_rows is not None:
            x = x[out_rows]  # [B, hidden]
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


# A CPU step of at most this many new tokens runs its layers at
# `Transformer.small_step_threads` intra-op threads (see there).
SMALL_STEP_ROWS = 8


class Transformer(nn.Module):
    """Llama decoder: `forward` over the paged KV cache, `forward_dense` without one."""

    # Intra-op threads of the layers in a CPU step of at most SMALL_STEP_ROWS new
    # tokens (decode at small batch); the output head keeps torch's setting. None:
    # torch's setting throughout. A layer at decode is dozens of ops of microseconds
    # each, and every op that forks (oneDNN GEMMs, the CPU flash attention, which
    # forks whatever its size) ends in a barrier that waits for the slowest
    # thread: on a CPU shared with other processes, a descheduled thread makes each
    # barrier cost a time slice. SmolLM2 w4a16 at 2 threads on the shared 2-core
    # dev machine (load ~10): 683 ms/step forking everywhere, 173 with attention on
    # one thread, 108 with the layers on one thread.
    small_step_threads: int | None = 1
    # Whether the output head of such a step also runs at small_step_threads (the
    # final norm and head inside the narrow region). Off by default. SmolLM2 w4a16
    # at 2 threads on the shared 2-core machine, side by side
    # (`gpuagent.benches.llamacpp --head-ab`), same greedy tokens each time: 1.02x,
    # 1.31x, 1.58x and 2.02x faster in four runs, never slower; a dedicated machine
    # may well prefer the head at full threads (it reads 113 MB of float32 a step).
    small_step_head: bool = False

    # Each layer as one `kernels.int4_layer` call (`engine.weights.
    # int4_decode_layers`: a float32 model on a CPU whose projections are all int4
    # with the CPU kernel prepared), taken at the decode steps it applies to
    # (`_int4_decode_applies`); None: the torch layers always run.
    int4_decode: list[int4_layer.Int4DecodeLayer] | None = None

    # fp8 KV scales the checkpoint carries, (key_scale [KVH], value_scale [KVH]) per
    # layer (set by the loader; engine.kv_calibration), or None
    checkpoint_kv_scales: list[tuple[Tensor, Tensor]] | None = None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # Kept out of the state dict and out of module.to(dtype): RoPE angles must be
        # computed in float32 even for a bf16 model.
        self._inv_freq = rope_inv_freq(config)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # cos, signed sin [T, 1, D] in the model's dtype, computed once per forward
        # and shared by every layer
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        cos, sin = rope_cos_sin(self._inv_freq, positions)
        dtype = self.embed_tokens.weight.dtype
        return cos.to(dtype), sin.to(dtype)

    def forward(
        self,
        input_ids: Tensor,  # [T] int64, all new tokens of all seqs
        positions: Tensor,  # [T] int64
        kv_caches: list[PagedKVCache],  # one per layer
        attn: AttentionMetadata,
        all_logits: bool = False,
    ) -> Tensor:
        """Logits float32 [B, vocab] for each seq's last new token, or [T, vocab]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} caches, got {len(kv_caches)}")
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self._rope(positions)  # [T, 1, D] each
        if self._int4_decode_applies(h, kv_caches, attn):
            step = int4_layer.DecodeStep(
                cos, sin, attn.slot_mapping, attn.block_tables, attn.context_lens
            )
            scale = self.layers[0].self_attn.softmax_scale
            for layer, cache in zip(self.int4_decode, kv_caches, strict=True):
                int4_layer.decode(layer, h, step, cache.key, cache.value, scale)
            return self.lm_head(self.norm(h)).float()  # [B, vocab]
        if kv_caches and kv_caches[0].dtype in CENTERED_DTYPES:
            attn = replace(attn, positions=positions, rope_inv_freq=self._inv_freq)
        last = None  # [B] each sequence's last new token, when only those are wanted
        # (in a decode-only step every token is its sequence's last)
        if not all_logits and not attn.decode_only:
            last = attn.query_start_loc[1:].long() - 1
        final = len(self.layers) - 1
        threads = torch.get_num_threads()
        narrow = (
            self.small_step_threads is not None
            and input_ids.device.type == "cpu"
            and input_ids.numel() <= SMALL_STEP_ROWS
            and self.small_step_threads < threads
        )
        if narrow:
            torch.set_num_threads(self.small_step_threads)
        try:
            for i, (layer, cache) in enumerate(
                zip(self.layers, kv_caches, strict=True)
            ):
                # Past the last layer's K/V write only the logits' rows matter: a
                # prompt chunk's other rows skip its attention output, o_proj, MLP.
                h = layer(h, cos, sin, cache, attn, last if i == final else None)
            if narrow and self.small_step_head:
                return self.lm_head(self.norm(h)).float()  # [B or T, vocab]
        finally:
            if narrow:
                torch.set_num_threads(threads)
        return self.lm_head(self.norm(h)).float()  # [B or T, vocab]

    def _int4_decode_applies(
        self, h: Tensor, kv_caches: list[PagedKVCache], attn: AttentionMetadata
    ) -> bool:
        # a decode step (one new token a sequence, so every row's logits) of at
        # most MAX_ROWS float32 rows over a plain bf16 cache; int4_cpu.AVAILABLE
        # is what the benches switch off to time the reference
        cache = kv_caches[0] if kv_caches else None
        return (
            self.int4_decode is not None
            and int4_cpu.AVAILABLE
            and attn.decode_only
            and h.dtype == torch.float32
            and h.device.type == "cpu"
            and h.shape[0] <= int4_layer.MAX_ROWS
            and cache is not None
            and cache.dtype in int4_layer.CACHE_DTYPES
            and not cache.window
            and not cache.rotated
        )

    def forward_dense(self, tokens: Tensor) -> Tensor:
        """Causal logits float32 [B, T, vocab] for tokens [B, T], positions 0..T-1."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # [T]
        cos, sin = self._rope(positions)  # [T, 1, D]
        h = self.embed_tokens(tokens)  # [B, T, hidden]
        for layer in self.layers:
            h = layer.forward_dense(h, cos, sin)
        return self.lm_head(self.norm(h)).float()

    def prepack_cpu_weights(self) -> bool:
        """Pack every projection for oneDNN GEMMs (see `prepack_weight`), q/k/v and
        gate/up fused; False (nothing packed) off the CPU or for weights that are
        neither float32 nor (where oneDNN has bf16 kernels) bfloat16.
        Call it once the weights are final: the packed copies don't follow edits."""
        if not can_prepack(self.embed_tokens.weight):  # the model's dtype, device
            return False
        for layer in self.layers:
            layer.self_attn.prepack()
            layer.mlp.prepack()
        # a quantized head (engine.weights.quantize_head) runs its own kernel
        return self.lm_head.prepack() if _dense(self.lm_head) else True

    def num_parameters(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())


def allocate_kv_caches(
    config: LlamaConfig,
    kv_dtype: str,
    num_blocks: int,
    block_size: int,
    device: str | torch.device = "cpu",
) -> list[PagedKVCache]:
    """One `kernels.PagedKVCache` per layer, shaped for this model."""
    return [
        allocate_kv_cache(
            kv_dtype,
            num_blocks,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            device=device,
        )
        for _ in range(config.num_hidden_layers)
    ]
