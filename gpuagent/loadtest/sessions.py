"""A plan workload's requests as sessions, and one load level of them.

A workload (`gpuagent.protocol.WorkloadPlan`) sends sessions of `turns` chat
requests. Every session's messages start with the same system prompt (its
`system_prompt_tokens`, cut from the workload's text), then, with carry_history,
every earlier turn and the answer the server gave, then the turn's new user message
(a tag naming the request, text of the turn's drawn length, the task's
instruction). So a turn's prompt starts with the whole prompt of the turn before:
the cache reuse the plan asks for, and nothing more (the tags keep sessions apart
after the system prompt).

A level runs sessions in a closed loop (c workers, each running one session after
another) or an open loop (sessions arriving at rate / turns per second, so requests
arrive at about `rate`), until `requests` turns were sent or the level's deadline.
A turn is sent `think_time_s` after the answer before it.

`implied_cached_tokens` is what the session model implies the server's prefix cache
serves, from the records: the full blocks of the prefix a request shares with one
whose prefill had ended before it was sent (the previous turn's prompt; the system
prompt and the template's opening, once another request's first token had
arrived), at most the blocks before
the prompt's last token (a server computes that one for its logits).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from gpuagent.loadtest.client import RequestRecord, stream_chat
from gpuagent.loadtest.profiles import Profile
from gpuagent.loadtest.prompts import TAG_TEMPLATE, fit, source_text
from gpuagent.loadtest.runner import arrival_times
from gpuagent.protocol import Lengths, WorkloadPlan

# The text (shipped passages, gpuagent/evaluate/data) and the instruction of each
# task and language (a chat turn's is short: it is sent every turn).
SOURCES = {
    ("chat", "en"): "english",
    ("chat", "ko"): "korean",
    ("rag", "en"): "english",
    ("rag", "ko"): "korean",
    ("code", "en"): "code",
    ("code", "ko"): "code",
}
INSTRUCTIONS = {
    ("chat", "en"): "Reply to the customer, kindly.",
    ("chat", "ko"): "고객에게 친절히 답해 주세요.",
    ("rag", "en"): "Using only the documents above, answer in two sentences: what "
    "is the main point of the last document?",
    ("rag", "ko"): "위 문서들만 참고하여, 마지막 문서의 요점을 두 문장으로 "
    "답해 주세요.",
    ("code", "en"): "Review the code above, then rewrite it with type hints, "
    "docstrings and tests.",
    ("code", "ko"): "위 코드에 타입 힌트와 테스트를 넣어 다시 써 주세요.",
}
SYSTEM_INTRO = "You are a helpful assistant. Background for this conversation:"
VARIANTS = 4
CUT = "cut at the budget's end"
Count = Callable[[str], Awaitable[int]]


def profile_of(workload: WorkloadPlan, prompt_tokens: int | None = None) -> Profile:
    """The loadtest Profile of a plan workload (one turn of `prompt_tokens`)."""
    key = (workload.task, workload.language)
    return Profile(
        name=workload.name,
        source=SOURCES[key],
        instruction=INSTRUCTIONS[key],
        prompt_tokens=prompt_tokens or workload.prompt.tokens,
        output_tokens=workload.output.tokens,
        temperature=workload.temperature,
        slo_ttft_p99_ms=workload.slo_ttft_p99_ms,
        slo_tpot_p99_ms=workload.slo_tpot_p99_ms,
    )


def draw(lengths: Lengths, rng: random.Random) -> int:
    """One length of the distribution (uniform within the spread)."""
    low = max(1, round(lengths.tokens * (1 - lengths.spread)))
    high = max(low, round(lengths.tokens * (1 + lengths.spread)))
    return rng.randint(low, high)


@dataclass
class SessionPrompts:
    """A workload's calibrated texts: the shared system prompt ("" for none) and
    user-message variants with their answer lengths."""

    workload: WorkloadPlan
    system: str
    turns: list[str]  # user messages, each with a placeholder tag
    output_tokens: list[int]  # max_tokens per variant
    prompt_tokens: list[int] = field(default_factory=list)  # measured, per variant

    def user(self, request_index: int) -> tuple[str, int]:
        """Request `request_index`'s user message (distinct per request) and its
        max_tokens."""
        variant = request_index % len(self.turns)
        text = self.turns[variant].replace(
            TAG_TEMPLATE.format(0), TAG_TEMPLATE.format(request_index), 1
        )
        return text, self.output_tokens[variant]


async def fit_system(source: str, tokens: int, count: Count) -> str:
    """A system text of about `tokens` tokens (as one message's content)."""
    text = f"{SYSTEM_INTRO}\n\n" + source_text(source, 7, 8 * tokens)
    low, high = 0, len(text)
    while high - low > 1:
        middle = (low + high) // 2
        if await count(text[:middle]) <= tokens:
            low = middle
        else:
            high = middle
    return text[:low]


async def build_session_prompts(
    workload: WorkloadPlan,
    count: Count,
    seed: int,
    prompt_tokens: Lengths | None = None,
    with_session: bool = True,
) -> SessionPrompts:
    """Calibrated texts of `workload` (its prompt lengths, or `prompt_tokens`);
    without `with_session`, single requests with no system prompt (a context
    sweep's)."""
    rng = random.Random(f"{seed}:{workload.name}")
    lengths = prompt_tokens or workload.prompt
    system = ""
    if with_session and workload.session.system_prompt_tokens:
        source = SOURCES[(workload.task, workload.language)]
        system = await fit_system(source, workload.session.system_prompt_tokens, count)
    turns, measured, outputs = [], [], []
    for start in range(VARIANTS):
        profile = profile_of(workload, draw(lengths, rng))
        content, tokens = await fit(profile, profile.prompt_tokens, start, count)
        turns.append(content)
        measured.append(tokens)
        outputs.append(draw(workload.output, rng))
    return SessionPrompts(workload, system, turns, outputs, measured)


@dataclass
class Turn:
    """One sent turn: its record and where it sits in its session."""

    record: RequestRecord
    session: int
    turn: int


@dataclass
class LevelRecords:
    """What a session level sent, in send order."""

    turns: list[Turn] = field(default_factory=list)
    max_schedule_lag_ms: float = 0.0
    cut_by_deadline: bool = False
    cut_in_flight: int = 0  # requests stopped mid-way at the hard deadline

    @property
    def records(self) -> list[RequestRecord]:
        """The requests that ran to their end (or failed on their own)."""
        return [t.record for t in self.turns if t.record.error != CUT]


def request_body(
    model: str, prompts: SessionPrompts, messages: list[dict], max_tokens: int
) -> dict:
    """A streamed turn (greedy unless the workload says otherwise, EOS ignored so
    every answer has its drawn length, usage in the stream)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if prompts.workload.temperature is not None:
        body["temperature"] = prompts.workload.temperature
    return body


async def run_sessions(
    session: aiohttp.ClientSession,
    chat_url: str,
    model: str,
    prompts: SessionPrompts,
    *,
    requests: int,
    deadline: float,
    concurrency: int | None = None,
    rate: float | None = None,
    burstiness: float | None = None,
    seed: int = 0,
    turns: int | None = None,
    first_index: int = 0,
    hard_deadline: float | None = None,
    on_done: Callable[[RequestRecord], None] = lambda _: None,
) -> LevelRecords:
    """One level: `requests` turns at most, none sent after `deadline`
    (time.perf_counter()); closed loop at `concurrency` or open loop at `rate`.
    Request tags start at `first_index` (give each level its own, or a level's
    prompts repeat an earlier one's and the cache serves them whole). A request
    still in flight at `hard_deadline` is stopped (the server aborts it) and left
    out of the records: it measured nothing whole."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency and rate")
    plan = prompts.workload.session
    turns = turns or plan.turns
    out = LevelRecords()
    sent = 0

    def take() -> bool:
        nonlocal sent
        if sent >= requests:
            return False
        if time.perf_counter() >= deadline:
            out.cut_by_deadline = True
            return False
        sent += 1
        return True

    async def one_session(index: int, scheduled: float) -> None:
        history: list[dict] = []
        for turn in range(turns):
            if turn and plan.think_time_s:
                await asyncio.sleep(plan.think_time_s)
            if not take():
                return
            text, max_tokens = prompts.user(first_index + index * turns + turn)
            messages = []
            if prompts.system:
                messages.append({"role": "system", "content": prompts.system})
            messages += history + [{"role": "user", "content": text}]
            record = RequestRecord(scheduled_s=scheduled if turn == 0 else 0.0)
            out.turns.append(Turn(record, index, turn))
            streamed = stream_chat(
                session,
                chat_url,
                request_body(model, prompts, messages, max_tokens),
                record,
                keep_text=plan.carry_history and turns > 1,
                headers={"x-session-affinity": f"{prompts.workload.name}-{index}"},
            )
            if hard_deadline is None:
                await streamed
            else:
                try:
                    left = max(hard_deadline - time.perf_counter(), 0.0)
                    await asyncio.wait_for(streamed, left)
                except TimeoutError:
                    record.error = CUT
                    out.cut_by_deadline = True
                    out.cut_in_flight += 1
                    return
            on_done(record)
            if not record.ok:
                return  # a session whose turn failed has no history to carry
            if plan.carry_history:
                history += [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": record.text},
                ]

    if concurrency is not None:
        counter = iter(range(requests))

        async def worker() -> None:
            for index in counter:
                if sent >= requests or time.perf_counter() >= deadline:
                    if sent < requests:
                        out.cut_by_deadline = True
                    return
                await one_session(index, time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out
    sessions = max(1, -(-requests // turns))
    times = arrival_times(rate / turns, sessions, seed, burstiness)
    start = time.perf_counter()
    tasks = []
    for index, offset in enumerate(times):
        scheduled = start + float(offset)
        if scheduled >= deadline:
            out.cut_by_deadline = True
            break
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag_ms = (time.perf_counter() - scheduled) * 1e3
        out.max_schedule_lag_ms = max(out.max_schedule_lag_ms, lag_ms)
        tasks.append(asyncio.create_task(one_session(index, scheduled)))
    await asyncio.gather(*tasks)
    return out


def implied_cached_tokens(
    level: LevelRecords,
    opening_tokens: int,
    block_size: int,
    carry: bool,
    opening_cached: bool = False,
) -> list[int]:
    """Per sent turn, the prompt tokens the session model implies a prefix cache
    of `block_size`-token blocks serves (see the module's docstring);
    `opening_cached`: an earlier level sent the same opening already."""
    first_tokens = sorted(
        t.record.chunk_times_s[0] for t in level.turns if t.record.chunk_times_s
    )
    previous: dict[int, RequestRecord] = {}
    implied = []
    for turn in level.turns:
        record = turn.record
        shared = 0
        if opening_cached or (first_tokens and first_tokens[0] < record.start_s):
            shared = opening_tokens
        before = previous.get(turn.session)
        if carry and before is not None and before.ok:
            shared = max(shared, before.prompt_tokens)
        previous[turn.session] = record
        if not record.ok or record.prompt_tokens < 1:
            implied.append(0)
            continue
        most = min(shared, record.prompt_tokens - 1)
        implied.append(most // block_size * block_size)
    return implied


async def opening_tokens(
    session: aiohttp.ClientSession, base_url: str, model: str, prompts: SessionPrompts
) -> int:
    """Tokens any two sessions' first prompts share (the system prompt and the
    template around it), from the server's own tokenization (0: the server has no
    /tokenize that lists tokens)."""
    ids = []
    for index in (0, 999999):
        text = prompts.turns[0].replace(
            TAG_TEMPLATE.format(0), TAG_TEMPLATE.format(index), 1
        )
        messages = [{"role": "user", "content": text}]
        if prompts.system:
            messages.insert(0, {"role": "system", "content": prompts.system})
        body = {"model": model, "messages": messages}
        try:
            async with session.post(f"{base_url}/tokenize", json=body) as resp:
                if resp.status != 200:
                    return 0
                ids.append((await resp.json()).get("tokens") or [])
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return 0
    shared = 0
    for a, b in zip(*ids, strict=False):
        if a != b:
            break
        shared += 1
    return shared
