"""Sign-gradient rounding (SignRound, the method of Intel's AutoRound: Cheng et al.
2024, "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of
LLMs") for the projections of one decoder layer.

Round-to-nearest rounds each weight on its own; here each weight gets a rounding
offset v in [-0.5, 0.5] (code = round(w / s + v)) and each group a shrink alpha in
[0.5, 1] of the scale the observer picked (s = alpha * s0), and the layer's seven
projections are tuned together, by signed gradient descent through a
straight-through rounding, so that the layer's output on the calibration inputs the
quantized layers before it produce comes close to the unquantized model's output at
that layer (each layer also makes up for the error that reaches it). As the paper:
`steps` steps of `BATCH` sequences drawn at random, learning rate 1 / steps decaying
linearly to 0, the offsets and shrinks of the step with the lowest loss kept.

The result is the same symmetric int format as round-to-nearest and GPTQ (codes
and bf16 scales, `QuantizedWeight`), read back by compressed-tensors and the
engine like any other; only the choice of codes and scales differs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from gpuagent.compress.checkpoint import PROJECTIONS
from gpuagent.compress.quantize import (
    SCALE_DTYPE,
    QuantizedWeight,
    code_range,
    group_params,
    stored_scale,
)
from gpuagent.compress.recipes import WeightScheme

DEFAULT_STEPS = 200
BATCH = 8  # sequences per step
MIN_SHRINK = 0.5


class _Rounding(nn.Module):
    """A weight's tunable rounding: offsets v [N, G, g] and shrinks alpha [N, G, 1]
    over the observer's scales s0 [N, G, 1]; as a parametrization, `forward(w)` is
    the weight the layer runs with (quantized and read back)."""

    def __init__(self, w: torch.Tensor, scheme: WeightScheme) -> None:
        super().__init__()
        n, k = w.shape
        self.group_size = scheme.group_size_for(k)
        group = self.group_size or k
        self.shape = (n, k // group, group)
        self.bits = scheme.bits
        self.lo, self.hi = code_range(scheme.bits, True)
        s0, _ = group_params(
            w.detach().view(self.shape), scheme.bits, True, scheme.observer
        )
        self.register_buffer("s0", s0)
        self.v = nn.Parameter(torch.zeros(self.shape))
        self.alpha = nn.Parameter(torch.ones_like(s0))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        s = self.s0 * self.alpha
        s = s + (stored_scale(s) - s).detach()  # as stored (bf16), straight-through
        x = w.view(self.shape) / s + self.v
        q = (x + (x.round() - x).detach()).clamp(self.lo, self.hi)  # straight-through
        return (q * s).view_as(w)

    @torch.no_grad()
    def quantized(self, w: torch.Tensor) -> QuantizedWeight:
        """The codes and stored scales of w under the current v and alpha."""
        scale = stored_scale(self.s0 * self.alpha)
        q = (w.view(self.shape) / scale + self.v).round().clamp(self.lo, self.hi)
        return QuantizedWeight(
            codes=q.view_as(w).to(torch.int8),
            scale=scale[..., 0].to(SCALE_DTYPE),
            zero_point=None,
            bits=self.bits,
            group_size=self.group_size,
        )


def tune_layer(
    layer: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scheme: WeightScheme,
    steps: int = DEFAULT_STEPS,
    seed: int = 0,
) -> dict[str, QuantizedWeight]:
    """Quantize the seven projections of `layer` (module docstring): `inputs`
    [B, T, hidden] are the quantized model's hidden states entering the layer,
    `targets` the unquantized model's leaving it. Each projection's weight is
    replaced by its quantized values; returns them by projection name."""
    if scheme.kind != "int" or not scheme.symmetric:
        raise ValueError("sign-gradient rounding takes symmetric int schemes only")
    frozen = [p for p in layer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    roundings = {}
    try:
        for name in PROJECTIONS:
            module = layer.get_submodule(name)
            roundings[name] = _Rounding(module.weight, scheme)
            parametrize.register_parametrization(module, "weight", roundings[name])
        best = _descend(
            layer, list(roundings.values()), inputs, targets, cos, sin, steps, seed
        )
        with torch.no_grad():
            for r, (v, alpha) in zip(roundings.values(), best, strict=True):
                r.v.copy_(v)
                r.alpha.copy_(alpha)
    finally:
        for name in roundings:
            parametrize.remove_parametrizations(
                layer.get_submodule(name), "weight", leave_parametrized=False
            )
        for p in frozen:
            p.requires_grad_(True)
    quantized = {}
    for name, r in roundings.items():
        module = layer.get_submodule(name)
        quantized[name] = r.quantized(module.weight.detach())
        with torch.no_grad():
            module.weight.copy_(quantized[name].dequantize())
    return quantized


def _descend(layer, roundings, inputs, targets, cos, sin, steps, seed):
    # signed gradient descent; the (v, alpha) pairs of the lowest-loss step
    g = torch.Generator().manual_seed(seed)
    best_loss, best = (
        math.inf,
        [(r.v.detach().clone(), r.alpha.detach().clone()) for r in roundings],
    )
    batch = min(BATCH, len(inputs))
    for step in range(steps):
        rows = torch.randperm(len(inputs), generator=g)[:batch]
        with torch.enable_grad():
            loss = F.mse_loss(
                layer.forward_dense(inputs[rows], cos, sin), targets[rows]
            )
            loss.backward()
        if loss.item() < best_loss:
            best_loss = loss.item()
            best = [(r.v.detach().clone(), r.alpha.detach().clone()) for r in roundings]
        lr = (1 - step / steps) / steps
        with torch.no_grad():
            for r in roundings:
                r.v.sub_(lr * r.v.grad.sign()).clamp_(-0.5, 0.5)
                r.alpha.sub_(lr * r.alpha.grad.sign()).clamp_(MIN_SHRINK, 1.0)
                r.v.grad = r.alpha.grad = None
    return best
