"""GPTQ (Frantar et al. 2022) for one Linear: quantize the weight column by column
and spread each column's rounding error over the columns not yet quantized, weighted
by the inverse Hessian of the layer's inputs, H = 2 X^T X / n.

As the reference implementation (and llm-compressor): dead inputs (H_ii = 0) get
H_ii = 1 and a zero weight, `damp` x mean(diag H) is added to the diagonal, the
upper Cholesky factor of H^-1 drives the updates, columns are processed in blocks of
`block_size` with the error of a block applied to the rest lazily. A group's scale
(and zero point) is taken from the current, error-updated weights when the group's
first column is reached; with `act_order` the columns go in decreasing H_ii order
(ties in index order) and the group scales are fixed up front from the original
weights (they cannot follow the updates when a group's columns are scattered). fp8
(e4m3 per output channel) is the same loop with the row's absmax / 448 scale fixed
up front and each column rounded to the nearest e4m3 value instead of an integer.

The loop runs over a batch of Linears with Hessians of their own (the routed
experts of an MoE layer, `quantize_gptq_batch`), with batched tensor ops: every
step is elementwise per expert, or a batched Cholesky / matmul that computes each
expert's matrix as it does alone, so an expert's codes are the same in any batch
(one Linear is the batch of one, `quantize_gptq`).
"""

from __future__ import annotations

from collections.abc import Sequence

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
    e4m3 value where an int scheme rounds to the nearest integer). The batch of
    one of `quantize_gptq_batch` (the caller's Hessian is left as it is)."""
    hessians = hessian.to(torch.float64).clone()[None]  # [1, K, K], overwritten
    return quantize_gptq_batch([w[None]], hessians, scheme, damp, block_size)[0][0]


def quantize_gptq_batch(
    weights: Sequence[torch.Tensor],
    hessians: torch.Tensor,
    scheme: WeightScheme,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[list[QuantizedWeight]]:
    """GPTQ of E Linears at once (the routed experts of one MoE layer): each
    weights[j] [E, N_j, K] is quantized on the inputs whose Hessians are
    `hessians` [E, K, K] float64 (expert e's weights[j][e] on hessians[e]; the
    projections of one input, gate and up, share one factorization). Damping,
    Cholesky and the column loop run once for the batch, each expert's columns
    in its own act order (gathered), its groups and scales its own: expert e's
    result is the one `quantize_gptq(weights[j][e], hessians[e])` (the batch of
    one) gives. `hessians` is used as scratch space (overwritten): the float64
    memory taken is that stack (twice with act order, permuted) and the float32
    factor. Returns result[j][e]."""
    if hessians.dtype != torch.float64 or hessians.dim() != 3:
        raise ValueError(
            f"hessians must be float64 [E, K, K], got {hessians.dtype} "
            f"{list(hessians.shape)}"
        )
    e, k, _ = hessians.shape
    for w in weights:
        if w.dim() != 3 or w.shape[0] != e or w.shape[2] != k:
            raise ValueError(
                f"weights must be [E, N, K] = [{e}, N, {k}] as the Hessians, got "
                f"{list(w.shape)}"
            )
    h = hessians
    diag = h.diagonal(dim1=-2, dim2=-1)  # [E, K], a view of h
    # dead inputs (H_ii = 0) get H_ii = 1 and a zero weight
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    importance = diag.float()  # [E, K], unpermuted
    perm = torch.arange(k).expand(e, k)
    if scheme.act_order:
        perm = torch.argsort(diag, dim=-1, descending=True, stable=True)
        batch = torch.arange(e)[:, None, None]
        h = h[batch, perm[:, :, None], perm[:, None, :]]  # [E, K, K] permuted
    diag = h.diagonal(dim1=-2, dim2=-1)
    diag.add_(damp * diag.contiguous().mean(dim=-1, keepdim=True))
    # factored in place: no second float64 stack beside the scratch one
    torch.linalg.cholesky(h, out=h)
    torch.cholesky_inverse(h, out=h)
    torch.linalg.cholesky(h, upper=True, out=h)
    h_inv = h.float()  # [E, K, K]
    del h, diag
    return [
        _solve(w, dead, importance, perm, h_inv, scheme, block_size) for w in weights
    ]


def _solve(
    w: torch.Tensor,
    dead: torch.Tensor,
    importance: torch.Tensor,
    perm: torch.Tensor,
    h_inv: torch.Tensor,
    scheme: WeightScheme,
    block_size: int,
) -> list[QuantizedWeight]:
    # the column loop of GPTQ over the batch: w [E, N, K], the batch's dead
    # inputs [E, K], importance (H_ii) [E, K], column order [E, K] and upper
    # Cholesky factor of H^-1 [E, K, K] (permuted)
    w = w.detach().float().clone()
    e, n, k = w.shape
    bits, symmetric = scheme.bits, scheme.symmetric
    fp8 = scheme.kind == "float"
    group = k if fp8 else scheme.group_size_for(k) or k
    w.masked_fill_(dead[:, None, :], 0.0)

    # Per-row (int8) and act-order scales are fixed before any update; the "mse"
    # observer weighs each input channel's rounding error by H_ii.
    static = group == k or scheme.act_order
    scale = torch.empty(e, n, k // group)
    zero_point = None if symmetric else torch.empty(e, n, k // group)
    if fp8:
        scale = fp8_scale(w)  # [E, N, 1]
    elif static:
        s, z = group_params(
            w.view(e, n, k // group, group),
            bits,
            symmetric,
            scheme.observer,
            importance.view(e, 1, k // group, group),
        )
        scale = s[..., 0]
        if z is not None:
            zero_point = z[..., 0]

    # the loop works on the transposed weights [E, K, N], columns in each
    # expert's order: a column is one contiguous row of N values per expert
    rows = perm[:, :, None].expand(e, k, n)
    wt = w.transpose(1, 2).gather(1, rows)  # [E, K, N]
    del w
    # a static scale per (permuted) column: its group's, gathered per expert
    col_scale = col_zero = None
    if static:
        group_of = (perm // group)[:, :, None].expand(e, k, n)
        if fp8:
            col_scale = scale.transpose(1, 2).expand(e, k, n)
        else:
            col_scale = scale.transpose(1, 2).gather(1, group_of)
        if zero_point is not None:
            col_zero = zero_point.transpose(1, 2).gather(1, group_of)

    codes = torch.zeros(e, k, n)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = wt[:, i1:i2].clone()  # [E, B, N]
        err1 = torch.zeros_like(w1)
        hinv1 = h_inv[:, i1:i2, i1:i2]  # [E, B, B]
        for i in range(i2 - i1):
            col = i1 + i
            if static:
                s = col_scale[:, col]
                z = None if col_zero is None else col_zero[:, col]
            else:  # not act-order: the columns are in their own order
                g = col // group
                if col % group == 0:
                    # the group's columns as updated so far: in-block ones from w1
                    current = torch.cat((w1[:, i:], wt[:, i2:]), dim=1)
                    s, z = group_params(
                        current[:, :group].transpose(1, 2),  # [E, N, group]
                        bits,
                        symmetric,
                        scheme.observer,
                        importance[:, None, col : col + group],
                    )
                    scale[:, :, g] = s[..., 0]
                    if zero_point is not None:
                        zero_point[:, :, g] = z[..., 0]
                s = scale[:, :, g]
                z = None if zero_point is None else zero_point[:, :, g]
            if fp8:
                q = fp8_values(w1[:, i], s)
            else:
                q = quantize_values(w1[:, i], s, z, bits, symmetric)
            codes[:, col] = q
            deq = (q - (0 if z is None else z)) * s
            err = (w1[:, i] - deq) / hinv1[:, i, i, None]  # [E, N]
            w1[:, i:] -= hinv1[:, i, i:, None] * err[:, None, :]
            err1[:, i] = err
        wt[:, i2:] -= h_inv[:, i1:i2, i2:].transpose(1, 2) @ err1

    # [E, N, K] in each expert's own column order again
    codes = torch.empty_like(codes).scatter_(1, rows, codes).transpose(1, 2)
    codes = codes.contiguous()  # written as is (fp8) or packed
    codes = codes.to(torch.float8_e4m3fn if fp8 else torch.int8)
    scale = scale.to(SCALE_DTYPE)
    if zero_point is not None:
        zero_point = zero_point.to(torch.int8)
    group_size = None if group == k and scheme.group_size is None else group
    # each expert's tensors its own (not views of the batch's), as written
    return [
        QuantizedWeight(
            codes=codes[x].clone(),
            scale=scale[x].clone(),
            zero_point=None if zero_point is None else zero_point[x].clone(),
            bits=bits,
            group_size=group_size,
        )
        for x in range(e)
    ]
