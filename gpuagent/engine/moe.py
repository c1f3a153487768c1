"""Mixture-of-experts feed-forward block: the sigmoid router with a score-correction
bias and group-limited top-k (DeepSeek-V3 and GLM-4.5 use the same one), the routed
experts and the shared experts.

Experts are computed by grouping the batch's tokens per expert: the (token, slot)
pairs of the router's top-k are sorted by expert once, each expert multiplies the
contiguous run of rows routed to it as one GEMM, and the weighted results are
put back in (token, slot) order with one scatter and summed over the k slots.
The only Python loop is over experts that received tokens, never over tokens.

Submodule names follow the Hugging Face checkpoints (`mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.E.{gate,up,down}_proj.weight`,
`mlp.shared_experts.*`), so a published state dict maps on by dropping `model.`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpuagent.engine.model import FeedForward


@dataclass(frozen=True)
class MLPShape:
    """The two sizes `model.FeedForward` reads from a config."""

    hidden_size: int
    intermediate_size: int


def swiglu(hidden_size: int, intermediate_size: int) -> FeedForward:
    """A SwiGLU MLP (gate/up/down projections) of the given sizes."""
    return FeedForward(MLPShape(hidden_size, intermediate_size))


@dataclass(frozen=True)
class RouterConfig:
    """What the router needs: expert count, top-k and the DeepSeek-V3 options."""

    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}]"
            )
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts={self.num_experts} is not a multiple of "
                f"n_group={self.n_group}"
            )
        per_group = self.num_experts // self.n_group
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in [1, n_group]")
        if self.n_group > 1 and per_group < 2:
            raise ValueError("group-limited routing needs >= 2 experts per group")
        if self.top_k > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} exceeds the experts of "
                f"topk_group={self.topk_group} groups ({self.topk_group * per_group})"
            )


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 / GLM-4.5 router.

    scores = sigmoid(x W^T) in float32; experts are chosen on scores + the
    correction bias, among the `topk_group` groups whose two best biased scores sum
    highest; the weights are the chosen experts' unbiased scores, normalised to sum
    to 1 when `norm_topk_prob`, times `routed_scaling_factor`.
    """

    def __init__(self, hidden_size: int, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        cfg = self.config
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            grouped = biased.unflatten(-1, (cfg.n_group, -1))  # [T, G, E/G]
            group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_score.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
            group_mask = torch.zeros_like(group_score, dtype=torch.bool)
            group_mask.scatter_(1, keep, True)
            expert_mask = group_mask.repeat_interleave(
                cfg.num_experts // cfg.n_group, dim=1
            )
            biased = biased.masked_fill(~expert_mask, float("-inf"))
        ids = biased.topk(cfg.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class Experts(nn.ModuleList):
    """The routed experts, one SwiGLU MLP each (`experts.E.gate_proj` ...)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int) -> None:
        super().__init__(swiglu(hidden_size, intermediate) for _ in range(num_experts))

    def forward(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """sum_k weights[t, k] * expert[ids[t, k]](x[t]) for x [T, hidden]."""
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)  # [T * k], pair p is token p // k
        order = flat_ids.argsort(stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=len(self)).tolist()
        rows = x[order // top_k]  # [T * k, hidden], each expert's rows contiguous
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self, counts, strict=True):
            if count:
                outputs[start : start + count] = expert(rows[start : start + count])
                start += count
        outputs *= weights.reshape(-1)[order, None].to(x.dtype)
        # back to (token, slot) order, then each token's k results summed
        pairs = torch.empty_like(outputs)
        pairs[order] = outputs
        return pairs.view(-1, top_k, x.shape[-1]).sum(dim=1)


class MoE(nn.Module):
    """Routed experts plus (optionally) always-on shared experts."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        n_shared_experts: int,
        router: RouterConfig,
    ) -> None:
        super().__init__()
        self.gate = SigmoidRouter(hidden_size, router)
        self.experts = Experts(router.num_experts, hidden_size, moe_intermediate_size)
        self.shared_experts = (
            swiglu(hidden_size, moe_intermediate_size * n_shared_experts)
            if n_shared_experts
            else None
        )

    def prepack(self) -> bool:
        """Pack every expert's and the shared experts' projections (CPU)."""
        ok = all([expert.prepack() for expert in self.experts])
        if self.shared_experts is not None:
            ok = self.shared_experts.prepack() and ok
        return ok

    def forward(
        self, x: Tensor, on_route: Callable[[Tensor], None] | None = None
    ) -> Tensor:
        """`on_route`: given the router's expert ids [T, k] of every token (the
        evaluator's `routing.RoutingRecorder`); None on the serving path."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, hidden]
        weights, ids = self.gate(flat)
        if on_route is not None:
            on_route(ids)
        out = self.experts(flat, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(shape)
