"""Quality regression: a candidate against its reference on the shipped eval sets,
the same token positions on both sides, returning the `QualityReport` the gates read.

Both sides are model folders scored in-process (`inprocess.EngineModel`: full
distributions, exact KL) or either is an endpoint (`remote.Endpoint`: top-N
logprobs, the KL estimate of `metrics.top_n_kld`). Token ids come from the
reference's tokenizer and are sent as ids to both, so the positions are the same;
a side that echoes other tokens is an error. Deterministic given the seed: the
long-context prompts and the bootstrap intervals draw from it.

For a candidate that routes experts (MoE), both sides in-process also record
every MoE layer's expert choice of every teacher-forced token, and the report's
`routing` compares them (`evaluate.routing`: router agreement, expert-load
shift). A dense candidate's is `not_applicable`; with an endpoint on either side
routing can't be seen and it is `unknown`, which no gate takes for a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gpuagent.engine.routing import RoutingRecorder
from gpuagent.evaluate.evalsets import (
    LONG_CONTEXT,
    EvalSlice,
    load_text_slices,
    long_context_slice,
)
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.metrics import (
    Continuation,
    PositionStats,
    TopN,
    contains_answer,
    full_position_stats,
    slice_quality,
    top_n_position_stats,
)
from gpuagent.evaluate.routing import RoutingTally, not_applicable, not_visible
from gpuagent.protocol import QualityReport, RoutingReport, SliceQuality

DEFAULT_TOP_N = 20
DEFAULT_CONTINUATION_TOKENS = 16
# Longest passage scored (tokens); the long-context slice has its own length.
DEFAULT_PASSAGE_TOKENS = 512


class Side(Protocol):
    """What the evaluator needs of a candidate or a reference."""

    label: str
    max_model_len: int

    def encode(self, text: str) -> list[int]: ...
    def count_tokens(self, text: str) -> int: ...
    def top_n(self, ids: list[int], n: int) -> list[TopN]: ...
    def greedy(
        self, ids: list[int], max_tokens: int
    ) -> tuple[list[int] | None, str]: ...


@dataclass
class Settings:
    """How much to evaluate."""

    seed: int = 0
    top_n: int = DEFAULT_TOP_N
    continuation_tokens: int = DEFAULT_CONTINUATION_TOKENS
    passage_tokens: int = DEFAULT_PASSAGE_TOKENS
    long_context_tokens: int | None = None  # None: the longest both sides hold
    max_items: int | None = None  # per slice, passages and prompts (None: all)
    slices: Sequence[str] = ("english", "code", "korean", LONG_CONTEXT)


def compare_positions(
    candidate: Side,
    reference: Side,
    ids: list[int],
    top_n: int,
    routing: RoutingTally | None = None,
) -> PositionStats:
    """Stats of positions 1.. of `ids`: exact when both sides run in-process, else
    from top-N (both sides must report the same tokens). `routing` (both sides
    in-process and routing experts): where the two sides' expert choices of every
    token of `ids` are compared."""
    if isinstance(candidate, EngineModel) and isinstance(reference, EngineModel):
        seen_c = RoutingRecorder() if routing is not None else None
        seen_r = RoutingRecorder() if routing is not None else None
        if candidate is reference:  # one engine, one cache: score once
            chunks = list(reference.logprobs_chunks(ids, seen_r))
            stats = exact_position_stats(chunks, chunks, ids)
            seen_c = seen_r
        else:
            stats = exact_position_stats(
                reference.logprobs_chunks(ids, seen_r),
                candidate.logprobs_chunks(ids, seen_c),
                ids,
            )
        if routing is not None:
            routing.add(seen_c, seen_r)
        return stats
    refs = reference.top_n(ids, top_n)
    cands = candidate.top_n(ids, top_n)
    mismatch = next(
        (
            i
            for i, (r, c) in enumerate(zip(refs, cands, strict=True))
            if r.token != c.token
        ),
        None,
    )
    if mismatch is not None:
        raise ValueError(
            f"candidate and reference disagree on token {mismatch + 1} of the same "
            f"ids ({cands[mismatch].token!r} vs {refs[mismatch].token!r}): they don't "
            "share a tokenizer, so their positions can't be compared"
        )
    return top_n_position_stats(refs, cands)


def exact_position_stats(
    reference_chunks: Iterable[torch.Tensor],
    candidate_chunks: Iterable[torch.Tensor],
    ids: list[int],
) -> PositionStats:
    """Stats of positions 1.. of `ids` from both sides' full log-probs, chunk by
    chunk as `EngineModel.logprobs_chunks` yields them (the same chunking)."""
    parts = []
    start = 1
    for ref_lp, cand_lp in zip(reference_chunks, candidate_chunks, strict=True):
        n = ref_lp.shape[0]
        # row r predicts position start + r; the sequence's last row predicts nothing
        rows = min(n, len(ids) - start)
        if rows > 0:
            next_ids = torch.tensor(ids[start : start + rows])
            parts.append(full_position_stats(ref_lp[:rows], cand_lp[:rows], next_ids))
        start += n
    return PositionStats.concat(parts)


def routing_tally(candidate: Side, reference: Side) -> RoutingTally | RoutingReport:
    """A tally to fill when the candidate's routing can be compared with the
    reference's; else the RoutingReport saying why it isn't measured."""
    if isinstance(candidate, EngineModel) and not candidate.routes_experts:
        return not_applicable()
    if not (isinstance(candidate, EngineModel) and isinstance(reference, EngineModel)):
        return not_visible()
    if not reference.routes_experts:
        return not_visible(
            "the candidate routes experts and the reference has no router to "
            "compare it with"
        )
    if candidate.router_shape != reference.router_shape:
        return not_visible(
            f"the candidate routes top-{candidate.router_shape[1]} of "
            f"{candidate.router_shape[0]} experts, the reference top-"
            f"{reference.router_shape[1]} of {reference.router_shape[0]}: their "
            "choices can't be compared"
        )
    return RoutingTally(*candidate.router_shape)


def continue_both(
    candidate: Side, reference: Side, ids: list[int], answer: str, max_tokens: int
) -> Continuation:
    """Greedy continuations of `ids` by both sides."""
    cand_ids, cand_text = candidate.greedy(ids, max_tokens)
    ref_ids, ref_text = reference.greedy(ids, max_tokens)
    return Continuation(answer, cand_text, ref_text, cand_ids, ref_ids)


def evaluate_quality(
    candidate: Side,
    reference: Side,
    settings: Settings | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> QualityReport:
    """Score every slice of the shipped eval sets on both sides; slices in
    `settings.slices` order, then "overall" (all their positions and
    continuations)."""
    settings = settings or Settings()
    rng = np.random.default_rng(settings.seed)
    text_slices = load_text_slices()
    wanted: list[EvalSlice] = [s for s in text_slices if s.name in settings.slices]
    if LONG_CONTEXT in settings.slices:
        room = min(candidate.max_model_len, reference.max_model_len)
        length = min(room, settings.long_context_tokens or room)
        length -= settings.continuation_tokens + 1
        wanted.append(
            long_context_slice(
                text_slices, length, reference.count_tokens, settings.seed
            )
        )
    both = isinstance(candidate, EngineModel) and isinstance(reference, EngineModel)
    routing = routing_tally(candidate, reference)
    tally = routing if isinstance(routing, RoutingTally) else None
    results: list[SliceQuality] = []
    all_stats: list[PositionStats] = []
    all_continuations: list[Continuation] = []
    for eval_slice in wanted:
        passages = eval_slice.passages[: settings.max_items]
        prompts = eval_slice.prompts[: settings.max_items]
        progress(f"{eval_slice.name}: {len(passages)} passages, {len(prompts)} prompts")
        is_long = eval_slice.name == LONG_CONTEXT
        limit = None if is_long else settings.passage_tokens
        stats = [
            compare_positions(
                candidate,
                reference,
                reference.encode(p)[:limit],
                settings.top_n,
                tally,
            )
            for p in passages
        ]
        continuations = [
            continue_both(
                candidate,
                reference,
                reference.encode(prompt.text),
                prompt.answer,
                settings.continuation_tokens,
            )
            for prompt in prompts
        ]
        retrieval = reference_retrieval = None
        if is_long:
            retrieval = all(
                contains_answer(c.candidate, c.answer) for c in continuations
            )
            reference_retrieval = all(
                contains_answer(c.reference, c.answer) for c in continuations
            )
        results.append(
            slice_quality(
                eval_slice.name,
                stats,
                continuations,
                rng,
                retrieval,
                reference_retrieval,
            )
        )
        all_stats += stats
        all_continuations += continuations
    results.append(slice_quality("overall", all_stats, all_continuations, rng))
    return QualityReport(
        candidate=candidate.label,
        reference=reference.label,
        method="in_process" if both else "http_top_n",
        top_n=None if both else settings.top_n,
        seed=settings.seed,
        slices=results,
        candidate_kv_cache_dtype=getattr(candidate, "kv_cache_dtype", None),
        reference_kv_cache_dtype=getattr(reference, "kv_cache_dtype", None),
        routing=tally.report(rng) if tally is not None else routing,
    )
