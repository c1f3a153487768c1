"""Candidate-vs-reference numbers on the same token positions: KL divergence (exact
over full distributions, or estimated over top-N logprobs), same-top-1, perplexity,
and per-slice summaries with seeded bootstrap confidence intervals.

KL is KL(reference || candidate) = sum_v p_ref(v) (log p_ref(v) - log p_cand(v)),
llama.cpp's and the bench's direction: how much the candidate loses of what the
reference predicts.

The top-N estimate (`top_n_kld`), used when a side is an HTTP endpoint that returns
only the top-N logprobs of each position (plus the actual token's):

- the support is split into the reference's top-N tokens plus the actual next token
  (set S, whose reference probabilities are exact) and one "rest" bucket;
- the candidate's probability of a token in S is exact when the candidate listed it
  (its own top-N, or the actual token); a token it didn't list has at most the
  candidate's N-th probability, and gets min(that, unlisted mass / (unlisted tokens
  of S + 1)), an even share of what the candidate left unlisted;
- KL is then taken over S plus the rest bucket (p_rest = 1 - sum_S p, q_rest = 1 -
  sum_S q).

With exact q on S this is the KL of a coarsened distribution, which by the
data-processing inequality is <= the true KL (`kld_lower`, reported as the slice's
mean_kld_lower): it errs low by the divergence hidden inside the rest bucket, which
is exactly p_rest x KL(p's tail shape || q's tail shape). p_rest, the reference's
mass the top-N left out (`top_n_tail_mass`), is reported beside it as the bound on
what it neglects: the weight of the one term not measured.

That term is then estimated (`top_n_tail_kld`), so that the reported KL is not
biased low: where the candidate's log-probs differ from the reference's by noise
independent of rank (what quantizing weights or the KV cache does to the logits),
KL between the two tail shapes is half the variance of log p - log q over the tail
(second order, and exact for Gaussian noise over a long tail), and that variance is
estimated by the one over the tokens both sides listed. On SmolLM2-135M (w8a16,
int8 KV; 943 positions, top-20) the bucket hid 12% of the KL: the bound alone read
0.874 of the exact mean, with the tail term 0.973. `tests/gpuagent/evaluate` and
`gpuagent.benches.http_eval` measure both against the exact in-process value on the
same positions.

That bound holds for the same two distributions only. The in-process path prefills
in the chunks our server gives a lone request (`inprocess`), so the two paths return
bit-identical logprobs (JSON carries each float32 logprob exactly). With a
full-precision window beside a quantized KV cache, each query reads the window of its
own position, so a prompt chunked otherwise (scored while the server batches other
requests) differs only by float summation order. (Before the window was per query,
the queries of a chunk shared the window of its end: chunked at 256 tokens instead of
512, the int4 demo model's long-context logprobs differed by up to 0.25 nats.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from gpuagent.protocol import Interval, SliceQuality

# Probabilities are clamped here before a log: a mass that rounds to 0 on one side.
PROB_FLOOR = 1e-12
BOOTSTRAP_RESAMPLES = 1000
# Positions of a sequence resampled together: neighbouring tokens are correlated,
# so resampling single positions would make the intervals too narrow.
BOOTSTRAP_BLOCK_TOKENS = 16


@dataclass
class PositionStats:
    """Per-position numbers of one scored sequence (all arrays [P])."""

    kld: np.ndarray  # KL(reference || candidate), nats
    same_top1: np.ndarray  # bool
    logprob_candidate: np.ndarray  # log p of the actual next token
    logprob_reference: np.ndarray
    # top-N only: the reference's mass outside the tokens KL was measured on, and
    # the KL without the tail's estimated term (a lower bound)
    tail_mass: np.ndarray | None = None
    kld_lower: np.ndarray | None = None

    @classmethod
    def concat(cls, parts: Sequence[PositionStats]) -> PositionStats:
        """All positions of `parts`, in order (tail masses only when every part
        has them)."""
        if not parts:
            return cls(*(np.zeros(0) for _ in range(4)))

        def joined(name: str) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            return None if any(a is None for a in arrays) else np.concatenate(arrays)

        return cls(
            np.concatenate([p.kld for p in parts]),
            np.concatenate([p.same_top1 for p in parts]),
            np.concatenate([p.logprob_candidate for p in parts]),
            np.concatenate([p.logprob_reference for p in parts]),
            joined("tail_mass"),
            joined("kld_lower"),
        )

    def __len__(self) -> int:
        return len(self.kld)


def full_kld(ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """Exact KL(ref || cand) per row of log-probabilities [P, V] -> [P]."""
    ref = ref_logprobs.float()
    return (ref.exp() * (ref - cand_logprobs.float())).sum(-1).clamp_min(0.0)


def full_position_stats(
    ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor, next_ids: torch.Tensor
) -> PositionStats:
    """Stats from full distributions [P, V] of both sides and the actual next
    tokens [P]."""
    rows = torch.arange(len(next_ids))
    return PositionStats(
        kld=full_kld(ref_logprobs, cand_logprobs).cpu().numpy(),
        same_top1=(ref_logprobs.argmax(-1) == cand_logprobs.argmax(-1)).cpu().numpy(),
        logprob_candidate=cand_logprobs[rows, next_ids].float().cpu().numpy(),
        logprob_reference=ref_logprobs[rows, next_ids].float().cpu().numpy(),
    )


@dataclass
class TopN:
    """One position as an endpoint reports it: the actual next token's logprob and
    the top-N (token -> logprob), keys in any one key space (ids or texts)."""

    token: object
    logprob: float
    top: Mapping[object, float] = field(default_factory=dict)

    def top1(self) -> object:
        """The most likely token (the actual one when N is 0 and nothing better is
        known)."""
        if not self.top:
            return self.token
        return max(self.top.items(), key=lambda kv: kv[1])[0]


def top_n_kld(ref: TopN, cand: TopN) -> float:
    """KL(ref || cand) estimated from top-N logprobs (see the module docstring)."""
    p = {**ref.top, ref.token: ref.logprob}
    q_known = {**cand.top, cand.token: cand.logprob}
    q_listed = sum(math.exp(v) for v in q_known.values())
    unlisted = [t for t in p if t not in q_known]
    q_cap = math.exp(min(cand.top.values())) if cand.top else 1.0
    share = max(1.0 - q_listed, 0.0) / (len(unlisted) + 1)
    q_guess = min(q_cap, share)
    kld = 0.0
    p_in, q_in = 0.0, 0.0
    for token, logprob in p.items():
        p_t = math.exp(logprob)
        q_t = math.exp(q_known[token]) if token in q_known else q_guess
        kld += p_t * (logprob - math.log(max(q_t, PROB_FLOOR)))
        p_in += p_t
        q_in += q_t
    p_rest = max(1.0 - p_in, 0.0)
    q_rest = max(1.0 - q_in, PROB_FLOOR)
    if p_rest > PROB_FLOOR:
        kld += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kld, 0.0)


def top_n_tail_mass(ref: TopN) -> float:
    """The reference's probability outside its top-N and the actual token: the
    weight of the one term `top_n_kld` cannot measure (see the module docstring)."""
    listed = {**ref.top, ref.token: ref.logprob}
    return min(max(1.0 - sum(math.exp(v) for v in listed.values()), 0.0), 1.0)


def top_n_tail_kld(ref: TopN, cand: TopN) -> float:
    """The estimated divergence inside the rest bucket `top_n_kld` leaves out:
    tail mass x half the sample variance of log p - log q over the tokens both
    sides listed (see the module docstring); 0 with fewer than two such tokens."""
    shared = [t for t in ref.top if t in cand.top]
    if len(shared) < 2:
        return 0.0
    gaps = np.array([ref.top[t] - cand.top[t] for t in shared], float)
    return top_n_tail_mass(ref) * 0.5 * float(gaps.var(ddof=1))


def top_n_position_stats(refs: Sequence[TopN], cands: Sequence[TopN]) -> PositionStats:
    """Stats of positions reported as top-N by both sides (same positions, same
    actual tokens): KL as the bucketed lower bound plus the tail's estimated
    term, the lower bound alone, and the tail mass."""
    pairs = list(zip(refs, cands, strict=True))
    lower = np.array([top_n_kld(r, c) for r, c in pairs], float)
    return PositionStats(
        kld=lower + np.array([top_n_tail_kld(r, c) for r, c in pairs], float),
        same_top1=np.array(
            [r.top1() == c.top1() for r, c in zip(refs, cands, strict=True)], bool
        ),
        logprob_candidate=np.array([c.logprob for c in cands], float),
        logprob_reference=np.array([r.logprob for r in refs], float),
        tail_mass=np.array([top_n_tail_mass(r) for r in refs], float),
        kld_lower=lower,
    )


def perplexity(logprobs: np.ndarray) -> float:
    """exp of the mean negative log-likelihood (inf for no positions)."""
    return float(math.exp(-float(np.mean(logprobs)))) if len(logprobs) else math.inf


def bootstrap_ci(
    values: np.ndarray, starts: Sequence[int], rng: np.random.Generator
) -> Interval | None:
    """95% percentile interval of the mean of `values`, resampling blocks of
    BOOTSTRAP_BLOCK_TOKENS consecutive positions (never across a sequence start in
    `starts`); None with fewer than two blocks."""
    bounds = sorted({*starts, len(values)})
    blocks = [
        (b, min(b + BOOTSTRAP_BLOCK_TOKENS, end))
        for start, end in zip(bounds, bounds[1:], strict=False)
        for b in range(start, end, BOOTSTRAP_BLOCK_TOKENS)
    ]
    if len(blocks) < 2:
        return None
    sums = np.array([values[a:b].sum() for a, b in blocks], float)
    sizes = np.array([b - a for a, b in blocks], float)
    picks = rng.integers(0, len(blocks), size=(BOOTSTRAP_RESAMPLES, len(blocks)))
    means = sums[picks].sum(1) / sizes[picks].sum(1)
    low, high = np.quantile(means, [0.025, 0.975])
    return Interval(low=float(low), high=float(high))


@dataclass
class Continuation:
    """A greedy continuation of one prompt by both sides, and the answer a correct
    one contains."""

    answer: str
    candidate: str
    reference: str
    candidate_ids: list[int] | None = None  # None: compared as text
    reference_ids: list[int] | None = None

    @property
    def exact_match(self) -> bool:
        """Both sides continued identically (token for token when ids are known)."""
        if self.candidate_ids is not None and self.reference_ids is not None:
            return self.candidate_ids == self.reference_ids
        return self.candidate == self.reference

    @property
    def flipped(self) -> bool:
        """The candidate's answer is right where the reference's is wrong, or the
        other way round (a "flip", Dutta et al. 2024)."""
        return contains_answer(self.candidate, self.answer) != contains_answer(
            self.reference, self.answer
        )


def contains_answer(text: str, answer: str) -> bool:
    """Whether `answer` appears in the continuation (case and surrounding spaces
    ignored)."""
    return answer.strip().casefold() in text.casefold()


def slice_quality(
    name: str,
    stats: Sequence[PositionStats],
    continuations: Sequence[Continuation],
    rng: np.random.Generator,
    retrieval_ok: bool | None = None,
    reference_retrieval_ok: bool | None = None,
) -> SliceQuality:
    """One slice's SliceQuality from its scored sequences and continuations."""
    all_stats = PositionStats.concat(stats)
    if not len(all_stats):
        raise ValueError(f"slice {name!r} has no scored positions")
    starts = np.cumsum([0, *(len(s) for s in stats[:-1])]).tolist()
    ppl_cand = perplexity(all_stats.logprob_candidate)
    ppl_ref = perplexity(all_stats.logprob_reference)
    same = all_stats.same_top1.astype(float)
    tail = all_stats.tail_mass
    return SliceQuality(
        name=name,
        num_tokens=len(all_stats),
        mean_kld=float(all_stats.kld.mean()),
        mean_kld_ci95=bootstrap_ci(all_stats.kld, starts, rng),
        p99_kld=float(np.quantile(all_stats.kld, 0.99)),
        max_kld=float(all_stats.kld.max()),
        same_top1=float(same.mean()),
        same_top1_ci95=bootstrap_ci(same, starts, rng),
        ppl_candidate=ppl_cand,
        ppl_reference=ppl_ref,
        ppl_ratio=ppl_cand / ppl_ref,
        num_continuations=len(continuations),
        exact_match=(
            sum(c.exact_match for c in continuations) / len(continuations)
            if continuations
            else 0.0
        ),
        flips=sum(c.flipped for c in continuations),
        retrieval_ok=retrieval_ok,
        reference_retrieval_ok=reference_retrieval_ok,
        mean_kld_lower=(
            None if all_stats.kld_lower is None else float(all_stats.kld_lower.mean())
        ),
        tail_mass_mean=None if tail is None else float(tail.mean()),
        tail_mass_max=None if tail is None else float(tail.max()),
    )
