"""GPTQ (Frantar et al. 2022) for one Linear: quantize the weight column by column
and spread each column's rounding error over the columns not yet quantized, weighted
by the inverse Hessian of the layer's inputs, H = 2 X^T X / n.

As the reference implementation (and llm-compressor): dead inputs (H_ii = 0) get
H_ii = 1 and a zero weight, `damp` x mean(diag H) is added to the diagonal, the
upper Cholesky factor of H^-1 drives the updates, columns are processed in blocks
of `block_size` with the error of a block applied to the rest lazily. A group's
scale (and zero point) is taken from the current, error-updated weights when the
group's first column is reached; with `act_order` the columns go in decreasing
H_ii order and the group scales are fixed up front from the original weights
(they cannot follow the updates when a group's columns are scattered). fp8 (e4m3
per output channel) is the same loop with the row's absmax / 448 scale fixed up
front and each column rounded to the nearest e4m3 value instead of an integer.
"""

from __future__ import annotations

import torch

from gpuagent.compress.quantize import (
    SCALE_DTYPE,
    QuantizedWeight,
    fp8_scale,
    fp8_values,
    group_params,
    quantize_values,
)
from gpuagent.compress.recipes import WeightScheme

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK_SIZE = 128


class HessianAccumulator:
    """Running H = 2 X^T X / n over the inputs a Linear sees."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.num_rows = 0

    def add(self, x: torch.Tensor) -> None:
        """Fold inputs x [..., K] into H."""
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)  # [rows, K]
        rows = x.shape[0]
        total = self.num_rows + rows
        self.hessian *= self.num_rows / total
        self.hessian += (2.0 / total) * (x.t() @ x)
        self.num_rows = total


def quantize_gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scheme: WeightScheme,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> QuantizedWeight:
    """GPTQ codes of w [N, K] given its input Hessian [K, K]: integer codes, or
    for fp8 e4m3 values on a per-row scale (each column rounded to the nearest
    e4m3 value where an int scheme rounds to the nearest integer)."""
    w = w.detach().float().clone()
    n, k = w.shape
    bits, symmetric = scheme.bits, scheme.symmetric
    fp8 = scheme.kind == "float"
    group = k if fp8 else scheme.group_size_for(k) or k
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    # Per-row (int8) and act-order scales are fixed before any update; the "mse"
    # observer weighs each input channel's rounding error by H_ii.
    static = group == k or scheme.act_order
    scale = torch.empty(n, k // group)
    zero_point = None if symmetric else torch.empty(n, k // group)
    importance = torch.diag(h).float()  # [K], unpermuted
    if fp8:
        scale = fp8_scale(w)
    elif static:
        s, z = group_params(
            w.view(n, k // group, group),
            bits,
            symmetric,
            scheme.observer,
            importance.view(k // group, group),
        )
        scale = s[..., 0]
        if z is not None:
            zero_point = z[..., 0]

    perm = torch.arange(k)
    if scheme.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
    w = w[:, perm]
    h = h[perm][:, perm]
    group_of = perm // group  # [K] group of each (permuted) column

    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    h_inv = torch.linalg.cholesky(h_inv, upper=True).float()  # [K, K]

    codes = torch.zeros(n, k)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = h_inv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = int(group_of[col])
            if not static and col % group == 0:
                # the group's columns as updated so far: in-block ones from w1
                current = torch.cat((w1[:, i:], w[:, i2:]), dim=1)[:, :group]
                # not act-order, so columns are in their own order
                s, z = group_params(
                    current,
                    bits,
                    symmetric,
                    scheme.observer,
                    importance[col : col + group],
                )
                scale[:, g] = s[:, 0]
                if zero_point is not None:
                    zero_point[:, g] = z[:, 0]
            s = scale[:, g]
            z = None if zero_point is None else zero_point[:, g]
            if fp8:
                q = fp8_values(w1[:, i], s)
            else:
                q = quantize_values(w1[:, i], s, z, bits, symmetric)
            codes[:, col] = q
            deq = (q - (0 if z is None else z)) * s
            err = (w1[:, i] - deq) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ h_inv[i1:i2, i2:]

    codes = codes[:, torch.argsort(perm)]
    return QuantizedWeight(
        codes=codes.to(torch.float8_e4m3fn if fp8 else torch.int8),
        scale=scale.to(SCALE_DTYPE),
        zero_point=None if zero_point is None else zero_point.to(torch.int8),
        bits=bits,
        group_size=None if group == k and scheme.group_size is None else group,
    )
