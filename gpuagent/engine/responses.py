"""Engine outputs as OpenAI responses: how tokens, logprobs and usage are written
(`ResponseFormat`), the streams of one request merged, collected for a plain answer
(aborted when the client goes away) and written as one JSON body, or written as SSE
chunks. Knows the request bodies (`openai_api`), never the server's routes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from gpuagent.engine.engine import (
    LLMEngine,
    RequestOutput,
    RequestStream,
    TokenLogprob,
)
from gpuagent.engine.openai_api import (
    SERVED_TIER,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.token_text import (
    TextOffsets,
    TokenBytes,
    bytes_text,
    prompt_text_offsets,
)

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


@dataclass
class Choice:
    """One sequence of a response: its prompt and how it is sampled."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are the prompt tokens the prefix
    cache served (prompt_tokens_details.cached_tokens)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseFormat:
    """How answers are written: the served model name they carry, each token's text
    and exact bytes, and logprobs in OpenAI's completion and chat shapes (over the
    engine's current tokenizer)."""

    def __init__(self, llm: LLMEngine, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self._token_bytes: TokenBytes | None = None

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (see `TokenBytes`)."""
        return self.token_bytes_table()(token_id)

    def token_bytes_table(self) -> TokenBytes:
        """The (cached) `TokenBytes` of the engine's tokenizer."""
        tokenizer = self.llm.tokenizer
        if self._token_bytes is None or self._token_bytes.tokenizer is not tokenizer:
            self._token_bytes = TokenBytes(tokenizer)
        return self._token_bytes

    def token_text(self, token_id: int) -> str:
        """A token's text as OpenAI reports it: its bytes decoded when they are valid
        UTF-8 on their own, else `bytes:\\xNN...` (so distinct tokens stay apart)."""
        return bytes_text(self.token_bytes(token_id))

    def text_offsets(self) -> TextOffsets:
        """A tracker of the text offsets of one request's tokens."""
        return TextOffsets(self.llm.tokenizer)

    def prompt_text(self, prompt: str | list[int], ids: list[int]) -> str:
        """The text `echo` returns: a text prompt as given, token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        return self.llm.tokenizer.decode(ids, skip_special_tokens=True)

    def answer_logprobs(
        self, out: RequestOutput, params: SamplingParams
    ) -> list[TokenLogprob]:
        """`out.new_logprobs` without a stop token's: the chat text leaves it out,
        and chat logprobs cover exactly the text's tokens."""
        logprobs = out.new_logprobs
        stopped_by_token = (
            out.finish_reason == "stop"
            and out.new_token_ids
            and out.new_token_ids[-1] in self.llm.stop_token_ids(params)
        )
        return logprobs[:-1] if stopped_by_token and logprobs else logprobs

    def completion_logprobs(
        self, logprobs: Sequence[TokenLogprob], offsets: Sequence[int]
    ) -> dict[str, Any]:
        """Completion-style logprobs of generated tokens at text `offsets`."""
        tokens, token_logprobs, top = [], [], []
        for lp in logprobs:
            tokens.append(self.token_text(lp.token_id))
            token_logprobs.append(lp.logprob)
            top.append(self.top_dict(lp.top_logprobs))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": list(offsets[: len(tokens)]),
        }

    def top_dict(self, top_logprobs: Sequence[tuple[int, float]]) -> dict[str, float]:
        """Alternatives by token text, the best of tokens with the same text."""
        alternatives: dict[str, float] = {}
        for token_id, logprob in top_logprobs:  # best first: keep the best
            alternatives.setdefault(self.token_text(token_id), logprob)
        return alternatives

    def echo_logprobs(
        self, prompt_ids: Sequence[int], prompt_logprobs: Sequence[Any]
    ) -> dict[str, Any]:
        """Completion-style logprobs of the prompt's tokens (null for the first)."""
        return {
            "tokens": [self.token_text(t) for t in prompt_ids],
            "token_logprobs": [lp and lp.logprob for lp in prompt_logprobs],
            "top_logprobs": [
                lp and self.top_dict(lp.top_logprobs) for lp in prompt_logprobs
            ],
            "text_offset": prompt_text_offsets(self.token_bytes_table(), prompt_ids),
        }

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        """Chat-style logprobs: each token's text, logprob, bytes and top-N."""

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes(token_id)
            return {"token": bytes_text(raw), "logprob": logprob, "bytes": list(raw)}

        content = []
        for lp in logprobs:
            item = entry(lp.token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top_logprobs]
            content.append(item)
        return {"content": content}


def join_logprobs(first: dict[str, Any], then: dict[str, Any], shift: int) -> dict:
    """Completion logprobs of an echoed prompt followed by the answer's, whose text
    offsets move past the prompt's text (`shift` characters)."""
    joined = {key: first[key] + then[key] for key in first}
    joined["text_offset"] = first["text_offset"] + [
        o + shift for o in then["text_offset"]
    ]
    return joined


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several request streams as they come; closing the merged
    iterator closes (aborts) the unfinished ones."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]]
    queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except Exception as exc:
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def unless_disconnected(request: Request, work: Awaitable[None]) -> None:
    """Await `work` (collecting a non-streamed answer); if the client goes away first,
    cancel it, which closes its request streams and so aborts them."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return
            if await request.is_disconnected():
                raise APIError(
                    "the client disconnected", status=499, code="client_disconnected"
                )
    finally:
        if not task.done():
            task.cancel()


async def collect_finals(
    request: Request,
    streams: Sequence[RequestStream],
    text_offsets: Sequence[TextOffsets] = (),
) -> list[RequestOutput]:
    """The final output of each stream, in order, its `new_logprobs` holding all of
    the request's and `prompt_logprobs` the prompt's (and `text_offsets[i]`, when
    given, fed stream i's outputs); all are aborted if the client goes away first."""
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in range(len(streams))}
    prompt_logprobs: dict[int, list[Any]] = {}

    async def collect() -> None:
        async for index, out in merge_streams(streams):
            if text_offsets:
                text_offsets[index].feed(out)
            logprobs[index] += out.new_logprobs
            if out.prompt_logprobs is not None:
                prompt_logprobs[index] = out.prompt_logprobs
            if out.finished:
                finals[index] = out

    await unless_disconnected(request, collect())
    for index, out in finals.items():
        out.new_logprobs = logprobs[index]
        out.prompt_logprobs = prompt_logprobs.get(index)
    return [finals[index] for index in range(len(streams))]


class StreamUsage:
    """Tokens so far of a streamed response's choices (cached prompt tokens once
    per prompt, as its prompt tokens: each prompt has `n` choices in a row)."""

    def __init__(self, prompt_tokens: int, num_choices: int, n: int) -> None:
        self.prompt_tokens, self.n = prompt_tokens, n
        self.tokens = [0] * num_choices
        self.cached = [0] * num_choices

    def update(self, index: int, out: RequestOutput) -> None:
        self.tokens[index] = out.num_output_tokens
        self.cached[index] = out.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        cached = sum(self.cached[:: self.n])
        return usage(self.prompt_tokens, sum(self.tokens), cached)


def chunk_writer(
    fmt: ResponseFormat,
    request_id: str,
    object_name: str,
    body: CompletionRequest | ChatCompletionRequest,
    stream_usage: StreamUsage,
) -> Callable[..., str]:
    """`chunk(choices, usage=None)`: one SSE chunk of a streamed response, every
    chunk with the same id and creation time (and the tier served, when the request
    asked for one); with the body's continuous_usage_stats, each chunk carries the
    usage so far (vLLM's)."""
    created = int(time.time())
    continuous = stream_usage if body.continuous_usage else None

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": object_name,
            "created": created,
            "model": fmt.model_name,
            "choices": choices,
        }
        if body.service_tier is not None:
            data["service_tier"] = SERVED_TIER
        if body.include_usage:
            if usage is None and continuous is not None:
                usage = continuous.usage()
            data["usage"] = usage
        return sse(data)

    return chunk


def sse_error(exc: Exception) -> str:
    """An in-band error event: once the headers are sent the status can't change."""
    return sse(
        {
            "error": {
                "message": str(exc),
                "type": "internal_error",
                "param": None,
                "code": None,
            }
        }
    )


# Characters that end a line for str.splitlines (and so for httpx's aiter_lines,
# which guidellm reads streams with) but which JSON leaves raw in a string: a model
# that writes one would split its event in two for such a client (guidellm:
# "Unterminated string"). Escaped, the JSON is the same and the event one line.
SPLITLINES_ONLY = str.maketrans(
    {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event, one line however it is split into lines."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload.translate(SPLITLINES_ONLY)}\n\n"


def completion_body(
    fmt: ResponseFormat,
    request_id: str,
    body: CompletionRequest,
    choices: Sequence[Choice],
    finals: Sequence[RequestOutput],
    offsets: Sequence[TextOffsets],
) -> dict[str, Any]:
    """The JSON body of a non-streamed /v1/completions answer (`offsets`: each
    choice's, fed its outputs, when logprobs were asked)."""
    answers = []
    for choice, out in zip(choices, finals, strict=True):
        logprobs = None
        if body.logprobs is not None:
            logprobs = fmt.completion_logprobs(
                out.new_logprobs, offsets[choice.index].offsets
            )
            if body.echo:
                logprobs = join_logprobs(
                    fmt.echo_logprobs(choice.prompt_ids, out.prompt_logprobs),
                    logprobs,
                    len(choice.prompt_text),
                )
        answers.append(
            {
                "index": choice.index,
                "text": choice.prompt_text + out.text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
            }
        )
    return answer_body(fmt, request_id, "text_completion", body, answers, finals)


def chat_body(
    fmt: ResponseFormat,
    request_id: str,
    body: ChatCompletionRequest,
    choices: Sequence[Choice],
    finals: Sequence[RequestOutput],
) -> dict[str, Any]:
    """The JSON body of a non-streamed /v1/chat/completions answer."""
    answers = [
        {
            "index": choice.index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": fmt.chat_logprobs(fmt.answer_logprobs(out, choice.params))
            if body.logprobs
            else None,
            "finish_reason": out.finish_reason,
        }
        for choice, out in zip(choices, finals, strict=True)
    ]
    return answer_body(fmt, request_id, "chat.completion", body, answers, finals)


def answer_body(
    fmt: ResponseFormat,
    request_id: str,
    object_name: str,
    body: CompletionRequest | ChatCompletionRequest,
    answers: list[dict[str, Any]],
    finals: Sequence[RequestOutput],
) -> dict[str, Any]:
    """A non-streamed answer: its `answers` (one per choice), the usage, and what
    it echoes of the request (`metadata`, the tier served)."""
    prompt_tokens = sum(out.num_prompt_tokens for out in finals[:: body.n])
    cached_tokens = sum(out.num_cached_tokens for out in finals[:: body.n])
    completion_tokens = sum(o.num_output_tokens for o in finals)
    return {
        "id": request_id,
        "object": object_name,
        "created": int(time.time()),
        "model": fmt.model_name,
        "choices": answers,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
        **body.answer_fields,
    }


def prompt_tokens(choices: Sequence[Choice], n: int) -> int:
    """Prompt tokens of a request: each prompt once, however many choices it has."""
    return sum(len(c.prompt_ids) for c in choices[::n])


async def stream_completion(
    fmt: ResponseFormat,
    request_id: str,
    body: CompletionRequest,
    streams: Sequence[RequestStream],
    choices: Sequence[Choice],
) -> AsyncIterator[str]:
    """SSE chunks of a streamed /v1/completions request; with `echo`, each choice's
    first chunk starts with its prompt (and the prompt's logprobs)."""
    stream_usage = StreamUsage(prompt_tokens(choices, body.n), len(streams), body.n)
    chunk = chunk_writer(fmt, request_id, "text_completion", body, stream_usage)
    with_logprobs, echo = body.logprobs is not None, body.echo
    offsets = [fmt.text_offsets() for _ in streams]
    echoed = [not echo] * len(streams)

    async for index, out in merge_streams(streams):
        choice = choices[index]
        stream_usage.update(index, out)
        if not (out.new_text or out.finished or with_logprobs or not echoed[index]):
            continue
        text, logprobs = out.new_text, None
        if with_logprobs:
            logprobs = fmt.completion_logprobs(
                out.new_logprobs, offsets[index].feed(out)
            )
        if not echoed[index]:
            echoed[index] = True
            text = choice.prompt_text + text
            if with_logprobs:
                logprobs = join_logprobs(
                    fmt.echo_logprobs(choice.prompt_ids, out.prompt_logprobs),
                    logprobs,
                    len(choice.prompt_text),
                )
        elif logprobs is not None and echo:
            logprobs["text_offset"] = [
                o + len(choice.prompt_text) for o in logprobs["text_offset"]
            ]
        yield chunk(
            [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            ]
        )
    if body.include_usage:
        yield chunk([], stream_usage.usage())


async def stream_chat(
    fmt: ResponseFormat,
    request_id: str,
    body: ChatCompletionRequest,
    streams: Sequence[RequestStream],
    choices: Sequence[Choice],
) -> AsyncIterator[str]:
    """SSE chunks of a streamed /v1/chat/completions request: a role chunk per
    choice, then its content."""
    stream_usage = StreamUsage(prompt_tokens(choices, body.n), len(streams), body.n)
    chunk = chunk_writer(fmt, request_id, "chat.completion.chunk", body, stream_usage)
    with_logprobs = body.logprobs
    for choice in choices:
        yield chunk(
            [
                {
                    "index": choice.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
    async for index, out in merge_streams(streams):
        stream_usage.update(index, out)
        if not (out.new_text or out.finished or with_logprobs):
            continue
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = None
        if with_logprobs:
            logprobs = fmt.chat_logprobs(
                fmt.answer_logprobs(out, choices[index].params)
            )
        yield chunk(
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            ]
        )
    if body.include_usage:
        yield chunk([], stream_usage.usage())


async def sse_stream(
    events: AsyncIterator[str], streams: Sequence[RequestStream]
) -> AsyncIterator[str]:
    """`events`, then `[DONE]`. An error once the headers are sent is reported
    in-band, as OpenAI does; every request stream is closed at the end, which
    aborts those unfinished (a client gone mid-stream)."""
    try:
        async for event in events:
            yield event
        yield sse("[DONE]")
    except Exception as exc:
        yield sse_error(exc)
    finally:
        for stream in streams:
            stream.close()
