"""KV-cache layouts measured beside the served ones, not served (issue 12): KIVI
int4, with and without the Hadamard rotation, simulated faithfully on a real model;
and int4 variants at the served int4's bytes (issue 33 item 4).

int4 variants (`int4_variant_layout`, names sim-int4[g][c]+wW[sS]): the served int4
(rotated, one float16 scale per head vector, D/2 code bytes) with

- g: the 16 Lloyd-Max levels of a unit Gaussian (`GAUSS16`) instead of the 16
  uniform ones, the scale searched as the served v2 writer searches it: a rotated
  head vector is near Gaussian (squared error -20% on Gaussian vectors);
- c: keys stored less their layer's key mean, RoPE'd to the key's position, and
  read back plus it (exact: only the quantization error changes). The mean is
  taken before RoPE over the engine's calibration text (`key_means`,
  `kv_calibration.CALIBRATION_TEXTS`, the first position left out) and is 65-89%
  of a key's energy on SmolLM2-135M (per layer), so the per-token scale spans a far
  smaller vector: key squared error 3-5x lower. The first position is stored as it
  is: centered, an attention sink's key (far from the mean, and read by every
  query) became the worst-stored key, and the KLD doubled (below). A constant
  offset after RoPE would need no add-back (softmax ignores a constant per query),
  but the mean sits in slowly rotating pairs that still turn 0.4-0.8 rad over 2k
  tokens, and a mean taken after RoPE on short text hurt.

Measured while choosing (tuning text, none of the held-out passages: 2100 tokens
of the project's README.md (tokens 2000-4100) and of kernels/paged_attention.py;
SmolLM2-135M vs bf16 KV, each query reading its newest W tokens in bf16, KLD / top-1;
a scratch harness with this module's attention, not a bench command):

=============================================  ================  ================
layout (all at the served int4's bytes)        README            paged_attention
=============================================  ================  ================
served int4 v2 + w18                           0.0149 / 92.04%   0.0177 / 91.85%
  keys quantized alone (values bf16)           0.0134 / 92.23%
  K and V less a static mean taken after RoPE  0.0250 / 89.66%   0.0256 / 90.71%
  SmoothAttention (k * s, q / s per RoPE pair,
  s = (rms q / rms k)^0.5; max: 0.0139 / 91.04%) 0.0144 / 92.04%  0.0176 / 91.76%
g: Gaussian levels + w18                       0.0123 / 92.81%   0.0144 / 92.38%
c, the first position centered too, + w18      0.0254 / 88.38%
c + w18 (sim-int4c+w18)                        0.0085 / 93.23%
served v2 + w17 + the first position in bf16   0.0150 / 91.42%
c + w17s1 (sim-int4c+w17s1)                    0.0071 / 93.14%
g + c + w17s1 (sim-int4gc+w17s1)               0.0062 / 94.66%
=============================================  ================  ================

Keys carry most of the served int4's error (values in bf16 remove a tenth of it);
query-aware channel scales barely help after the rotation; removing the keys'
common part is what pays. On the held-out passages: `gpuagent.benches.kv_long`.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", github.com/jy-yuan/KIVI), here at 4 bits, as its code stores it:

- keys per channel: each channel of a kv head gets its own minimum and scale over
  each group of G consecutive tokens (groups aligned at position 0);
- values per token: each token's head vector in groups of G channels (all D when
  D < G), a minimum and scale per group;
- asymmetric min/max: sixteen levels min + q * scale, q = round((x - min) / scale)
  in 0..15, scale = (max - min) / 15; min and scale stored as float16 (KIVI keeps
  them in the model's dtype), min rounded down and scale up so that every x of the
  group lies within the levels: |x - read| <= scale / 2;
- residual: keys stay bf16 until R of them have come (R a multiple of G), then all
  R are quantized at once; values stay bf16 for the newest R tokens (sliding). In a
  decode step the new token joins both residuals before attention and the flush
  comes after, so the query at position t reads keys p < R * floor(t / R) and
  values p < t - R quantized, every newer one in bf16.

`kivi_layout(32, 32)` is the layout with the unfilled group as the residual (R = G);
`kivi_layout(32, 128)` the paper's setting (G 32, R 128).

The simulation (`layout_logprobs`) runs the model densely, teacher-forced, with an
attention that reads K and V exactly as the layout would store them: the quantized
copy of a position dequantized to float32 where the query at t reads it quantized,
the bf16 copy where it reads the residual. Each query reads the cache as at its own
decode step, which is how the served windows are measured too
(`gpuagent.evaluate.inprocess`). Two layouts check the simulation against the
engine: `BF16` (nothing quantized, vs the engine's bf16 KV: only float summation
order differs; KLD 9e-6 on SmolLM2-135M, in the tests on the demo model) and
`served_int4_layout` (the engine's own int4 quantizer, `kernels.quantize_kv`,
rotated, with the served window; in every bench run beside the engine's int4).
int4 makes the second check noisy on a deep model: a code at a rounding boundary
flips with float summation order and the change grows through the layers. On
SmolLM2's 352-token Korean passage the engine's int4 KLD is 0.0087, the
simulation's 0.0089, and the simulation's with q/k/v from the engine's fused GEMM
instead 0.0085: the same spread, so no bias of the simulation shows.

Bytes per token, per layer and kv head (head_dim D, bf16 = 4 D for K and V): keys
D/2 + 4 D/G (a float16 min and scale per channel per group of G tokens), values D/2
+ 4 D/min(G, D) (per token per channel group), and one residual row per sequence of
R tokens of K and V in bf16 (4 R D bytes), spread over a 2k-token sequence, as the
served int4's window row is (`bench.amortized_bytes_ratio`): quantized storage
counted for every token, the residual row on top. D = 64, G = 32, R = 32: (80 + 4) /
256 = 0.328 of bf16; served int4 with its 18-token window: (68 + 2.25) / 256 = 0.274.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

import kernels
from gpuagent.engine import kv_int4c
from gpuagent.engine.cache import (
    kv_bytes_per_token,
    kv_sequence_extra_bytes,
    kv_window_bytes,
)
from gpuagent.engine.model import apply_rope, rope_cos_sin, rope_inv_freq
from kernels.kv_gauss import dequantize_gauss, quantize_gauss

LEVELS = 15  # int4: codes 0..15
_QUERY_CHUNK = 256  # queries per step of `layout_attention`
_SCALE_MIN = 2.0**-14  # the smallest normal float16: a constant group's scale
_SCALE_ROUND_UP = 1.0 + 2.0**-10


# The sequence length a sequence's fixed costs (its window row, the caches' static
# scales) are spread over when KV bytes per token are compared: a 2k-token sequence.
AMORTIZED_SEQ_TOKENS = 2048


def amortized_bytes_ratio(config: Any, kv_dtype: str, window: int) -> float:
    """KV bytes/token of `kv_dtype` with a `window`-token full-precision row vs
    bf16, the window row and the static scales spread over AMORTIZED_SEQ_TOKENS."""
    extra = kv_sequence_extra_bytes(config, kv_dtype, window)
    per_token = kv_bytes_per_token(config, kv_dtype) + extra / AMORTIZED_SEQ_TOKENS
    return per_token / kv_bytes_per_token(config, "bf16")


# ------------------------------------------------------------------- quantizer


def quantize_minmax(x: Tensor, dim: int, group: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 of x in groups of `group` along `dim` (x.shape[dim] a
    multiple of it): (codes uint8 like x, scale float16, minimum float16), scale and
    minimum shaped like x with `dim` divided by `group`."""
    x32 = x.float().movedim(dim, -1)
    grouped = x32.unflatten(-1, (-1, group))  # [..., groups, group]
    low = grouped.amin(-1)
    minimum = low.to(torch.float16)
    # rounded down, so that no x lies below the lowest level
    below = torch.full_like(minimum, -torch.inf)
    minimum = torch.where(
        minimum.float() > low, torch.nextafter(minimum, below), minimum
    )
    span = grouped.amax(-1) - minimum.float()
    scale = (span / LEVELS * _SCALE_ROUND_UP).clamp_min(_SCALE_MIN).to(torch.float16)
    y = (grouped - minimum.float()[..., None]) / scale.float()[..., None]
    codes = torch.floor(y + 0.5).clamp(0, LEVELS).to(torch.uint8)
    return (
        codes.flatten(-2).movedim(-1, dim),
        scale.movedim(-1, dim),
        minimum.movedim(-1, dim),
    )


def dequantize_minmax(
    codes: Tensor, scale: Tensor, minimum: Tensor, dim: int, group: int
) -> Tensor:
    """Inverse of `quantize_minmax`: float32 like `codes`."""
    grouped = codes.float().movedim(dim, -1).unflatten(-1, (-1, group))
    x = grouped * scale.float().movedim(dim, -1)[..., None]
    x = x + minimum.float().movedim(dim, -1)[..., None]
    return x.flatten(-2).movedim(-1, dim)


def kivi_keys(key: Tensor, group: int) -> Tensor:
    """Keys [n, KVH, D] as KIVI reads them once quantized, float32: per channel over
    each complete group of `group` tokens; the tokens of an unfilled last group are
    never read quantized and are returned as they are."""
    full = key.shape[0] // group * group
    out = key.float().clone()
    if full:
        stored = quantize_minmax(key[:full], 0, group)
        out[:full] = dequantize_minmax(*stored, 0, group)
    return out


def kivi_values(value: Tensor, group: int) -> Tensor:
    """Values [n, KVH, D] as KIVI reads them once quantized, float32: per token in
    groups of min(group, D) channels."""
    channels = min(group, value.shape[-1])
    if value.shape[-1] % channels:
        raise ValueError(f"head_dim {value.shape[-1]} is no multiple of {channels}")
    return dequantize_minmax(*quantize_minmax(value, -1, channels), -1, channels)


def int4_gauss_read(x: Tensor) -> Tensor:
    """Head vectors x [..., D] as int4 with the GAUSS16 levels reads them back,
    float32: the served "int4c" quantizer itself (`kernels.kv_gauss`: codes 0..15
    index the levels times one float16 scale per vector, the served int4's bytes;
    the scale absmax / 2.7326 * f for f in INT4_SCALE_FACTORS with the least squared
    error, each code the nearest level)."""
    return dequantize_gauss(*quantize_gauss(x))


def key_means(model, sequences: list[list[int]]) -> list[Tensor]:
    """Per layer, the mean [KVH, D] float32 of the keys before RoPE over
    `sequences`, their first positions left out: what the served int4c
    calibrates (`gpuagent.engine.kv_int4c.key_means`, the same function)."""
    return kv_int4c.key_means(model, sequences)


# --------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """A KV layout as the simulation reads it; `scheme` "kivi" (group, residual as
    in the module docstring), "int4" (the served per-token quantizer, `residual` its
    window) or "bf16" (nothing quantized)."""

    name: str
    scheme: str
    group: int = 0
    residual: int = 0
    rotate: bool = False
    # The first `sinks` positions of a sequence kept in bf16 too (attention sinks,
    # StreamingLLM / IntactKV): every query reads them full precision.
    sinks: int = 0
    # int4 only: "uniform" (the served levels) or "gauss" (GAUSS16, same bytes)
    levels: str = "uniform"
    # Keys stored less the RoPE'd static key mean of their layer (`key_means`),
    # added back on read: exact, and the mean is 65-89% of a key's energy on
    # SmolLM2-135M, so the per-token int4 scale spans a far smaller vector. The
    # first position is stored as it is: an attention sink's key is far from the
    # mean, and centering it made it the worst-stored key of all (module docstring).
    center_keys: bool = False

    def stored(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """K, V [n, KVH, D] float32 as read back from the quantized storage."""
        if self.scheme == "kivi":
            return kivi_keys(key, self.group), kivi_values(value, self.group)
        if self.scheme == "int4" and self.levels == "gauss":
            return int4_gauss_read(key), int4_gauss_read(value)
        if self.scheme == "int4":
            return tuple(
                kernels.dequantize_kv(*kernels.quantize_kv(x, "int4"), "int4")
                for x in (key, value)
            )
        return key.float(), value.float()

    def quantized_below(self, n: int) -> tuple[Tensor, Tensor]:
        """Per query t of 0..n-1: key positions p < keys[t] and value positions
        p < values[t] are read quantized, the rest in bf16 ([n] int64 each)."""
        t = torch.arange(n)
        if self.scheme == "kivi":
            return t // self.residual * self.residual, t - self.residual
        if self.scheme == "int4":
            return t + 1 - self.residual, t + 1 - self.residual
        return torch.zeros_like(t), torch.zeros_like(t)

    def read(self, key: Tensor, value: Tensor, t: int) -> tuple[Tensor, Tensor]:
        """K, V [t+1, KVH, D] float32 as the query at position t reads them: the
        slow, one-step form of what `layout_attention` does for every t at once."""
        stored_key, stored_value = self.stored(key, value)
        key_below, value_below = (int(b[t]) for b in self.quantized_below(t + 1))
        out = []
        for x, stored, below in (
            (key, stored_key, key_below),
            (value, stored_value, value_below),
        ):
            read = x[: t + 1].to(torch.bfloat16).float()
            below = max(below, 0)
            read[self.sinks : below] = stored[self.sinks : below]
            out.append(read)
        return out[0], out[1]

    def bytes_ratio(self, config, num_tokens: int = AMORTIZED_SEQ_TOKENS) -> float:
        """KV bytes/token vs bf16, the residual (window) row and the sinks spread
        over a `num_tokens`-token sequence (int4: as the served int4's)."""
        if self.scheme == "bf16":
            return 1.0
        dim = config.head_dim
        full_precision = 4 * (self.residual + self.sinks) * dim / num_tokens
        if self.center_keys:  # the float32 key means, counted as fp8's scales are
            full_precision += 4 * dim / num_tokens
        if self.scheme == "int4":
            # K and V of one kv head in one layer
            quantized = kv_bytes_per_token(config, "int4") / _kv_heads_layers(config)
            return (quantized + full_precision) / (4 * dim)
        key = dim / 2 + 4 * dim / self.group
        value = dim / 2 + 4 * dim / min(self.group, dim)
        return (key + value + full_precision) / (4 * dim)


def _kv_heads_layers(config) -> int:
    return config.num_key_value_heads * config.num_hidden_layers


def kivi_layout(group: int, residual: int, rotate: bool = False) -> Layout:
    """KIVI int4 with key groups of `group` tokens and a `residual` of tokens in
    bf16 (a multiple of `group`); `rotate`: K and V in the Hadamard basis first."""
    if residual % group:
        raise ValueError(f"KIVI's residual {residual} must be a multiple of {group}")
    name = f"kivi-g{group}r{residual}" + ("+rot" if rotate else "")
    return Layout(name, "kivi", group, residual, rotate)


def served_int4_layout(window: int) -> Layout:
    """The served int4 (rotated, per-token int4, a `window` of bf16 tokens)."""
    return Layout(f"sim-int4+w{window}", "int4", residual=window, rotate=True)


BF16 = Layout("sim-bf16", "bf16")


def sink_int4_layout(window: int, sinks: int) -> Layout:
    """The served int4 with its `window` and the first `sinks` positions in bf16."""
    return Layout(f"sim-int4+w{window}s{sinks}", "int4", 0, window, True, sinks)


def int4_variant_layout(
    window: int, sinks: int = 0, gauss: bool = False, center_keys: bool = False
) -> Layout:
    """The served int4 (rotated, per-token scale) with the GAUSS16 levels (`gauss`,
    name "int4g") and/or keys centered on their RoPE'd layer mean (`center_keys`,
    "int4c"), a `window` and `sinks` in bf16: the same bytes per token."""
    name = "sim-int4" + ("g" if gauss else "") + ("c" if center_keys else "")
    name += f"+w{window}" + (f"s{sinks}" if sinks else "")
    levels = "gauss" if gauss else "uniform"
    return Layout(name, "int4", 0, window, True, sinks, levels, center_keys)


def named_layout(name: str) -> Layout:
    """A layout by the name it prints: sim-bf16, sim-int4+wW, sim-int4+wWsS,
    sim-int4g+wW[sS], sim-int4c+wW[sS], sim-int4gc+wW[sS], kivi-gGrR,
    kivi-gGrR+rot."""
    if name == BF16.name:
        return BF16
    if match := re.fullmatch(r"sim-int4\+w(\d+)(?:s(\d+))?", name):
        window, sinks = int(match[1]), int(match[2] or 0)
        return sink_int4_layout(window, sinks) if sinks else served_int4_layout(window)
    if match := re.fullmatch(r"sim-int4(g?)(c?)\+w(\d+)(?:s(\d+))?", name):
        window, sinks = int(match[3]), int(match[4] or 0)
        return int4_variant_layout(window, sinks, bool(match[1]), bool(match[2]))
    if match := re.fullmatch(r"kivi-g(\d+)r(\d+)(\+rot)?", name):
        return kivi_layout(int(match[1]), int(match[2]), bool(match[3]))
    raise ValueError(f"unknown layout {name!r}")


def int4_window_at_bytes(config, bytes_ratio: float) -> int:
    """The longest window the served int4 can keep within `bytes_ratio` of bf16
    (window row spread over a 2k-token sequence)."""
    bf16 = kv_bytes_per_token(config, "bf16")
    spare = bytes_ratio * bf16 - kv_bytes_per_token(config, "int4")
    per_window_token = kv_window_bytes(config, 1) / AMORTIZED_SEQ_TOKENS
    return max(0, int(spare / per_window_token + 1e-9))


def measured_layouts(config, int4_window: int) -> list[Layout]:
    """What the bench measures: the served int4 simulated (`int4_window`, the check
    of the simulation), KIVI G 32 with R 32 with and without the rotation, KIVI at
    the paper's R 128, and the served int4 with the window KIVI G 32 R 32's bytes
    buy (its quality at KIVI's bytes)."""
    kivi = kivi_layout(32, 32)
    return [
        served_int4_layout(int4_window),
        kivi,
        kivi_layout(32, 32, rotate=True),
        kivi_layout(32, 128),
        served_int4_layout(int4_window_at_bytes(config, kivi.bytes_ratio(config))),
    ]


# ------------------------------------------------------------------ simulation


def layout_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    softmax_scale: float,
    layout: Layout,
    key_offset: Tensor | None = None,
) -> Tensor:
    """Causal attention [n, H, D] float32 of query [n, H, D] over key/value
    [n, KVH, D], the query at t reading each position as `layout` stores it then;
    `key_offset` [n, KVH, D]: what each key is stored less of (and read plus)."""
    n, heads, dim = query.shape
    if layout.rotate:
        rotation = kernels.hadamard(dim, query.device)  # [D, D], symmetric
        out = layout_attention(
            query.float() @ rotation,
            key.float() @ rotation,
            value.float() @ rotation,
            softmax_scale,
            replace(layout, rotate=False),
            None if key_offset is None else key_offset.float() @ rotation,
        )
        return out @ rotation.T
    kv_heads = key.shape[1]
    if key_offset is None:
        stored_key, stored_value = layout.stored(key, value)
    else:
        stored_key, stored_value = layout.stored(key.float() - key_offset, value)
        stored_key = stored_key + key_offset
    # what a bf16 read adds to the quantized one: [n, KVH, D]
    delta_key = key.to(torch.bfloat16).float() - stored_key
    delta_value = value.to(torch.bfloat16).float() - stored_value
    key_below, value_below = (b.to(query.device) for b in layout.quantized_below(n))
    pos = torch.arange(n, device=query.device)
    # kv head k serves query heads k * groups .. (k + 1) * groups - 1
    q = query.float().unflatten(1, (kv_heads, heads // kv_heads))  # [n, KVH, G, D]
    out = torch.empty(n, heads, dim, device=query.device)
    for start in range(0, n, _QUERY_CHUNK):
        end = min(n, start + _QUERY_CHUNK)
        chunk = q[start:end]
        scores = torch.einsum("tkgd,pkd->kgtp", chunk, stored_key[:end])
        # Columns any query of the chunk reads in bf16: the sinks and, the limits
        # never decreasing with t, everything from the chunk's first limit on.
        first = max(0, min(int(key_below[start]), int(value_below[start])))
        cols = torch.cat(
            (
                torch.arange(min(layout.sinks, first), device=pos.device),
                torch.arange(first, end, device=pos.device),
            )
        )
        sink = cols[None, :] < layout.sinks  # [1, c]
        bf16_key = (cols[None, :] >= key_below[start:end, None]) | sink  # [t, c]
        bf16_value = (cols[None, :] >= value_below[start:end, None]) | sink
        fix = torch.einsum("tkgd,pkd->kgtp", chunk, delta_key[cols])
        scores[..., cols] += fix * bf16_key
        scores = scores * softmax_scale
        causal = pos[None, :end] > pos[start:end, None]  # [t, p]
        probs = torch.softmax(scores.masked_fill(causal, -torch.inf), dim=-1)
        read = torch.einsum("kgtp,pkd->tkgd", probs, stored_value[:end])
        read += torch.einsum(
            "kgtp,pkd->tkgd", probs[..., cols] * bf16_value, delta_value[cols]
        )
        out[start:end] = read.flatten(1, 2)
    return out


def layout_logprobs(
    model, token_ids: list[int], layout: Layout, means: list[Tensor] | None = None
) -> Tensor:
    """Log-probs [n, vocab] float32 of the next token at every position of
    `token_ids` (positions 0..n-1), every layer attending through `layout`
    (`means`: `key_means` per layer, for a layout that centers keys)."""
    if layout.center_keys and means is None:
        raise ValueError(f"{layout.name} centers keys: it needs the key means")
    return _forward(model, token_ids, layout, means)


def _forward(
    model,
    token_ids: list[int],
    layout: Layout,
    means: list[Tensor] | None = None,
) -> Tensor:
    config = model.config
    device = next(model.parameters()).device
    heads, kv_heads, dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    n = len(token_ids)
    positions = torch.arange(n, device=device)
    cos, sin = rope_cos_sin(rope_inv_freq(config).to(device), positions)  # [n, 1, D]
    with torch.inference_mode():
        h = model.embed_tokens(torch.tensor(token_ids, device=device))  # [n, hidden]
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for index, layer in enumerate(model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(attn.q_proj(x).unflatten(-1, (heads, dim)), cos, sin)
            k = apply_rope(attn.k_proj(x).unflatten(-1, (kv_heads, dim)), cos, sin)
            v = attn.v_proj(x).unflatten(-1, (kv_heads, dim))  # [n, KVH, D]
            offset = None
            if layout.center_keys:
                mean = means[index].to(h.dtype).expand(n, kv_heads, dim)
                offset = apply_rope(mean, cos, sin)
                offset[0] = 0  # the first position (a sink) is stored as it is
            out = layout_attention(q, k, v, attn.softmax_scale, layout, offset)
            h = h + attn.o_proj(out.to(h.dtype).flatten(-2))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = model.lm_head(model.norm(h)).float()  # [n, vocab]
    return torch.log_softmax(logits, dim=-1)
