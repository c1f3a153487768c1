"""Sign-gradient rounding (SignRound, the method of Intel's AutoRound: Cheng et al.
2024, "Optimize Weight Rounding via Signed Gradient Descent for the Quantization of
LLMs") for the projections of one decoder layer.

Round-to-nearest rounds each weight on its own; here each weight gets a rounding
offset v in [-0.5, 0.5] (code = round(w / s + v)) and each group two shrinks in
[0.5, 1], one of its negative extreme and one of its positive extreme, and the
layer's seven projections are tuned together, by signed gradient descent through a
straight-through rounding, so that the layer's output on the calibration inputs the
quantized layers before it produce comes close to the unquantized model's output at
that layer (each layer also makes up for the error that reaches it). As the paper:
`steps` steps of `BATCH` sequences drawn at random, learning rate 1 / steps decaying
linearly to 0, the offsets and shrinks of the step with the lowest loss kept.

The scale is AutoRound's full-range signed one: the larger of the shrunk extremes
over the magnitude of the lowest code (int4: 8), signed so that this extreme maps
to the lowest code (-8) exactly; the other side reaches 7 codes. Against the
unsigned absmax / 7.5 of round-to-nearest (quantize.py), which maps the negative
extreme to -8 and clips the positive one to 7 whichever is larger, the step is 1/16
finer and the larger extreme is never clipped (the smaller one only where it is
within 1/16 of the larger). int8's codes are symmetric ([-127, 127]), so its scales
stay positive. The observer ("mse") picks the shrink both start from.

The result is the same symmetric int format as round-to-nearest and GPTQ (codes
and bf16 scales, `QuantizedWeight`, dequantized as code * scale), read back by
compressed-tensors and the engine like any other: a negative scale is only a
number they multiply by.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from gpuagent.compress.checkpoint import PROJECTIONS
from gpuagent.compress.quantize import (
    MSE_SHRINKS,
    SCALE_DTYPE,
    QuantizedWeight,
    code_range,
    stored_scale,
)
from gpuagent.compress.recipes import WeightScheme

DEFAULT_STEPS = 200
BATCH = 8  # sequences per step
MIN_SHRINK = 0.5


class _Rounding(nn.Module):
    """A weight's tunable rounding: offsets v [N, G, g] and the shrinks of each
    group's negative and positive extremes [N, G, 1] (module docstring); as a
    parametrization, `forward(w)` is the weight the layer runs with (quantized and
    read back)."""

    def __init__(self, w: torch.Tensor, scheme: WeightScheme) -> None:
        super().__init__()
        n, k = w.shape
        self.group_size = scheme.group_size_for(k)
        group = self.group_size or k
        self.shape = (n, k // group, group)
        self.bits = scheme.bits
        self.lo, self.hi = code_range(scheme.bits, True)
        groups = w.detach().view(self.shape)
        self.register_buffer("neg", -groups.amin(dim=-1, keepdim=True).clamp(max=0))
        self.register_buffer("pos", groups.amax(dim=-1, keepdim=True).clamp(min=0))
        if scheme.observer == "mse":
            shrink = _start_shrink(groups, self.neg, self.pos, self.lo, self.hi)
        else:
            shrink = torch.ones_like(self.neg)
        self.v = nn.Parameter(torch.zeros(self.shape))
        self.min_shrink = nn.Parameter(shrink.clone())
        self.max_shrink = nn.Parameter(shrink)

    def scale(self) -> torch.Tensor:
        """[N, G, 1] float32 signed scales (module docstring), not yet rounded to
        the stored dtype."""
        return _signed_scale(
            self.neg * self.min_shrink, self.pos * self.max_shrink, self.lo, self.hi
        )

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        s = self.scale()
        s = s + (_stored(s) - s).detach()  # as stored (bf16), straight-through
        x = w.view(self.shape) / s + self.v
        q = (x + (x.round() - x).detach()).clamp(self.lo, self.hi)  # straight-through
        return (q * s).view_as(w)

    def params(self) -> tuple[torch.Tensor, ...]:
        return self.v, self.min_shrink, self.max_shrink

    @torch.no_grad()
    def quantized(self, w: torch.Tensor) -> QuantizedWeight:
        """The codes and stored scales of w under the current offsets and shrinks."""
        scale = _stored(self.scale())
        q = (w.view(self.shape) / scale + self.v).round().clamp(self.lo, self.hi)
        return QuantizedWeight(
            codes=q.view_as(w).to(torch.int8),
            scale=scale[..., 0].to(SCALE_DTYPE),
            zero_point=None,
            bits=self.bits,
            group_size=self.group_size,
        )


def _signed_scale(neg, pos, lo, hi):
    # the larger extreme over |lo|; signed, where the codes are asymmetric
    # ([-8, 7]), so that this extreme maps to lo, positive for the negative one
    if -lo == hi:
        return torch.maximum(neg, pos) / hi
    return torch.where(neg >= pos, neg, -pos) / -lo


def _stored(scale: torch.Tensor) -> torch.Tensor:
    # the signed scale as the checkpoint holds it (stored_scale of its magnitude)
    magnitude = stored_scale(scale.abs())
    return torch.where(scale < 0, -magnitude, magnitude)


def _start_shrink(groups, neg, pos, lo, hi) -> torch.Tensor:
    """[N, G, 1] the shrink in MSE_SHRINKS (both extremes shrunk alike) whose
    round-to-nearest codes leave each group the least squared error."""
    best = best_error = None
    for shrink in MSE_SHRINKS:
        scale = _stored(_signed_scale(neg * shrink, pos * shrink, lo, hi))
        q = (groups / scale).round().clamp(lo, hi)
        error = (q * scale - groups).square().sum(dim=-1, keepdim=True)
        if best is None:
            best, best_error = torch.full_like(error, shrink), error
            continue
        better = error < best_error
        best = torch.where(better, shrink, best)
        best_error = torch.where(better, error, best_error)
    return best


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
            for r, values in zip(roundings.values(), best, strict=True):
                for param, value in zip(r.params(), values, strict=True):
                    param.copy_(value)
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
    # signed gradient descent; the parameters of the lowest-loss step
    g = torch.Generator().manual_seed(seed)

    def snapshot():
        return [tuple(p.detach().clone() for p in r.params()) for r in roundings]

    best_loss, best = math.inf, snapshot()
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
            best = snapshot()
        lr = (1 - step / steps) / steps
        with torch.no_grad():
            for r in roundings:
                r.v.sub_(lr * r.v.grad.sign()).clamp_(-0.5, 0.5)
                for shrink in (r.min_shrink, r.max_shrink):
                    shrink.sub_(lr * shrink.grad.sign()).clamp_(MIN_SHRINK, 1.0)
                for p in r.params():
                    p.grad = None
    return best
