"""Engine outputs as OpenAI responses: the streams of one request merged, collected
for a plain answer (aborted when the client goes away), or written as SSE chunks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request

from gpuagent.engine.engine import RequestOutput, RequestStream, TokenLogprob
from gpuagent.engine.openai_api import APIError
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.token_text import TextOffsets

if TYPE_CHECKING:
    from gpuagent.engine.server import OpenAIServer

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


@dataclass
class Choice:
    """One sequence of a response: its prompt and how it is sampled."""

    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams


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
    per prompt: each has `choices_per_prompt` choices in a row)."""

    def __init__(
        self,
        server: OpenAIServer,
        prompt_tokens: int,
        num_choices: int,
        choices_per_prompt: int = 1,
    ) -> None:
        self.server, self.prompt_tokens = server, prompt_tokens
        self.tokens = [0] * num_choices
        self.cached = [0] * num_choices
        self.choices_per_prompt = choices_per_prompt

    def update(self, index: int, out: RequestOutput) -> None:
        self.tokens[index] = out.num_output_tokens
        self.cached[index] = out.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        cached = sum(self.cached[:: self.choices_per_prompt])
        return self.server.usage(self.prompt_tokens, sum(self.tokens), cached)


def chunk_writer(
    server: OpenAIServer,
    request_id: str,
    object_name: str,
    include_usage: bool,
    continuous: StreamUsage | None = None,
) -> Callable[..., str]:
    """`chunk(choices, usage=None)`: one SSE chunk of a streamed response, every
    chunk with the same id and creation time; with `continuous`, each chunk
    carries the usage so far (vLLM's continuous_usage_stats)."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
        data: dict[str, Any] = {
            "id": request_id,
            "object": object_name,
            "created": created,
            "model": server.model_name,
            "choices": choices,
        }
        if include_usage:
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


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def stream_completion(
    server: OpenAIServer,
    request_id: str,
    streams: Sequence[RequestStream],
    choices: Sequence[Choice],
    prompt_tokens: int,
    include_usage: bool,
    with_logprobs: bool,
    echo: bool,
    continuous_usage: bool = False,
    choices_per_prompt: int = 1,
) -> AsyncIterator[str]:
    """SSE chunks of a streamed /v1/completions request; with `echo`, each choice's
    first chunk starts with its prompt (and the prompt's logprobs)."""
    usage = StreamUsage(server, prompt_tokens, len(streams), choices_per_prompt)
    chunk = chunk_writer(
        server,
        request_id,
        "text_completion",
        include_usage,
        usage if continuous_usage else None,
    )
    offsets = [server.text_offsets() for _ in streams]
    echoed = [not echo] * len(streams)

    async for index, out in merge_streams(streams):
        choice = choices[index]
        usage.update(index, out)
        if not (out.new_text or out.finished or with_logprobs or not echoed[index]):
            continue
        text, logprobs = out.new_text, None
        if with_logprobs:
            logprobs = server.completion_logprobs(
                out.new_logprobs, offsets[index].feed(out)
            )
        if not echoed[index]:
            echoed[index] = True
            text = choice.prompt_text + text
            if with_logprobs:
                logprobs = join_logprobs(
                    server.echo_logprobs(choice.prompt_ids, out.prompt_logprobs),
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
    if include_usage:
        yield chunk([], usage.usage())


async def stream_chat(
    server: OpenAIServer,
    request_id: str,
    streams: Sequence[RequestStream],
    choices: Sequence[Choice],
    prompt_tokens: int,
    include_usage: bool,
    with_logprobs: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """SSE chunks of a streamed /v1/chat/completions request: a role chunk per
    choice, then its content."""
    usage = StreamUsage(server, prompt_tokens, len(streams), len(streams))
    chunk = chunk_writer(
        server,
        request_id,
        "chat.completion.chunk",
        include_usage,
        usage if continuous_usage else None,
    )
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
        usage.update(index, out)
        if not (out.new_text or out.finished or with_logprobs):
            continue
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = None
        if with_logprobs:
            logprobs = server.chat_logprobs(
                server.answer_logprobs(out, choices[index].params)
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
    if include_usage:
        yield chunk([], usage.usage())


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
