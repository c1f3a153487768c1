"""Prefix-cache benchmark: `python -m gpuagent.benches.prefix_cache [--model-dir DIR]
[--quick]`.

Runs the serving engine in process (no HTTP) with the prefix cache on and off and
prints ratios measured side by side in one run, rounds interleaved (medians of the
rounds, since other processes share the CPU), each with its target and PASS/FAIL,
or "info":

- like for like (first): the time to first token of a cold request, nothing of it
  cached, with the cache on vs off: what keeping the cache costs a request that
  can't use it (hashing its blocks, looking them up);
- the time to first token of a request whose first `--prefix-tokens` (2048) tokens
  an earlier request computed, vs a cold request of the same length (target
  >= 5x); each round's cold request has a prefix of its own, so nothing of it is
  cached;
- multi-turn chat: sessions that carry their history from turn to turn, with a
  shared system prompt, run concurrently (each session sends its next turn when its
  answer is back, closed loop); output tokens per second with the cache on vs off
  (target >= 1.5x), and the prefix-cache hit rate the engine counted (its
  prefix_cache_hits / prefix_cache_queries, about 80% by the sessions' shape);
  both runs generate the same greedy tokens, which is checked;
- with `--kv-dtypes`, the same TTFT ratio on other KV dtypes, for information: fp8
  and int4 recompute layers * (window - 1) tokens before a cached prefix to rebuild
  their full-precision window exactly, int4c layers * (window - 2) after copying
  position 0 from its first block's sink (gpuagent/engine/cache.py).

Text comes from the corpus the demo model was trained on (`gpuagent.models.corpus`:
the Python reference docs) for the long prefixes and system prompts, and from the
shipped eval sets (English, code and Korean passages) for the chat turns. Runs on the
demo model by default (`gpuagent/engine/demo_model`, a quick run; the prefix is then
cut to fit its 2048-token context), or on `--model-dir`, e.g.
var/models/smollm2-135m. The exit status is the number of judged rows that fail.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches.engine import Row
from gpuagent.engine.engine import LLMEngine, RequestOutput
from gpuagent.engine.sampling import SamplingParams
from gpuagent.evaluate.evalsets import load_text_slices
from gpuagent.models import corpus

TTFT_TARGET = 5.0
CHAT_TARGET = 1.5
KV_MEMORY_BYTES = 1 << 30
BLOCK_SIZE = 16


# -------------------------------------------------------------------------- text


class TextSource:
    """Token runs cut from the corpus's English docs, each from text no other run
    has used, so that no two of them share a block."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.docs = corpus.english_docs(heldout=False)
        self.next_doc = 0

    def tokens(self, count: int) -> list[int]:
        """`count` token ids of fresh text (docs joined until there are enough),
        without the BOS a prompt starts with (`prompt`)."""
        ids: list[int] = []
        while len(ids) < count:
            if self.next_doc == len(self.docs):
                raise RuntimeError("the corpus ran out of fresh text")
            ids += self.tokenizer.encode(self.docs[self.next_doc] + "\n\n")
            self.next_doc += 1
        return ids[:count]

    def prompt(self, count: int) -> list[int]:
        """A prompt: what the tokenizer starts one with (BOS, for some), then
        `count` tokens of fresh text."""
        return self.tokenizer.prompt_prefix_ids + self.tokens(count)


def chat_turns() -> list[str]:
    """User messages: the eval sets' passages, English, code and Korean in turn."""
    slices = load_text_slices()
    return [
        p for group in zip(*(s.passages for s in slices), strict=True) for p in group
    ]


# -------------------------------------------------------------------------- runs


def time_to_first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding `prompt` to its first token, and its cached tokens."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(f"ttft-{started}", prompt, params)
    while True:
        for out in engine.step():
            if out.finished:
                return time.perf_counter() - started, out.num_cached_tokens


def ttft_rows(
    engines: dict[str, LLMEngine],
    text: TextSource,
    prefix_tokens: int,
    suffix_tokens: int,
    rounds: int,
) -> list[Row]:
    """Like-for-like cold TTFT (cache on vs off) first, then shared-prefix vs cold
    TTFT per KV dtype, rounds interleaved."""
    shared = text.prompt(prefix_tokens)
    for engine in engines.values():
        if engine.kv.blocks.prefix_caching:
            time_to_first_token(engine, shared + text.tokens(suffix_tokens))
    times: dict[str, list[float]] = {name: [] for name in engines}
    warm: dict[str, list[float]] = {name: [] for name in engines}
    cached: dict[str, int] = {}
    for _ in range(rounds):
        cold_prompt = text.prompt(prefix_tokens + suffix_tokens)
        suffix = text.tokens(suffix_tokens)
        for name, engine in engines.items():
            seconds, num_cached = time_to_first_token(engine, cold_prompt)
            assert num_cached == 0
            times[name].append(seconds)
            if engine.kv.blocks.prefix_caching:
                seconds, cached[name] = time_to_first_token(engine, shared + suffix)
                warm[name].append(seconds)
    median = {name: statistics.median(v) for name, v in times.items()}
    rows = [
        Row(
            "like for like: cold TTFT, cache off / on (bf16)",
            f"{median['bf16-off'] / median['bf16']:.2f}x",
            "info",
            None,
        )
    ]
    for name in engines:
        if not warm[name]:
            continue
        ratio = median[name] / statistics.median(warm[name])
        judged = name == "bf16"
        rows.append(
            Row(
                f"TTFT cold / {prefix_tokens}-token prefix cached ({name}, "
                f"{cached[name]} cached)",
                f"{ratio:.1f}x",
                f">= {TTFT_TARGET:g}x" if judged else "info",
                ratio >= TTFT_TARGET if judged else None,
            )
        )
    rows.append(
        Row(
            f"cold TTFT of {prefix_tokens + suffix_tokens} tokens (bf16, cache off)",
            f"{median['bf16-off'] * 1000:.0f} ms",
            "info",
            None,
        )
    )
    return rows


@dataclass
class ChatRun:
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    answers: dict[str, list[int]]


def run_chat(
    engine: LLMEngine,
    system: list[int],
    turns: Sequence[Sequence[list[int]]],
    answer_tokens: int,
) -> ChatRun:
    """Every session (one list of user-turn token runs each) concurrently, closed
    loop: a session's next turn is its last prompt, the answer and the next user
    turn; timed from the first turn to the last answer."""
    params = SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True)
    prompts = {f"s{i}-0": system + user[0] for i, user in enumerate(turns)}
    pending = dict(prompts)
    run = ChatRun(0.0, 0, 0, 0, {})
    started = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        for request_id, prompt in pending.items():
            engine.add_request(request_id, prompt, params)
        pending = {}
        for out in engine.step():
            if out.finished:
                pending.update(next_turn(out, prompts, turns))
                record(run, out)
    run.seconds = time.perf_counter() - started
    return run


def next_turn(
    out: RequestOutput,
    prompts: dict[str, list[int]],
    turns: Sequence[Sequence[list[int]]],
) -> dict[str, list[int]]:
    session, turn = (int(part) for part in out.request_id[1:].split("-"))
    if turn + 1 == len(turns[session]):
        return {}
    request_id = f"s{session}-{turn + 1}"
    prompts[request_id] = (
        out.prompt_token_ids + out.token_ids + turns[session][turn + 1]
    )
    return {request_id: prompts[request_id]}


def record(run: ChatRun, out: RequestOutput) -> None:
    run.output_tokens += out.num_output_tokens
    run.prompt_tokens += out.num_prompt_tokens
    run.cached_tokens += out.num_cached_tokens
    run.answers[out.request_id] = out.token_ids


def chat_rows(
    engines: dict[str, LLMEngine],
    text: TextSource,
    user_turns: list[str],
    sessions: int,
    turns_per_session: int,
    system_tokens: int,
    turn_tokens: int,
    answer_tokens: int,
    rounds: int,
) -> list[Row]:
    """Cache on vs off on the same sessions, alternating which goes first."""
    on, off = engines["bf16"], engines["bf16-off"]
    throughput: dict[str, list[float]] = {"on": [], "off": []}
    hit_rates: list[float] = []
    prompt_tokens = 0
    next_user = 0
    for index in range(rounds):
        system = text.prompt(system_tokens)  # fresh each round: no earlier hits
        turns = []
        for _ in range(sessions):
            user = []
            for _ in range(turns_per_session):
                ids = text.tokenizer.encode(user_turns[next_user % len(user_turns)])
                user.append(ids[:turn_tokens])
                next_user += 1
            turns.append(user)
        order = (
            [("off", off), ("on", on)] if index % 2 == 0 else [("on", on), ("off", off)]
        )
        runs = {}
        for name, engine in order:
            runs[name] = run_chat(engine, system, turns, answer_tokens)
            throughput[name].append(runs[name].output_tokens / runs[name].seconds)
        if runs["on"].answers != runs["off"].answers:
            raise AssertionError("greedy answers differ with the cache on and off")
        hit_rates.append(runs["on"].cached_tokens / runs["on"].prompt_tokens)
        prompt_tokens = runs["on"].prompt_tokens
    ratio = statistics.median(throughput["on"]) / statistics.median(throughput["off"])
    shape = (
        f"{sessions} sessions x {turns_per_session} turns, {system_tokens}-token "
        f"system, {turn_tokens}-token turns, {answer_tokens}-token answers"
    )
    return [
        f"chat: {shape}; {prompt_tokens} prompt tokens per run",
        Row(
            "chat output tok/s, cache on / off (same greedy answers)",
            f"{ratio:.2f}x",
            f">= {CHAT_TARGET:g}x",
            ratio >= CHAT_TARGET,
        ),
        Row(
            "chat prefix-cache hit rate (cached / prompt tokens)",
            f"{statistics.median(hit_rates):.0%}",
            "~80%",
            None,
        ),
        Row(
            "chat output tok/s, cache off / on",
            f"{statistics.median(throughput['off']):.1f} / "
            f"{statistics.median(throughput['on']):.1f}",
            "info",
            None,
        ),
    ]


# -------------------------------------------------------------------------- main


def make_engines(
    model: torch.nn.Module, tokenizer, kv_dtypes: Sequence[str], max_model_len: int
) -> dict[str, LLMEngine]:
    """bf16 with the cache off and on, then each other dtype with it on."""

    def engine(kv_dtype: str, caching: bool) -> LLMEngine:
        return LLMEngine(
            model,
            tokenizer,
            kv_cache_dtype=kv_dtype,
            kv_memory_bytes=KV_MEMORY_BYTES,
            block_size=BLOCK_SIZE,
            max_num_seqs=16,
            max_model_len=max_model_len,
            enable_prefix_caching=caching,
        )

    engines = {"bf16-off": engine("bf16", False), "bf16": engine("bf16", True)}
    for dtype in kv_dtypes:
        if dtype != "bf16":
            engines[dtype] = engine(dtype, True)
    return engines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns how many judged rows fail."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.prefix_cache")
    parser.add_argument("--model-dir", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of each measurement (default: TTFT 5, chat 3; --quick 3, 2)",
    )
    parser.add_argument(
        "--kv-dtypes",
        default="bf16",
        help="comma-separated; the TTFT target is judged on bf16, others are info",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on CPU (1: on a shared CPU, more threads "
        "spin-wait against other processes)",
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = load_model(args.model_dir, dtype=torch.float32, device=args.device)
    tokenizer = load_tokenizer(args.model_dir)
    config = model.config
    max_model_len = config.max_position_embeddings
    suffix_tokens = 32
    # the prompt (BOS, prefix, suffix) and its one generated token fit the context
    room = max_model_len - len(tokenizer.prompt_prefix_ids) - suffix_tokens - 1
    prefix_tokens = min(args.prefix_tokens, room)
    kv_dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    engines = make_engines(model, tokenizer, kv_dtypes, max_model_len)
    print(
        f"model {args.model_dir.name}: {config.num_hidden_layers} layers, "
        f"{model.num_parameters() / 1e6:.1f}M params; device {args.device}; torch "
        f"threads {torch.get_num_threads()}; block size {BLOCK_SIZE}"
    )
    if prefix_tokens < args.prefix_tokens:
        print(f"(prefix cut to {prefix_tokens} tokens: the context is {max_model_len})")
    ttft_rounds = args.rounds or (3 if args.quick else 5)
    chat_rounds = args.rounds or (2 if args.quick else 3)
    text = TextSource(tokenizer)
    sections = [
        (
            "time to first token",
            lambda: ttft_rows(engines, text, prefix_tokens, suffix_tokens, ttft_rounds),
        ),
        (
            "multi-turn chat",
            lambda: chat_rows(
                engines,
                text,
                chat_turns(),
                sessions=4,
                turns_per_session=4,
                system_tokens=384,
                turn_tokens=64,
                answer_tokens=16,
                rounds=chat_rounds,
            ),
        ),
    ]
    rows: list[Row] = []
    header = f"{'metric':<56} {'value':>12}  {'target':>10}  result"
    for title, build in sections:
        print(f"\n== {title}", flush=True)
        print(header)
        for item in build():
            if isinstance(item, str):
                print(item)
                continue
            print(item.render(), flush=True)
            rows.append(item)
    judged = [r for r in rows if r.ok is not None]
    failed = sum(not r.ok for r in judged)
    elapsed = time.perf_counter() - started
    print(f"\n{len(judged) - failed}/{len(judged)} targets pass; {elapsed:.0f} s")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
