"""The serving loop: scheduler -> model over the paged KV cache -> sampler -> outputs.

`LLMEngine` is synchronous (`add_request`, `abort`, `step`, `generate`);
`AsyncLLMEngine` runs its steps on a background thread and hands each request's
outputs to an asyncio queue, which is what the HTTP server consumes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpuagent.engine.cache import BlockManager, KVCacheManager, model_digest
from gpuagent.engine.kv_calibration import calibrate_kv_caches
from gpuagent.engine.mla import is_mla
from gpuagent.engine.model import AttentionMetadata
from gpuagent.engine.sampling import (
    SampledToken,
    SamplingParams,
    adjust_logits,
    find_stop_string,
    sample,
    stop_holdback,
)
from gpuagent.engine.scheduler import ScheduledChunk, Scheduler
from gpuagent.engine.scheduler import Sequence as Seq
from gpuagent.engine.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from gpuagent.engine.weights import quantize_head as quantize_head_weights
from gpuagent.engine.weights import use_int8_activations

log = logging.getLogger(__name__)

DEFAULT_KV_MEMORY_BYTES = 256 * 2**20
DEFAULT_MAX_NUM_SEQS = 64
# Newest tokens per sequence kept in bf16 beside a quantized cache, by default. Each
# fits its layout's memory target over a 2k-token sequence (int4: 0.2656 + 18/2048 =
# 0.2744 <= 0.28 of bf16; fp8: 0.5 + 16/2048 = 0.5078 <= 0.52) and keeps the
# capacity ratios (>= 3.6x, >= 1.9x) with one row reserved per max_num_seqs (64).
# Measured on SmolLM2-135M, rotated K/V, vs bf16 KV over the eval sets' English,
# code and Korean passages (4206 positions; `python -m gpuagent.benches.engine
# --model-dir var/models/smollm2-135m --quality-only`), each query reading its own
# newest W tokens in bf16: int4+w18 KLD / top-1 0.0089 / 95.1%, fp8+w16 0.00094 /
# 98.6%, int8 without one 0.00035 / 98.8%. (With the window of the chunk's end
# instead, on 6 passages: int4 w16 0.029 / 91.9%, w18 0.0174 / 92.55%, fp8 w16
# 0.0019 / 97.3%.) int4c's row of 18 holds its newest 17 tokens and the first
# (engine.kv_int4c): the bytes of int4+w18.
DEFAULT_KV_WINDOW = {"int4": 18, "int4c": 18, "fp8": 16}


def default_kv_window(kv_cache_dtype: str) -> int:
    """Full-precision window tokens a `kv_cache_dtype` cache gets by default."""
    return DEFAULT_KV_WINDOW.get(kv_cache_dtype, 0)


def engine_kv_cache(
    config: Any,
    kv_cache_dtype: str,
    *,
    kv_memory_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    kv_window: int | None = None,
    device: str | torch.device = "cpu",
) -> KVCacheManager:
    """The KV cache an engine with these settings allocates: `num_blocks` blocks, or
    as many as `kv_memory_bytes` (DEFAULT_KV_MEMORY_BYTES) holds beside one window
    row per `max_num_seqs` when the dtype keeps a window (`kv_window`, default
    `default_kv_window`). Raises ValueError when the budget holds no block."""
    if kv_window is None:  # MLA's latent cache keeps no window (engine.mla)
        kv_window = 0 if is_mla(config) else default_kv_window(kv_cache_dtype)
    num_windows = max_num_seqs if kv_window else 0
    if num_blocks is not None:
        return KVCacheManager(
            config,
            kv_cache_dtype,
            num_blocks,
            block_size,
            device,
            kv_window,
            num_windows,
        )
    budget = DEFAULT_KV_MEMORY_BYTES if kv_memory_bytes is None else kv_memory_bytes
    return KVCacheManager.for_budget(
        config, kv_cache_dtype, budget, block_size, device, kv_window, num_windows
    )


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top-N alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas + totals so far)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # generated text so far (stop string cut off)
    new_token_ids: list[int]
    new_text: str  # text released by this step (held back: partial UTF-8, stop prefix)
    new_logprobs: list[TokenLogprob]  # empty unless the request asked for logprobs
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None  # all so far; filled by generate()
    # With `prompt_logprobs` asked: on the request's first output, one entry per
    # prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Prompt tokens taken from the prefix cache instead of computed (OpenAI's
    # usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far (a stop token counts)."""
        return len(self.token_ids)


def prepare_inputs(
    chunks: Sequence[ScheduledChunk], blocks: BlockManager, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten the step's chunks into the model's inputs: input_ids [T], positions [T]
    and the attention metadata (slots, padded block tables, query starts, lengths,
    and window slots and rows when the cache keeps a full-precision window)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    context_lens: list[int] = []
    tables: list[list[int]] = []
    window_slots: list[int] = []
    window_rows: list[int] = []
    for chunk in chunks:
        seq_id = chunk.seq.request_id
        input_ids += chunk.seq.token_ids(chunk.start, chunk.end)
        positions += range(chunk.start, chunk.end)
        slots += blocks.slot_mapping(seq_id, chunk.start, chunk.end)
        query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
        context_lens.append(chunk.end)
        tables.append(blocks.block_table(seq_id))
        if blocks.window:
            window_slots += blocks.window_slots(seq_id, chunk.start, chunk.end)
            window_rows.append(blocks.window_row(seq_id))
    width = max(len(t) for t in tables)
    # Entries past a sequence's context are never read; 0 is just a valid block id.
    padded = [t + [0] * (width - len(t)) for t in tables]
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        decode_only=all(chunk.num_tokens == 1 for chunk in chunks),
    )
    if blocks.window:
        attn.window_slots = torch.tensor(window_slots, dtype=torch.int64, device=device)
        attn.window_rows = torch.tensor(window_rows, dtype=torch.int32, device=device)
    ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return ids, pos, attn


class EngineMetrics:
    """Prometheus metrics of one engine, in its own registry (several engines can live
    in one process, e.g. in tests)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        sched, blocks = engine.scheduler, engine.kv.blocks
        Gauge(
            "engine_num_requests_running", "Sequences in the running batch", registry=r
        ).set_function(lambda: len(sched.running))
        Gauge(
            "engine_num_requests_waiting", "Sequences waiting for KV blocks", registry=r
        ).set_function(lambda: len(sched.waiting))
        Gauge("engine_kv_blocks_used", "KV blocks held", registry=r).set_function(
            lambda: blocks.num_used_blocks
        )
        Gauge("engine_kv_blocks_free", "KV blocks free", registry=r).set_function(
            lambda: blocks.num_free_blocks
        )
        Gauge("engine_kv_blocks_total", "KV blocks in the pool", registry=r).set(
            blocks.num_blocks
        )
        Gauge("engine_kv_block_size_tokens", "Tokens per KV block", registry=r).set(
            blocks.block_size
        )
        Gauge(
            "engine_kv_bytes_per_token",
            "KV cache bytes per token, all layers, scales included",
            ["kv_cache_dtype"],
            registry=r,
        ).labels(engine.kv.kv_dtype).set(engine.kv.bytes_per_token)
        Gauge("engine_kv_cache_bytes", "Bytes of KV cache storage", registry=r).set(
            engine.kv.nbytes
        )
        Gauge(
            "engine_kv_window_tokens",
            "Newest tokens per sequence also kept in bf16 (0: no window)",
            registry=r,
        ).set(engine.kv.window)
        # One observation per step, one bucket per count up to max_num_seqs: the
        # most sequences run at once over any span is the highest count whose
        # bucket grew over it, exact however often and by how many scrapers
        # /metrics is read (the gauge above, read now and then, misses short peaks).
        # vLLM names its per-step histograms `iteration_*`.
        self.running_per_step = Histogram(
            "engine_iteration_num_requests_running",
            "Sequences in the running batch, observed once per engine step",
            buckets=range(sched.max_num_seqs + 1),
            registry=r,
        )
        self.preemptions = Counter(
            "engine_preemptions", "Sequences preempted for KV blocks", registry=r
        )
        # Ours and vLLM's names (prometheus_client adds _total to both), so that a
        # dashboard or load tester made for vLLM reads the hit rate here too.
        self.prefix_cache_queries = [
            Counter(name, "Prompt tokens looked up in the prefix cache", registry=r)
            for name in ("engine_prefix_cache_queries", "vllm:prefix_cache_queries")
        ]
        self.prefix_cache_hits = [
            Counter(name, "Prompt tokens found in the prefix cache", registry=r)
            for name in ("engine_prefix_cache_hits", "vllm:prefix_cache_hits")
        ]
        Gauge(
            "engine_prefix_cache_blocks",
            "KV blocks in the prefix cache (held or free)",
            registry=r,
        ).set_function(lambda: blocks.pool.num_cached_blocks)
        self.generation_tokens = Counter(
            "engine_generation_tokens", "Tokens generated", registry=r
        )
        self.prompt_tokens = Counter(
            "engine_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.requests_finished = Counter(
            "engine_requests_finished",
            "Requests finished",
            ["finish_reason"],
            registry=r,
        )
        latency_buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
        latency_buckets += (1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.time_to_first_token = Histogram(
            "engine_time_to_first_token_seconds",
            "Request arrival to its first generated token",
            buckets=latency_buckets,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "engine_inter_token_latency_seconds",
            "Time between successive tokens of a request",
            buckets=latency_buckets,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "engine_e2e_request_latency_seconds",
            "Request arrival to its last token",
            buckets=latency_buckets,
            registry=r,
        )


class LLMEngine:
    """Continuous-batching generation over a paged, possibly quantized KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        kv_cache_dtype: str = "bf16",
        kv_memory_bytes: int | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = 512,
        max_model_len: int | None = None,
        prepack_weights: bool = True,
        kv_window: int | None = None,
        enable_prefix_caching: bool = True,
        quantize_head: str | None = None,
        int8_activations: bool = False,
    ) -> None:
        """Size the KV pool by `num_blocks` or else `kv_memory_bytes` (256 MiB).

        With `enable_prefix_caching` (vLLM's automatic prefix caching), a request
        starts from the cached K/V of every full block of its prompt that an
        earlier one computed (`gpuagent.engine.cache`); greedy outputs are the same
        either way.

        `kv_window` newest tokens of each sequence are also kept in bf16 beside a
        quantized cache (default: `DEFAULT_KV_WINDOW`); one window row per
        `max_num_seqs`, taken out of `kv_memory_bytes`.

        On a CPU, `prepack_weights` lays the model's float32 (or bf16, where oneDNN
        has bf16 kernels) projections out once for oneDNN (`model.Linear`), which
        makes decode GEMMs 2x faster; the weights must not change afterwards.

        `quantize_head` ("int8", "int4", "bf16") replaces the output head by its
        own lower-precision copy (`engine.weights.quantize_head`): faster decode for
        a small model, at a logits cost the engine bench prints ("int8" is a GGUF's
        Q8_0 head precision: none on SmolLM2, converted from one); None keeps the
        checkpoint's head (a release compressed with the recipe option
        head="int8" carries that int8 head itself).

        `int8_activations` runs the int4 layers' CPU decode kernel with activations
        rounded to int8 per block of 32, as llama.cpp does
        (`engine.weights.use_int8_activations`): faster decode at a logits cost
        the llama.cpp bench prints; refused (Int8ActivationsError) where it does
        not apply (a model that is not float32 on a CPU, or has no int4 weights)."""
        self.model = model.eval()
        if quantize_head is not None:
            quantize_head_weights(model, quantize_head)
        if prepack_weights and hasattr(model, "prepack_cpu_weights"):
            model.prepack_cpu_weights()
        if int8_activations:
            use_int8_activations(model)
        self.tokenizer = tokenizer
        self.config = model.config
        self.device = next(model.parameters()).device
        self.kv = engine_kv_cache(
            self.config,
            kv_cache_dtype,
            kv_memory_bytes=kv_memory_bytes,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            kv_window=kv_window,
            device=self.device,
        )
        # fp8: per-head scales from the built-in calibration text
        calibrate_kv_caches(model, tokenizer, self.kv.kv_caches)
        if enable_prefix_caching:  # after calibration: the scales are in the root
            self.kv.enable_prefix_caching(model_digest(model))
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.scheduler = Scheduler(
            self.kv.blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        self.eos_token_ids = _eos_ids(self.config, tokenizer)
        self.metrics = EngineMetrics(self)
        self._reported = {"preemptions": 0, "queries": 0, "hits": 0}
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        *,
        files: Mapping[str, bytes] | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        **kwargs: Any,
    ) -> LLMEngine:
        """Load model + tokenizer from a folder; with `files` (what verify-on-load
        returns) both are built from those bytes only, nothing read from disk."""
        from gpuagent.engine.loader import load_model
        from gpuagent.engine.tokenizer import load_tokenizer

        model = load_model(model_dir, dtype=dtype, device=device, files=files)
        return cls(model, load_tokenizer(model_dir, files=files), **kwargs)

    # -- requests --------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt; text is encoded by the tokenizer's own rule
        (`Tokenizer.encode_prompt`: BOS only where the tokenizer adds one)."""
        if not isinstance(prompt, str):
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.config.vocab_size for t in ids):
                raise ValueError(
                    f"prompt token ids must be in [0, {self.config.vocab_size})"
                )
            return ids
        if not prompt.isascii():
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                # JSON may carry lone surrogates (\ud800); the tokenizer cannot.
                raise ValueError(
                    "the prompt is not valid Unicode (it has a lone surrogate)"
                ) from None
        return self.tokenizer.encode_prompt(prompt)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams):
        """Raise ValueError (RequestTooLargeError for length) if the request can't be
        served; safe to call from any thread."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        params.validate()
        bad = [t for t in params.logit_bias if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token ids must be in [0, {self.config.vocab_size}), "
                f"got {bad[0]}"
            )
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)

    def make_sequence(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> Seq:
        """A validated, not yet queued sequence."""
        prompt_ids = self.encode_prompt(prompt)
        self.check_request(prompt_ids, params)
        generator = params.make_generator(self.device)
        return Seq(request_id, prompt_ids, params, generator=generator)

    def add_sequence(self, seq: Seq) -> None:
        """Queue a sequence made by `make_sequence`."""
        with self._lock:
            self.scheduler.add(seq)

    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams
    ) -> None:
        """Validate and queue a request (ValueError if it can't be served)."""
        self.add_sequence(self.make_sequence(request_id, prompt, params))

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its KV blocks now; False if it isn't live."""
        with self._lock:
            seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.metrics.requests_finished.labels("abort").inc()
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        """Whether any request waits or runs."""
        return self.scheduler.has_unfinished()

    # -- one step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return an output for each request that got a
        token (or finished) in it."""
        with self._lock, torch.inference_mode():
            out = self.scheduler.schedule()
            self.kv.apply_sink_copies()  # int4c hits: position 0 into their rows
            # after admission, before anything finishes: the step's most
            self.metrics.running_per_step.observe(len(self.scheduler.running))
            self._report_counts()
            if out.is_empty:
                return []
            # A prompt scored with max_tokens=0 ends after its prefill, unsampled.
            scored = [
                c for c in out.chunks if c.samples and not c.seq.params.max_tokens
            ]
            sampling_chunks = [
                c for c in out.chunks if c.samples and c.seq.params.max_tokens
            ]
            if any(_wants_prompt_logprobs(c) for c in out.chunks):
                logits = self._forward(out.chunks, all_logits=True)  # [T, vocab]
                ends = self._record_prompt_logprobs(out.chunks, logits)
                logits = logits[ends]  # [B, vocab], each chunk's last token
            else:
                logits = self._forward(out.chunks)  # [B, vocab]
            if len(sampling_chunks) < len(out.chunks):  # unfinished prompt chunks
                rows = [i for i, c in enumerate(out.chunks) if c in sampling_chunks]
                logits = logits[rows]
            params = [c.seq.params for c in sampling_chunks]
            adjusted = None
            if any(p.adjusts_logits for p in params):
                adjusted = adjust_logits(
                    logits,
                    params,
                    [c.seq.prompt_token_ids for c in sampling_chunks],
                    [c.seq.output_token_ids for c in sampling_chunks],
                    [self.stop_token_ids(p) for p in params],
                )
            tokens = sample(
                logits,
                params,
                [c.seq.generator for c in sampling_chunks],
                adjusted,
            )
            self.scheduler.commit(
                out,
                {
                    c.seq.request_id: t.token_id
                    for c, t in zip(sampling_chunks, tokens, strict=True)
                },
            )
            self.kv.apply_sink_copies()  # before a finished sequence's row is reused
            self.metrics.generation_tokens.inc(len(tokens))
            outputs = [self._finish_scored(c.seq) for c in scored]
            return outputs + [
                self._process_token(c.seq, t)
                for c, t in zip(sampling_chunks, tokens, strict=True)
            ]

    def _report_counts(self) -> None:
        """Add what the scheduler counted since the last step to the counters."""
        sched, metrics = self.scheduler, self.metrics
        for key, total, counters in (
            ("preemptions", sched.num_preemptions, [metrics.preemptions]),
            ("queries", sched.prefix_cache_queries, metrics.prefix_cache_queries),
            ("hits", sched.prefix_cache_hits, metrics.prefix_cache_hits),
        ):
            if total > self._reported[key]:
                for counter in counters:
                    counter.inc(total - self._reported[key])
                self._reported[key] = total

    def _forward(
        self, chunks: Sequence[ScheduledChunk], all_logits: bool = False
    ) -> torch.Tensor:
        input_ids, positions, attn = prepare_inputs(chunks, self.kv.blocks, self.device)
        if all_logits:
            return self.model(input_ids, positions, self.kv.kv_caches, attn, True)
        return self.model(input_ids, positions, self.kv.kv_caches, attn)

    def stop_token_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids)
        return ids if params.ignore_eos else ids | self.eos_token_ids

    def _record_prompt_logprobs(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor
    ) -> list[int]:
        """Append to each asking sequence's `prompt_logprobs` the prompt tokens this
        step's logits [T, vocab] predict (each once: a recomputation after a
        preemption adds none); return the row of each chunk's last token."""
        ends, row = [], 0
        for chunk in chunks:
            ends.append(row + chunk.num_tokens - 1)
            seq, num_prompt = chunk.seq, len(chunk.seq.prompt_token_ids)
            if _wants_prompt_logprobs(chunk):
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs.append(None)  # nothing predicts token 0
                # Row i of the chunk (position start + i) predicts start + i + 1.
                first = len(seq.prompt_logprobs)
                last = min(chunk.end + 1, num_prompt)  # targets first..last-1
                if first < last:
                    rows = slice(
                        row + first - 1 - chunk.start, row + last - 1 - chunk.start
                    )
                    seq.prompt_logprobs += token_logprobs(
                        logits[rows],
                        seq.prompt_token_ids[first:last],
                        seq.params.prompt_logprobs or 0,
                    )
            row += chunk.num_tokens
        return ends

    def _finish_scored(self, seq: Seq) -> RequestOutput:
        """The only output of a prompt scored with max_tokens=0: finished, no token."""
        self.scheduler.finish(seq, "length")
        self.metrics.requests_finished.labels("length").inc()
        self.metrics.prompt_tokens.inc(len(seq.prompt_token_ids))
        self.metrics.e2e_latency.observe(time.monotonic() - seq.arrival_s)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=[],
            text="",
            new_token_ids=[],
            new_text="",
            new_logprobs=[],
            finished=True,
            finish_reason="length",
            prompt_logprobs=list(seq.prompt_logprobs),
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _process_token(self, seq: Seq, token: SampledToken) -> RequestOutput:
        now = time.monotonic()
        prompt_logprobs = None
        if seq.first_token_s is None:
            if seq.params.prompt_logprobs is not None:
                prompt_logprobs = list(seq.prompt_logprobs)
            seq.first_token_s = now
            self.metrics.time_to_first_token.observe(now - seq.arrival_s)
        elif seq.last_token_s is not None:
            self.metrics.inter_token_latency.observe(now - seq.last_token_s)
        seq.last_token_s = now
        params = seq.params
        if params.logprobs is not None:
            seq.token_logprobs.append(
                TokenLogprob(token.token_id, token.logprob, token.top_logprobs)
            )

        finish_reason = None
        text_ids = seq.output_token_ids
        is_stop_token = token.token_id in params.stop_token_ids or (
            not params.ignore_eos and token.token_id in self.eos_token_ids
        )
        if is_stop_token:
            finish_reason = "stop"
            text_ids = text_ids[:-1]  # the stop token's text isn't part of the answer
        elif len(seq.output_token_ids) >= params.max_tokens:
            finish_reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            finish_reason = "length"

        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
        text = seq.detokenizer.text(text_ids)
        if params.stop and len(seq.output_token_ids) >= params.min_tokens:
            # Matches ending inside the previous text's settled part were looked for
            # already; its trailing U+FFFD may have become a different character.
            settled = len(seq.output_text.rstrip(REPLACEMENT_CHAR))
            cut = find_stop_string(text, params.stop, settled)
            if cut is not None:
                text, finish_reason = text[:cut], "stop"
        seq.output_text = text

        releasable = len(text)
        if finish_reason is None:
            # Hold back a cut-off UTF-8 character and a possible stop-string start.
            releasable = len(text.rstrip(REPLACEMENT_CHAR))
            if params.stop:
                releasable -= stop_holdback(text[:releasable], params.stop)
        releasable = max(releasable, seq.num_emitted_chars)
        new_text = text[seq.num_emitted_chars : releasable]
        seq.num_emitted_chars = releasable

        if finish_reason is not None:
            self.scheduler.finish(seq, finish_reason)
            self.metrics.requests_finished.labels(finish_reason).inc()
            self.metrics.prompt_tokens.inc(len(seq.prompt_token_ids))
            self.metrics.e2e_latency.observe(now - seq.arrival_s)
        new_logprobs = seq.token_logprobs[-1:]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            new_token_ids=[token.token_id],
            new_text=new_text,
            new_logprobs=new_logprobs,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- convenience -----------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` together to completion; final outputs in prompt order, with
        `logprobs` holding every token's and `prompt_logprobs` the prompt's when
        asked."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprob]] = collections.defaultdict(list)
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        while len(final) < len(ids):
            for out in self.step():
                logprobs[out.request_id] += out.new_logprobs
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    final[out.request_id] = out
        for request_id, p in zip(ids, params, strict=True):
            if p.logprobs is not None:
                final[request_id].logprobs = logprobs[request_id]
            final[request_id].prompt_logprobs = prompt_logprobs.get(request_id)
        return [final[request_id] for request_id in ids]


def _wants_prompt_logprobs(chunk: ScheduledChunk) -> bool:
    """Whether the chunk covers prompt tokens whose logprobs its request asked for."""
    return chunk.seq.params.prompt_logprobs is not None and chunk.start < len(
        chunk.seq.prompt_token_ids
    )


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], top_n: int
) -> list[TokenLogprob]:
    """The logprob of `token_ids[i]` under row i of logits [N, vocab], with the
    row's top-`top_n` (id, logprob), best first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(list(token_ids), device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()  # [N]
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if top_n:
        top = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]
    return [
        TokenLogprob(t, lp, top)
        for t, lp, top in zip(token_ids, chosen, tops, strict=True)
    ]


def _eos_ids(config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Iterable):
        ids.update(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(tok_eos)
    return ids


# ---------------------------------------------------------------------------- async


class RequestStream:
    """Async iterator over one request's outputs; leaving it early aborts it."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if item.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
        self.engine.forget(self.request_id)


class AsyncLLMEngine:
    """Runs `LLMEngine.step` on a background thread for asyncio callers.

    Adds and aborts are queued and applied by the engine thread between steps, so the
    engine's state is only ever touched by that thread.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._ops: collections.deque[tuple[str, Any]] = collections.deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._streams_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.step_errors = 0

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="llm-engine", daemon=True
            )
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; live requests are aborted."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._streams_lock:
            streams = list(self._streams.values())
        for loop, stream in streams:
            _put(loop, stream.queue, RuntimeError("the engine shut down"))

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> RequestStream:
        """Validate and queue a request (raises ValueError at once if it can't be
        served); iterate the returned stream for its outputs. Call from a loop."""
        request_id = request_id or uuid.uuid4().hex
        seq = self.engine.make_sequence(request_id, prompt, params)
        stream = RequestStream(self, request_id)
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._ops.append(("add", seq))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the next step."""
        self._ops.append(("abort", request_id))
        self._wake.set()

    def forget(self, request_id: str) -> None:
        """Drop the stream of a finished or aborted request."""
        with self._streams_lock:
            self._streams.pop(request_id, None)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_live_streams(self) -> int:
        """Requests whose stream is still open."""
        return len(self._streams)

    def _apply_ops(self) -> None:
        while self._ops:
            op, arg = self._ops.popleft()
            if op == "add":
                try:
                    self.engine.add_sequence(arg)
                except ValueError as exc:
                    self._send(arg.request_id, exc)
            elif self.engine.abort(arg):
                self._send(arg, _aborted_output(arg))

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            entry = self._streams.get(request_id)
        if entry is not None:
            _put(entry[0], entry[1].queue, item)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_ops()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # keep serving: fail the batch, not the server
                log.exception("engine step failed")
                self.step_errors += 1
                self._fail_all(exc)
                continue
            for out in outputs:
                self._send(out.request_id, out)

    def _fail_all(self, exc: Exception) -> None:
        sched = self.engine.scheduler
        for seq in list(sched.running) + list(sched.waiting):
            self.engine.abort(seq.request_id)
            self._send(seq.request_id, RuntimeError(f"engine step failed: {exc}"))


def _aborted_output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], [], "", [], "", [], True, "abort")


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: Any) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the caller's loop is closed: nobody is listening
        pass
