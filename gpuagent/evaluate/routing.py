"""The MoE regression: router agreement and expert-load shift of a candidate
against its reference, per MoE layer, on the same teacher-forced tokens.

Both sides score the same token ids with a `engine.routing.RoutingRecorder`
passed to their forwards; `RoutingTally.add` compares the two recordings of one
sequence, token by token, and accumulates per layer:

- router agreement: the share of tokens whose top-k expert SET is the same on
  both sides (order within the k doesn't matter: the weights are per expert);
- mean Jaccard: |A and B| / |A or B| of the two sets, averaged over tokens (a
  token that swaps one expert of k=8 scores 7/9, not 0);
- load shift: the total-variation distance 1/2 sum_e |p_c(e) - p_r(e)| between
  the shares of all routed (token, slot) pairs each expert received;
- max load change: max_e |n_c(e) - n_r(e)| / max(n_r(e), mean load), the largest
  change of one expert's load relative to its reference load, the mean load
  (token-slots / experts) standing in for an expert the reference barely used so
  that one token moving to a cold expert doesn't read as "infinitely more".

`routing_report` turns the tally into the report's `RoutingReport`; a dense
model's is `not_applicable`, an HTTP side's `unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from gpuagent.engine.routing import RoutingRecorder
from gpuagent.evaluate.metrics import bootstrap_ci
from gpuagent.protocol import LayerRouting, RoutingReport

DENSE_REASON = "dense model: no routed experts, so no router to compare"
HTTP_REASON = (
    "routing is not visible over the OpenAI-compatible API: router agreement and "
    "expert load were not measured (score both sides in-process to measure them)"
)


def same_expert_set(candidate: Tensor, reference: Tensor) -> Tensor:
    """Per token, whether both top-k id rows [T, k] hold the same experts: [T]
    bool."""
    return (candidate.sort(-1).values == reference.sort(-1).values).all(-1)


def expert_set_jaccard(candidate: Tensor, reference: Tensor, num_experts: int):
    """Per token, |A and B| / |A or B| of the two rows' expert sets: [T] float."""
    chosen_c = _one_hot(candidate, num_experts)  # [T, E] bool
    chosen_r = _one_hot(reference, num_experts)
    both = (chosen_c & chosen_r).sum(-1).float()
    either = (chosen_c | chosen_r).sum(-1).float()
    return both / either


def _one_hot(ids: Tensor, num_experts: int) -> Tensor:
    chosen = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool)
    return chosen.scatter_(1, ids.long(), True)


def expert_load(ids: Tensor, num_experts: int) -> Tensor:
    """Token-slots each expert received: [E] int64 from ids [T, k]."""
    return torch.bincount(ids.reshape(-1).long(), minlength=num_experts)


def load_shift(candidate_load: Tensor, reference_load: Tensor) -> float:
    """Total-variation distance between two per-expert load counts [E]."""
    p = candidate_load.double() / candidate_load.sum()
    q = reference_load.double() / reference_load.sum()
    return float(0.5 * (p - q).abs().sum())


def max_load_change(
    candidate_load: Tensor, reference_load: Tensor
) -> tuple[float, int]:
    """(largest |n_c - n_r| / max(n_r, mean load), the expert) over loads [E] of
    the same token-slots (see the module docstring)."""
    mean = reference_load.double().sum() / len(reference_load)
    base = reference_load.double().clamp_min(float(mean))
    change = (candidate_load.double() - reference_load.double()).abs() / base
    expert = int(change.argmax())
    return float(change[expert]), expert


@dataclass
class _Layer:
    num_experts: int
    tokens: int = 0
    same: list[np.ndarray] = field(default_factory=list)  # [T] bool per sequence
    jaccard_sum: float = 0.0
    candidate_load: Tensor | None = None
    reference_load: Tensor | None = None

    def add(self, candidate: Tensor, reference: Tensor) -> None:
        e = self.num_experts
        self.tokens += candidate.shape[0]
        self.same.append(same_expert_set(candidate, reference).numpy())
        self.jaccard_sum += float(expert_set_jaccard(candidate, reference, e).sum())
        load_c, load_r = expert_load(candidate, e), expert_load(reference, e)
        if self.candidate_load is None:
            self.candidate_load, self.reference_load = load_c, load_r
        else:
            self.candidate_load += load_c
            self.reference_load += load_r

    def result(self, layer: int, rng: np.random.Generator | None) -> LayerRouting:
        change, expert = max_load_change(self.candidate_load, self.reference_load)
        same = np.concatenate(self.same).astype(float)
        starts = np.cumsum([0, *(len(s) for s in self.same[:-1])]).tolist()
        return LayerRouting(
            layer=layer,
            num_tokens=self.tokens,
            router_agreement=float(same.mean()),
            router_agreement_ci95=(
                bootstrap_ci(same, starts, rng) if rng is not None else None
            ),
            mean_jaccard=min(1.0, self.jaccard_sum / self.tokens),
            load_shift=min(1.0, load_shift(self.candidate_load, self.reference_load)),
            max_load_change=change,
            max_load_change_expert=expert,
        )


@dataclass
class RoutingTally:
    """Router agreement and loads accumulated over sequences, per MoE layer."""

    num_experts: int
    top_k: int
    layers: dict[int, _Layer] = field(default_factory=dict)

    def add(self, candidate: RoutingRecorder, reference: RoutingRecorder) -> None:
        """Compare one sequence's recordings (the same token ids on both sides)."""
        if candidate.layers != reference.layers:
            raise ValueError(
                f"candidate routes in layers {candidate.layers}, the reference in "
                f"{reference.layers}: not the same architecture"
            )
        for layer in reference.layers:
            ids_c = candidate.expert_ids(layer)
            ids_r = reference.expert_ids(layer)
            if ids_c.shape != ids_r.shape or ids_r.shape[1] != self.top_k:
                raise ValueError(
                    f"layer {layer} routed {tuple(ids_c.shape)} tokens x experts in "
                    f"the candidate, {tuple(ids_r.shape)} in the reference (top-k "
                    f"{self.top_k}): not the same tokens or routing"
                )
            entry = self.layers.setdefault(layer, _Layer(self.num_experts))
            entry.add(ids_c, ids_r)

    def report(self, rng: np.random.Generator | None = None) -> RoutingReport:
        """The measured RoutingReport; `unknown` when no token was routed. `rng`:
        for each layer's agreement interval, resampling blocks of tokens within
        each sequence as the slices' intervals do (None: no intervals)."""
        measured = {i: e for i, e in sorted(self.layers.items()) if e.tokens}
        if not measured:
            return RoutingReport(status="unknown", reason="no token was routed")
        return RoutingReport.measured(
            [entry.result(layer, rng) for layer, entry in measured.items()],
            self.num_experts,
            self.top_k,
        )


def not_applicable() -> RoutingReport:
    """The routing report of a dense model."""
    return RoutingReport(status="not_applicable", reason=DENSE_REASON)


def not_visible(reason: str = HTTP_REASON) -> RoutingReport:
    """The routing report where routing can't be seen (never evidence)."""
    return RoutingReport(status="unknown", reason=reason)
