"""Activation-aware input-channel scaling (AWQ, Lin et al. 2024), folded into the
model before its projections are quantized.

A Linear's input channel k that carries large activations makes the rounding error
of column k of its weight count for more. Scaling the column up by s_k and the
input down by s_k leaves the product unchanged, W x = (W diag(s)) (diag(s)^-1 x),
but shrinks that column's share of the error after quantization. As AWQ: s =
mean|x|^alpha over the calibration inputs (normalised so that max * min = 1), alpha
searched on a grid per group of projections that share an input, by the output
error of those projections quantized round-to-nearest on the calibration inputs;
alpha = 0 (no scaling) is on the grid, so the search never picks worse than none.

The division by s is folded into what produces the input, so the checkpoint is an
ordinary model (its norm weights and the scaled rows differ from the source's):

- q / k / v: `input_layernorm.weight` / s;
- gate / up: `post_attention_layernorm.weight` / s;
- down: the rows of `up_proj` / s (act(gate) * up is linear in up). Scaling a row
  changes nothing in how up_proj itself quantizes (one scale per row or per group
  of a row).

o_proj is left alone: with grouped-query attention its input channels are
v_proj's rows repeated over the query heads of a kv head, so one s per v channel
would be shared across o_proj's columns (AWQ's own code skips o_proj then too).
The projections then go through RTN or GPTQ as the recipe says. The search scores
with min-max scales whatever the recipe's observer: the "mse" observer's 41
candidate ranges per row would multiply the search's rounding cost by 41, and it
refines the scales of the projections the search has already balanced.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from gpuagent.compress.calibration import run_layer
from gpuagent.compress.checkpoint import DENSE_DTYPE
from gpuagent.compress.quantize import quantize_rtn
from gpuagent.compress.recipes import WeightScheme

# (what produces the input, the projections that read it), per decoder layer
SCALED_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)
ALPHAS = tuple(i / 20 for i in range(11))  # 0, 0.05, ..., 0.5
# Calibration rows the search multiplies (a seeded sample of all tokens).
SEARCH_ROWS = 2048


def group_inputs(layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor):
    """{first projection of each group: its inputs [rows, K] float32} over a
    seeded sample of `SEARCH_ROWS` of the calibration tokens of `hidden`."""
    captured: dict[str, list[Tensor]] = {
        projections[0]: [] for _, projections in SCALED_GROUPS
    }
    run_layer(
        layer,
        hidden,
        cos,
        sin,
        {
            name: lambda x, rows=rows: rows.append(
                x.detach().reshape(-1, x.shape[-1]).float()
            )
            for name, rows in captured.items()
        },
    )
    out = {}
    for name, rows in captured.items():
        x = torch.cat(rows)
        if x.shape[0] > SEARCH_ROWS:
            pick = torch.randperm(
                x.shape[0], generator=torch.Generator().manual_seed(0)
            )
            x = x[pick[:SEARCH_ROWS]]
        out[name] = x
    return out


def channel_scales(mean_abs: Tensor, alpha: float) -> Tensor:
    """s = mean|x|^alpha, normalised so that max(s) * min(s) = 1."""
    s = mean_abs.clamp_min(1e-5).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def search_scales(
    x: Tensor, weights: list[Tensor], scheme: WeightScheme
) -> tuple[Tensor, float]:
    """(s [K], alpha) of the grid that gives the least output error of `weights`
    (each [N, K]) quantized RTN after scaling, on inputs x [rows, K]."""
    mean_abs = x.abs().mean(0)
    reference = [x @ w.t() for w in weights]
    scheme = dataclasses.replace(scheme, observer="minmax")  # module docstring
    best: tuple[float, Tensor, float] | None = None
    for alpha in ALPHAS:
        s = channel_scales(mean_abs, alpha)
        scaled_x = x / s
        error = sum(
            (scaled_x @ quantize_rtn(w * s, scheme).dequantize().t() - ref)
            .pow(2)
            .mean()
            .item()
            for w, ref in zip(weights, reference, strict=True)
        )
        if best is None or error < best[0]:
            best = (error, s, alpha)
    assert best is not None
    return best[1], best[2]


def scale_layer(
    layer: nn.Module, hidden: Tensor, cos: Tensor, sin: Tensor, scheme: WeightScheme
) -> dict[str, float]:
    """Search and fold the scales of every group of `layer` (its output is
    unchanged up to rounding); returns the alpha picked per group."""
    inputs = group_inputs(layer, hidden, cos, sin)
    picked = {}
    with torch.no_grad():
        for producer, projections in SCALED_GROUPS:
            modules = [layer.get_submodule(p) for p in projections]
            weights = [m.weight.detach().float() for m in modules]
            s, alpha = search_scales(inputs[projections[0]], weights, scheme)
            picked[projections[0]] = alpha
            if alpha == 0:
                continue
            source = layer.get_submodule(producer)
            if source.weight.dim() == 1:  # a norm's weight [K], stored dense
                s = _fold_into_norm(source.weight, s)
            else:  # a projection's rows [K, in]
                source.weight.div_(s.to(source.weight.dtype)[:, None])
            for m in modules:
                m.weight.mul_(s.to(m.weight.dtype)[None, :])
    return picked


def _fold_into_norm(norm: Tensor, s: Tensor) -> Tensor:
    """Divide the norm's weight by s, rounded to what the checkpoint stores (bf16,
    a dense tensor), and return the scales that division really applied, for the
    projections' columns: their product with the stored norm stays the source's
    (the projections are quantized after, so their scaling costs no rounding)."""
    folded = (norm / s.to(norm.dtype)).to(DENSE_DTYPE).to(norm.dtype)
    applied = torch.where(folded != 0, norm / folded, s.to(norm.dtype))
    norm.copy_(folded)
    return applied.float()
