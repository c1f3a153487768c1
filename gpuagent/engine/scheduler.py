"""Continuous batching over the paged KV cache.

Every step the scheduler hands the model a mix of work under one token budget:

1. running sequences, oldest first: one token each when decoding, or the next chunk of
   a long prompt (chunked prefill);
2. then waiting sequences, front first, as long as budget, sequence slots and KV
   blocks allow — so new requests join while others decode.

When a running sequence needs a block and none is free, the NEWEST running sequence is
preempted: its blocks go back to the pool and it returns to the front of the waiting
queue, to be recomputed (prompt + the tokens it generated so far) when blocks free up.
The oldest sequence can always grow (a request is only accepted if it fits the whole
pool alone), so the system always makes progress: no deadlock, no lost request.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from gpuagent.engine.cache import BlockManager, blocks_needed
from gpuagent.engine.sampling import SamplingParams


class RequestTooLargeError(ValueError):
    """A request that could never fit in the KV pool or the model's context."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and progress. `num_computed_tokens` of its tokens have
    their K/V in the cache; the rest are computed in coming steps."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    # Engine-side output state (detokenization, timing).
    output_text: str = ""
    detokenizer: Any = None  # tokenizer.IncrementalDetokenizer of output_token_ids
    num_emitted_chars: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    # Engine's TokenLogprob per generated token when the request asked for logprobs;
    # kept here so that recomputation after a preemption doesn't lose them.
    token_logprobs: list[Any] = field(default_factory=list)
    # Engine's prompt TokenLogprob per prompt token (None first) when asked for.
    prompt_logprobs: list[Any] = field(default_factory=list)
    # Prefix cache: hashes of the full blocks of all_token_ids, in block order
    # (extended as blocks fill), and the prompt tokens the first admission took from
    # the cache instead of computing them.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions start..end-1 (prompt then generated), without building
        the whole list: a decode step asks for one token of a long sequence."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens the sequence will hold at most (prompt + max_tokens)."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        """Whether the sequence is done (stopped, at length, or aborted)."""
        return self.status is SequenceStatus.FINISHED


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq` starting at position `start` run this step."""

    seq: Sequence
    start: int
    num_tokens: int
    # Whether the chunk reaches the sequence's last token, so that its logits give the
    # next token (an unfinished prompt chunk samples nothing). Fixed at schedule time.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end == self.seq.num_tokens

    @property
    def end(self) -> int:
        """Position after the last token of the chunk (= context length after it)."""
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    """The work of one step and the sequences preempted to make room for it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the model runs this step."""
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to run."""
        return not self.chunks


class Scheduler:
    """Waiting and running queues over a `BlockManager`."""

    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        self.sequences: dict[str, Sequence] = {}
        self.num_preemptions = 0
        # Prefix cache, over new requests (not readmissions after a preemption), as
        # vLLM counts: prompt tokens looked up, and those found (not computed).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queue changes ---------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError if such a request could never be served."""
        total = num_prompt_tokens + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise RequestTooLargeError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the request asks for {total} ({num_prompt_tokens} in the prompt, "
                f"{max_tokens} to generate)"
            )
        needed = blocks_needed(total, self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise RequestTooLargeError(
                f"the request needs {needed} KV blocks ({total} tokens) but the KV "
                f"cache has only {self.blocks.num_blocks} blocks "
                f"({self.blocks.capacity_tokens} tokens)"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        if seq.request_id in self.sequences:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if not seq.prompt_token_ids:
            raise ValueError("the prompt must have at least one token")
        self.check_fits(len(seq.prompt_token_ids), seq.params.max_tokens)
        seq.status = SequenceStatus.WAITING
        self.sequences[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence out of the queues and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.blocks.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.sequences[seq.request_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request (e.g. its client went away); None if it isn't live."""
        seq = self.sequences.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        # Recompute rather than swap: drop the KV, keep the tokens.
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks; allocates their blocks, preempting if needed."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            target = seq.num_computed_tokens + num_new
            while not self.blocks.can_hold(seq.request_id, target):
                victim = self.running[-1]  # the newest; never one scheduled already
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq was itself the newest and got preempted
            self.blocks.ensure_capacity(seq.request_id, target)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
            index += 1

        # Admitting while preempting would just thrash: new work waits a step.
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            start = self.blocks.prefix_compute_start(len(cached))
            num_new = min(seq.num_tokens - start, budget)
            if not self.blocks.ensure_capacity(seq.request_id, start + num_new, cached):
                break
            self.waiting.popleft()
            self._take_cached_prefix(seq, start)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        return out

    def _block_hashes(self, seq: Sequence) -> list[bytes]:
        return self.blocks.extend_block_hashes(
            seq.block_hashes, seq.token_ids, seq.num_tokens
        )

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks a waiting sequence (nothing computed) can start from; none
        for one that asks for prompt logprobs, which need every prompt position
        computed (vLLM skips the lookup for them too)."""
        if not self.blocks.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        return self.blocks.cached_prefix(self._block_hashes(seq), seq.num_tokens)

    def _take_cached_prefix(self, seq: Sequence, start: int) -> None:
        """An admitted sequence starts at `start`: the tokens before it are cached."""
        seq.num_computed_tokens = start
        if seq.num_preemptions or not self.blocks.prefix_caching:
            return
        if seq.params.prompt_logprobs is None:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += start
        seq.num_cached_tokens = start

    def commit(self, out: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Record that the step ran: chunks are in the cache (their full blocks
        enter the prefix cache); append the tokens sampled for chunks that reached
        their sequence's end."""
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens = chunk.end
            if self.blocks.prefix_caching:
                self.blocks.cache_computed_blocks(
                    seq.request_id, self._block_hashes(seq), chunk.end
                )
            token = sampled.get(seq.request_id)
            if token is not None:
                seq.output_token_ids.append(token)
