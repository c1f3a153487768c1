"""OpenAI-compatible HTTP server over `AsyncLLMEngine` (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions (SSE streaming or not, usage in the
stream with `stream_options.include_usage`, logprobs with each token's exact bytes),
/v1/models (and /v1/models/ID), /tokenize, /health, /metrics (Prometheus). Errors
have OpenAI's body `{"error": {"message", "type", "param", "code"}}`; bad input
(wrong JSON types included: fields are strict) is a 400, a body past MAX_BODY_BYTES
a 413, and the server keeps serving. A client that disconnects mid-stream has its
request aborted, which frees its KV blocks before the next engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuagent.engine.engine import (
    AsyncLLMEngine,
    RequestOutput,
    RequestStream,
    TokenLogprob,
)
from gpuagent.engine.sampling import MAX_LOGPROBS, SamplingParams
from gpuagent.engine.scheduler import RequestTooLargeError

# How often a non-streamed request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
# Far above any prompt the context holds (a 128k-token prompt is ~1 MB of JSON); a
# bigger body is refused before it is read into memory.
MAX_BODY_BYTES = 16 * 2**20
# Each prompt of a batch is a sequence with its own queue and task; OpenAI caps 2048.
MAX_PROMPTS_PER_REQUEST = 2048


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code = param, code


def error_response(err: APIError) -> JSONResponse:
    """OpenAI-style error body for `err`."""
    body = {
        "error": {
            "message": err.message,
            "type": err.type,
            "param": err.param,
            "code": err.code,
        }
    }
    return JSONResponse(body, status_code=err.status)


# ------------------------------------------------------------------ request bodies


class _Body(BaseModel):
    # Unknown OpenAI fields (user, presence_penalty, ...) are accepted and ignored.
    # Strict types, as OpenAI's: "5" or true is no max_tokens (an int is a float).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    "only text content parts are supported", param="messages"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


BodyT = TypeVar("BodyT", bound=BaseModel)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


async def read_body(request: Request) -> bytes:
    """The raw body, refused (APIError 413) as soon as it passes MAX_BODY_BYTES."""
    too_large = APIError(
        f"the request body is larger than {MAX_BODY_BYTES} bytes",
        status=413,
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The request's JSON body validated as `model` (APIError 400 otherwise, 413
    past MAX_BODY_BYTES)."""
    raw = await read_body(request)
    try:
        data = json.loads(raw)
    # ValueError covers JSONDecodeError, bad UTF-8 and ints past Python's digit limit.
    except (ValueError, RecursionError) as exc:
        raise APIError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(
            f"invalid field {param}: {first['msg']}", param=param, code="invalid_value"
        ) from None


# ------------------------------------------------------------------- token bytes

CUT_OFF_CHAR = "\ufffd"  # what a cut-off (or invalid) UTF-8 sequence decodes to
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in char -> byte, as tokenizers' ByteLevel uses it."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in table]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


BYTE_LEVEL_CHARS = _byte_level_table()


def _decoder_types(tokenizer: Any) -> set[str]:
    """The component types of a `tokenizers` decoder (Sequence members included)."""
    decoder = getattr(getattr(tokenizer, "inner", None), "decoder", None)
    try:
        tree = json.loads(decoder.__getstate__()) if decoder is not None else {}
    except Exception:  # noqa: BLE001 - not a tokenizers decoder: no special handling
        return set()
    types, todo = set(), [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            types.add(node.get("type"))
            todo.extend(node.get("decoders") or [])
    return types


class TokenBytes:
    """The exact bytes of each token id (cached), as OpenAI's logprobs report them:
    an added token's content; a byte-fallback token `<0xNN>` is byte NN; a ByteLevel
    (GPT-2 style) token's chars map back through the bytes-to-unicode table (so the
    byte-level tokenizer's id < 256 is that byte); else the token decoded alone,
    which is not exact where the decoder strips (SentencePiece's `Strip` drops a
    `▁word` token's leading space)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        inner = getattr(tokenizer, "inner", None)
        types = _decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in types
        self.byte_fallback = "ByteFallback" in types
        self.id_to_token = getattr(inner, "id_to_token", None)
        added = getattr(inner, "get_added_tokens_decoder", None)
        self.added = {i: t.content for i, t in added().items()} if added else {}
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self.cache.get(token_id)
        if raw is None:
            raw = self.cache[token_id] = self._bytes(token_id)
        return raw

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.id_to_token(token_id) if self.id_to_token else None
        if piece is not None:
            byte = _BYTE_FALLBACK.fullmatch(piece)
            if self.byte_fallback and byte:
                return bytes([int(byte.group(1), 16)])
            if self.byte_level and all(c in BYTE_LEVEL_CHARS for c in piece):
                return bytes(BYTE_LEVEL_CHARS[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode("utf-8")


def _bytes_text(raw: bytes) -> str:
    """A token's text: `raw` decoded, or `bytes:\\xNN...` (as OpenAI writes it) when
    `raw` is not valid UTF-8 on its own (part of a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """The `text_offset` of each generated token: where, in the request's text, the
    character its first byte belongs to starts, so a byte that completes a character
    later points at that character (the text's U+FFFD until then).

    Fed each `RequestOutput` in order; the offsets come from the engine's text
    before and after each token, so they agree with the `text` returned. Tokens of
    a matched stop string point where they would have been, past the cut text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""  # the text before the next token
        self.offsets: list[int] = []  # every token's so far

    def feed(self, out: RequestOutput) -> list[int]:
        """The offsets of `out.new_logprobs`' tokens."""
        n = len(out.new_logprobs)
        # The engine yields one token per output; the text after each token but the
        # last of a bigger step is decoded as the engine's detokenizer would.
        start = len(out.token_ids) - n
        texts = [
            self.tokenizer.decode(out.token_ids[: start + j], skip_special_tokens=True)
            for j in range(1, n)
        ]
        offsets = []
        for text in [*texts, out.text]:
            offsets.append(len(self.text) - _continues_cut_char(self.text, text))
            self.text = text
        del offsets[n:]  # an output without logprobs still moves the text on
        self.offsets += offsets
        return offsets


def _continues_cut_char(before: str, after: str) -> bool:
    """Whether the token that turned `before` into `after` is part of `before`'s last
    character, a cut-off one (U+FFFD): it completed it, or it is still cut off."""
    if not before.endswith(CUT_OFF_CHAR) or len(after) < len(before):
        return False  # not cut off, or a stop string cut the text
    last = len(before) - 1
    return after[last] != CUT_OFF_CHAR or len(after) == len(before)


# --------------------------------------------------------------------------- app


class OpenAIServer:
    """Request handling shared by the routes (holds the engine and model name)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.llm = engine.engine
        self.model_name = model_name
        self.created = int(time.time())
        self._token_bytes: TokenBytes | None = None

    # -- validation ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                f"the model {model!r} does not exist; this server serves "
                f"{self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self,
        body: _SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams:
        if body.n != 1:
            raise APIError("only n=1 is supported", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                f"{max_tokens_param} must be at least 1, got {max_tokens}",
                param=max_tokens_param,
                code="invalid_value",
            )
        room = min(self.llm.max_model_len, self.llm.kv.blocks.capacity_tokens)
        if prompt_len >= room:
            raise APIError(
                f"this model's maximum context length is {room} tokens; the prompt "
                f"has {prompt_len}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room - prompt_len
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop or [],
                stop_token_ids=body.stop_token_ids or [],
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise APIError(str(exc), param=param, code="invalid_value") from None

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, prompt_param: str
    ) -> RequestStream:
        try:
            return self.engine.submit(prompt_ids, params)
        except RequestTooLargeError as exc:
            raise APIError(
                str(exc), param=prompt_param, code="context_length_exceeded"
            ) from None
        except ValueError as exc:
            raise APIError(str(exc), param=prompt_param) from None

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            ids = self.llm.encode_prompt(prompt)
        except ValueError as exc:
            raise APIError(str(exc), param=param) from None
        if not ids:
            raise APIError("the prompt is empty", param=param)
        return ids

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        tokenizer = self.llm.tokenizer
        if getattr(tokenizer, "chat_template", None):
            from jinja2 import TemplateError  # rendering the template needs it anyway

            try:
                return tokenizer.apply_chat_template(turns, add_generation_prompt=True)
            except TemplateError as exc:
                # The folder's template refuses these messages (e.g. roles that
                # must alternate, or its `raise_exception`, which we don't provide).
                raise APIError(
                    f"the model's chat template refused the messages: {exc}",
                    param="messages",
                ) from None
        # No template in the folder: a plain transcript ending in the assistant's turn.
        lines = [f"{t['role']}: {t['content']}" for t in turns]
        return "\n".join(lines) + "\nassistant:"

    # -- formatting ------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (see `TokenBytes`)."""
        tokenizer = self.llm.tokenizer
        if self._token_bytes is None or self._token_bytes.tokenizer is not tokenizer:
            self._token_bytes = TokenBytes(tokenizer)
        return self._token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        """A token's text as OpenAI reports it: its bytes decoded when they are valid
        UTF-8 on their own, else `bytes:\\xNN...` (so distinct tokens stay apart)."""
        return _bytes_text(self.token_bytes(token_id))

    def text_offsets(self) -> TextOffsets:
        """A tracker of the text offsets of one request's tokens."""
        return TextOffsets(self.llm.tokenizer)

    def completion_logprobs(
        self, logprobs: Sequence[TokenLogprob], offsets: Sequence[int]
    ) -> dict[str, Any]:
        tokens, token_logprobs, top = [], [], []
        for lp in logprobs:
            tokens.append(self.token_text(lp.token_id))
            token_logprobs.append(lp.logprob)
            alternatives: dict[str, float] = {}
            for token_id, logprob in lp.top_logprobs:  # best first: keep the best
                alternatives.setdefault(self.token_text(token_id), logprob)
            top.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": list(offsets),
        }

    def chat_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes(token_id)
            return {"token": _bytes_text(raw), "logprob": logprob, "bytes": list(raw)}

        content = []
        for lp in out.new_logprobs:
            item = entry(lp.token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top_logprobs]
            content.append(item)
        return {"content": content}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }


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
    the request's (and `text_offsets[i]`, when given, fed stream i's outputs); all
    are aborted if the client goes away first."""
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in range(len(streams))}

    async def collect() -> None:
        async for index, out in merge_streams(streams):
            if text_offsets:
                text_offsets[index].feed(out)
            logprobs[index] += out.new_logprobs
            if out.finished:
                finals[index] = out

    await unless_disconnected(request, collect())
    for index, out in finals.items():
        out.new_logprobs = logprobs[index]
    return [finals[index] for index in range(len(streams))]


def chunk_writer(
    server: OpenAIServer, request_id: str, object_name: str, include_usage: bool
) -> Callable[..., str]:
    """`chunk(choices, usage=None)`: one SSE chunk of a streamed response, every
    chunk with the same id and creation time."""
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


def build_app(engine: AsyncLLMEngine, model_name: str) -> FastAPI:
    """The FastAPI app; starts the engine thread at startup, stops it at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="releasegate engine", lifespan=lifespan)
    server = OpenAIServer(engine, model_name)
    app.state.server = server

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(
            APIError(str(exc.detail), status=exc.status_code, type=kind)
        )

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            APIError(f"internal error: {exc}", status=500, type="internal_error")
        )

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body = generate_latest(server.llm.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": server.created,
            "owned_by": "releasegate",
            "max_model_len": server.llm.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(
                f"the model {model_id!r} does not exist",
                status=404,
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest)
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            ids = server.encode(server.chat_prompt(body.messages), "messages")
        else:
            ids = server.encode(body.prompt or "", "prompt")
        return {
            "count": len(ids),
            "max_model_len": server.llm.max_model_len,
            "tokens": ids,
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        server.check_model(body.model)
        if body.echo:
            raise APIError("echo is not supported", param="echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
            raise APIError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}", param="logprobs"
            )
        prompts: list[str | list[int]]
        if isinstance(body.prompt, str) or (
            body.prompt and isinstance(body.prompt[0], int)
        ):
            prompts = [body.prompt]  # type: ignore[list-item]
        else:
            prompts = list(body.prompt)  # type: ignore[arg-type]
        if not prompts:
            raise APIError("the prompt is empty", param="prompt")
        if len(prompts) > MAX_PROMPTS_PER_REQUEST:
            raise APIError(
                f"a request takes at most {MAX_PROMPTS_PER_REQUEST} prompts, got "
                f"{len(prompts)}",
                param="prompt",
                code="invalid_value",
            )
        encoded = [server.encode(p, "prompt") for p in prompts]
        params = [
            server.sampling_params(
                body, len(ids), body.max_tokens, body.logprobs, "prompt"
            )
            for ids in encoded
        ]
        streams: list[RequestStream] = []
        try:
            for ids, p in zip(encoded, params, strict=True):
                streams.append(server.submit(ids, p, "prompt"))
        except APIError:
            for stream in streams:
                stream.close()
            raise
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompt_tokens = sum(len(ids) for ids in encoded)
        if body.stream:
            return StreamingResponse(
                stream_completion(
                    server,
                    request_id,
                    streams,
                    prompt_tokens,
                    body.include_usage,
                    body.logprobs is not None,
                ),
                media_type="text/event-stream",
            )
        with_logprobs = body.logprobs is not None
        offsets = [server.text_offsets() for _ in streams] if with_logprobs else []
        finals = await collect_finals(request, streams, offsets)
        choices = []
        for index, out in enumerate(finals):
            choices.append(
                {
                    "index": index,
                    "text": out.text,
                    "logprobs": server.completion_logprobs(
                        out.new_logprobs, offsets[index].offsets
                    )
                    if with_logprobs
                    else None,
                    "finish_reason": out.finish_reason,
                }
            )
        completion_tokens = sum(o.num_output_tokens for o in finals)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                "usage": server.usage(prompt_tokens, completion_tokens),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        server.check_model(body.model)
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
                param="top_logprobs",
            )
        ids = server.encode(server.chat_prompt(body.messages), "messages")
        max_tokens, max_tokens_param = body.max_completion_tokens, "max_tokens"
        if max_tokens is None:
            max_tokens = body.max_tokens
        else:
            max_tokens_param = "max_completion_tokens"
        logprobs = (top or 0) if body.logprobs else None
        params = server.sampling_params(
            body, len(ids), max_tokens, logprobs, "messages", max_tokens_param
        )
        stream = server.submit(ids, params, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamingResponse(
                stream_chat(
                    server,
                    request_id,
                    stream,
                    len(ids),
                    body.include_usage,
                    body.logprobs,
                ),
                media_type="text/event-stream",
            )
        (final,) = await collect_finals(request, [stream])
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": final.text},
                        "logprobs": server.chat_logprobs(final)
                        if body.logprobs
                        else None,
                        "finish_reason": final.finish_reason,
                    }
                ],
                "usage": server.usage(len(ids), final.num_output_tokens),
            }
        )

    return app


async def stream_completion(
    server: OpenAIServer,
    request_id: str,
    streams: Sequence[RequestStream],
    prompt_tokens: int,
    include_usage: bool,
    with_logprobs: bool,
) -> AsyncIterator[str]:
    """SSE chunks of a streamed /v1/completions request."""
    chunk = chunk_writer(server, request_id, "text_completion", include_usage)
    offsets = [server.text_offsets() for _ in streams]
    completion_tokens = 0

    try:
        async for index, out in merge_streams(streams):
            if out.finished:
                completion_tokens += out.num_output_tokens
            if not (out.new_text or out.finished or with_logprobs):
                continue
            logprobs = None
            if with_logprobs:
                logprobs = server.completion_logprobs(
                    out.new_logprobs, offsets[index].feed(out)
                )
            yield chunk(
                [
                    {
                        "index": index,
                        "text": out.new_text,
                        "logprobs": logprobs,
                        "finish_reason": out.finish_reason,
                    }
                ]
            )
        if include_usage:
            yield chunk([], server.usage(prompt_tokens, completion_tokens))
        yield sse("[DONE]")
    except Exception as exc:  # headers are sent: report in-band, as OpenAI does
        yield sse_error(exc)
    finally:
        for stream in streams:
            stream.close()


async def stream_chat(
    server: OpenAIServer,
    request_id: str,
    stream: RequestStream,
    prompt_tokens: int,
    include_usage: bool,
    with_logprobs: bool,
) -> AsyncIterator[str]:
    """SSE chunks of a streamed /v1/chat/completions request."""
    chunk = chunk_writer(server, request_id, "chat.completion.chunk", include_usage)

    completion_tokens = 0
    try:
        yield chunk(
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )
        async for out in stream:
            completion_tokens = out.num_output_tokens
            if not (out.new_text or out.finished or with_logprobs):
                continue
            delta = {"content": out.new_text} if out.new_text else {}
            yield chunk(
                [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": server.chat_logprobs(out)
                        if with_logprobs
                        else None,
                        "finish_reason": out.finish_reason,
                    }
                ]
            )
        if include_usage:
            yield chunk([], server.usage(prompt_tokens, completion_tokens))
        yield sse("[DONE]")
    except Exception as exc:
        yield sse_error(exc)
    finally:
        stream.close()
