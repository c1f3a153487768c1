"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request
seeds, stop strings / stop token ids, max_tokens, min_tokens, logprobs and prompt
logprobs, and the logits adjustments OpenAI and vLLM define: `logit_bias`,
`presence_penalty`, `frequency_penalty`, `repetition_penalty`.

Each random row draws from its own `torch.Generator` (seeded per request), one draw per
sampled token, so a seeded request gives the same tokens whatever it is batched with.
Logprobs are those of the model's raw distribution (before logit bias, penalties,
temperature, top-k / top-p; vLLM's default `raw_logprobs`), which is what the quality
regression compares; the adjustments change only which token is picked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
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
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100].
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# OpenAI takes at most 300 biased tokens per request.
MAX_LOGIT_BIAS_TOKENS = 300


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
    # Logprob of each prompt token (after the first) + top-N; None: none. With it,
    # max_tokens may be 0: the prompt is scored and nothing generated.
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # no stop token or stop string before this many tokens
    presence_penalty: float = 0.0  # subtracted once from each generated token's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    # CTRL/HF: logits of tokens in the prompt or the output divided by it (> 0) when
    # positive, multiplied when negative; 1.0: none.
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""
        scoring_only = self.prompt_logprobs is not None and self.max_tokens == 0
        if not isinstance(self.max_tokens, int) or (
            self.max_tokens < 1 and not scoring_only
        ):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(
                f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                f"{len(self.logit_bias)}"
            )
        for token_id, bias in self.logit_bias.items():
            if not LOGIT_BIAS_RANGE[0] <= bias <= LOGIT_BIAS_RANGE[1]:
                raise ValueError(
                    f"logit_bias of token {token_id} must be in [-100, 100], got {bias}"
                )
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}"
                )

    @property
    def adjusts_logits(self) -> bool:
        """Whether `adjust_logits` changes anything for this request (min_tokens
        only while the output is shorter, which the caller checks)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
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


def adjust_logits(
    logits: Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    stop_ids: Sequence[Iterable[int]],
) -> Tensor:
    """A copy of logits [B, V] with each row's logit bias, min_tokens ban (`stop_ids`
    of row b: its EOS and stop token ids, -inf while it has fewer than min_tokens
    outputs) and penalties applied, in vLLM's order; rows that ask for none are
    left as they are."""
    adjusted = logits.clone()
    vocab_size = logits.shape[-1]
    for row, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        x = adjusted[row]  # [V], a view: edited in place
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=x.device)
            x[ids] += torch.tensor(list(p.logit_bias.values()), device=x.device)
        if len(output_ids[row]) < p.min_tokens:
            banned = [t for t in stop_ids[row] if 0 <= t < vocab_size]
            x[banned] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=x.device)
            seen[
                torch.tensor([*prompt_ids[row], *output_ids[row]], device=x.device)
            ] = True
            penalized = torch.where(
                x > 0, x / p.repetition_penalty, x * p.repetition_penalty
            )
            x.copy_(torch.where(seen, penalized, x))
        if (p.presence_penalty or p.frequency_penalty) and output_ids[row]:
            out = torch.tensor(list(output_ids[row]), device=x.device)
            counts = torch.bincount(out, minlength=vocab_size)[:vocab_size].float()
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return adjusted


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    adjusted: Tensor | None = None,
) -> list[SampledToken]:
    """Pick the next token of each row of logits [B, V] (float32); with `adjusted`
    (`adjust_logits` of them) the pick is made from those, and the logprobs
    reported are still the raw logits'."""
    if not params:
        return []
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    picked_from = logits if adjusted is None else adjusted.float()
    # Greedy rows all at once; random rows draw one by one from their own generator.
    chosen_ids = picked_from.argmax(dim=-1)  # [B]
    random_rows = [row for row, p in enumerate(params) if not p.greedy]
    if random_rows:
        drawn = [
            sample_row(picked_from[r], params[r], generators[r]) for r in random_rows
        ]
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
