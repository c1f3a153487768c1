"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request
seeds, stop strings / stop token ids, max_tokens, logprobs.

Each random row draws from its own `torch.Generator` (seeded per request), one draw per
sampled token, so a seeded request gives the same tokens whatever it is batched with.
Logprobs are those of the model's raw distribution (before temperature / top-k /
top-p), which is what the quality regression compares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_LOGPROBS = 20
# Below this temperature a request is greedy: dividing float32 logits by a smaller one
# overflows them to inf, whose softmax is NaN, and the draw would fail the whole batch.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Every generated token is checked against every stop string on the engine thread, so
# a request with thousands of them stalls every other request (OpenAI allows 4).
MAX_STOP_STRINGS = 16
# torch.Generator.manual_seed takes any 64-bit seed, signed or unsigned.
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; N: chosen token + top-N

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}"
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or below MIN_SAMPLING_TEMPERATURE) means argmax."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def make_generator(
        self, device: str | torch.device = "cpu"
    ) -> torch.Generator | None:
        """The request's own RNG on the logits' device when it has a seed (None: the
        global RNG)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


@dataclass
class SampledToken:
    """One sampled token with its logprob and the top-N alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


def apply_top_k_top_p(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / nucleus(top_p) to -inf.  logits [V]."""
    vocab_size = logits.shape[-1]
    if 0 < top_k < vocab_size:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens above it already cover top_p; the first one
        # always stays.
        cum_before = probs.cumsum(-1) - probs
        drop_sorted = cum_before >= top_p
        # A top_p below float32's range compares as 0, which would drop every token.
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Draw one token id from logits [V] under `params` (not greedy)."""
    scaled = logits / params.temperature
    scaled = apply_top_k_top_p(scaled, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[SampledToken]:
    """Pick the next token of each row of logits [B, V] (float32)."""
    if not params:
        return []
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    # Greedy rows all at once; random rows draw one by one from their own generator.
    chosen_ids = logits.argmax(dim=-1)  # [B]
    random_rows = [row for row, p in enumerate(params) if not p.greedy]
    if random_rows:
        drawn = [sample_row(logits[r], params[r], generators[r]) for r in random_rows]
        chosen_ids[random_rows] = torch.tensor(drawn, device=chosen_ids.device)
    token_ids = chosen_ids.tolist()
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()  # [B]
    max_top = max((p.logprobs or 0 for p in params), default=0)
    top_values = top_ids = None
    if max_top:
        top = torch.topk(logprobs, min(max_top, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    results = []
    for row, p in enumerate(params):
        alternatives: list[tuple[int, float]] = []
        if p.logprobs and top_ids is not None and top_values is not None:
            n = p.logprobs
            alternatives = list(zip(top_ids[row][:n], top_values[row][:n], strict=True))
        results.append(SampledToken(token_ids[row], chosen[row], alternatives))
    return results


def find_stop_string(text: str, stops: Sequence[str], new_from: int) -> int | None:
    """Index where the earliest stop string in `text` starts, looking only at matches
    that end after `new_from` (text before it was already checked); None if none."""
    best: int | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_from - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing chars of `text` could be the start of a stop string; a stream
    holds them back so that streamed and non-streamed text agree."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
