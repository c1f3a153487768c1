"""A model folder scored in this process by the project's engine, with its own KV
cache dtype: full next-token distributions, teacher-forced through the engine's
paged cache (so a quantized cache is read back as serving reads it), and greedy
continuations through `LLMEngine.generate`.

A prompt is prefilled in the chunks the engine's scheduler gives a lone request
(`max_num_batched_tokens` tokens each), not in chunks of our own choosing: chunked
alike, the in-process distributions are bit for bit those the server returns for the
same prompt sent alone. (With a full-precision window beside a quantized cache
(int4, fp8) each query reads the window of its own position, so other chunkings give
the same distributions up to float summation order.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import torch

from gpuagent.engine.arch import MoETransformer
from gpuagent.engine.cache import blocks_needed
from gpuagent.engine.engine import LLMEngine, prepare_inputs
from gpuagent.engine.loader import load_model
from gpuagent.engine.routing import RoutingRecorder
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.scheduler import ScheduledChunk
from gpuagent.engine.scheduler import Sequence as Seq
from gpuagent.engine.token_text import TokenBytes, bytes_text
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate.metrics import TopN

BLOCK_SIZE = 16


class EngineModel:
    """A model folder loaded by `LLMEngine` with a KV cache of `kv_cache_dtype`
    holding one sequence of up to `max_tokens`."""

    def __init__(
        self,
        model_dir: str | Path,
        kv_cache_dtype: str = "bf16",
        max_tokens: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        model=None,
    ) -> None:
        """`model`: the folder's model already loaded (shared by several sides of
        one process, e.g. the bench's KV dtypes); None loads it."""
        self.label = f"{model_dir} (kv {kv_cache_dtype})"
        self.kv_cache_dtype = kv_cache_dtype
        if model is None:
            model = load_model(model_dir, dtype=dtype, device=device)
        limit = model.config.max_position_embeddings
        self.max_model_len = min(limit, max_tokens) if max_tokens else limit
        self.engine = LLMEngine(
            model,
            load_tokenizer(model_dir),
            kv_cache_dtype=kv_cache_dtype,
            num_blocks=blocks_needed(self.max_model_len, BLOCK_SIZE),
            block_size=BLOCK_SIZE,
            max_num_seqs=1,
            max_model_len=self.max_model_len,
        )
        self._token_bytes = TokenBytes(self.engine.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids as the engine serves the text (BOS by the tokenizer's rule)."""
        return self.engine.encode_prompt(text)

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as a prompt."""
        return len(self.encode(text))

    def token_key(self, token_id: int) -> str:
        """A token as an OpenAI server names it in logprobs (to compare with one)."""
        return bytes_text(self._token_bytes(token_id))

    @property
    def routes_experts(self) -> bool:
        """Whether the model has MoE layers (a router to compare)."""
        model = self.engine.model
        return isinstance(model, MoETransformer) and bool(model.moe_layers)

    @property
    def router_shape(self) -> tuple[int, int]:
        """(routed experts, experts per token) of a model that routes experts."""
        config = self.engine.model.config
        return config.n_routed_experts, config.num_experts_per_tok

    def logprobs_chunks(
        self, ids: list[int], routing: RoutingRecorder | None = None
    ) -> Iterator[torch.Tensor]:
        """Log-probs [n, vocab] of the next token at each position of `ids`, chunk
        by chunk as the scheduler prefills a lone prompt, the K/V of every earlier
        token read back from the engine's cache. `routing` (a model that routes
        experts only) records every MoE layer's expert ids of every token."""
        extra = {} if routing is None else {"routing": routing}
        engine, blocks = self.engine, self.engine.kv.blocks
        chunk_tokens = engine.scheduler.max_num_batched_tokens
        seq_id = f"evaluate-{uuid.uuid4().hex}"
        seq = Seq(seq_id, ids, SamplingParams(max_tokens=1))
        if not blocks.ensure_capacity(seq_id, len(ids)):
            raise ValueError(
                f"{len(ids)} tokens don't fit the evaluation KV cache "
                f"({blocks.capacity_tokens} tokens)"
            )
        try:
            for start in range(0, len(ids), chunk_tokens):
                # inference mode only around the forward, never across the yield:
                # a generator suspended inside it would leave the caller's thread in
                # it, and two interleaved ones (candidate and reference) would restore
                # each other's saved state and leave autograd off for the process
                with torch.inference_mode():
                    chunk = ScheduledChunk(
                        seq, start, min(chunk_tokens, len(ids) - start)
                    )
                    input_ids, positions, attn = prepare_inputs(
                        [chunk], blocks, engine.device
                    )
                    logits = engine.model(
                        input_ids, positions, engine.kv.kv_caches, attn, True, **extra
                    )  # [n, vocab]
                    logprobs = torch.log_softmax(logits.float(), dim=-1)
                yield logprobs
        finally:
            blocks.free(seq_id)

    def top_n(self, ids: list[int], n: int) -> list[TopN]:
        """Positions 1.. of `ids` as an endpoint would report them with echo."""
        out = []
        position = 0
        for logprobs in self.logprobs_chunks(ids):
            top = torch.topk(logprobs, n, dim=-1) if n else None
            for row in range(logprobs.shape[0]):
                position += 1
                if position >= len(ids):
                    break
                token = ids[position]
                alternatives = {}
                if top is not None:
                    for i, v in zip(
                        top.indices[row].tolist(), top.values[row].tolist(), strict=True
                    ):
                        alternatives.setdefault(self.token_key(i), v)
                out.append(
                    TopN(
                        self.token_key(token), logprobs[row, token].item(), alternatives
                    )
                )
        return out

    def greedy(self, ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        """The greedy continuation of `ids`: token ids and text."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        (out,) = self.engine.generate([ids], params)
        return out.token_ids, out.text
