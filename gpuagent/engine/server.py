"""OpenAI-compatible HTTP server over `AsyncLLMEngine` (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions (SSE streaming or not, usage in the
stream with `stream_options.include_usage`, logprobs with each token's exact bytes),
/v1/models (and /v1/models/ID), /tokenize, /health, /version (vLLM's shape:
{"version": ...}, the releasegate package's), /metrics (Prometheus). Errors
have OpenAI's body `{"error": {"message", "type", "param", "code"}}`; bad input
(wrong JSON types included: fields are strict) is a 400, a body past MAX_BODY_BYTES
a 413, and the server keeps serving. A client that disconnects mid-stream has its
request aborted, which frees its KV blocks before the next engine step.

What the bodies take is in `gpuagent.engine.openai_api`: every field is implemented
or refused with a 400 naming it; the bodies check their own ranges. The routes are
module-level functions that find the `OpenAIServer` on `request.app.state.server`;
answers are written by `gpuagent.engine.responses`. Beyond the basics:

- `n` choices per prompt (at most MAX_N); with a `seed`, choice j draws from seed + j,
  so the choices differ and each is reproducible.
- `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`,
  `min_tokens`: see `gpuagent.engine.sampling` (logprobs stay the raw model's).
- `/v1/completions` with `echo=true`: the prompt's text before the answer and, with
  `logprobs=N`, each prompt token's logprob and top-N (`null` for the first token,
  which nothing predicts); `max_tokens=0` scores the prompt and generates nothing.
  This is how lm-evaluation-harness scores loglikelihood over HTTP.
- Without `max_tokens`, an answer is at most `default_max_tokens` (DEFAULT_MAX_TOKENS,
  `serve --default-max-tokens`) tokens, and never past the context.
- An unknown model is a 404 (`model_not_found`), as OpenAI and vLLM answer it.
- The model's chat template renders in a child process under time, memory and
  output limits (`gpuagent.engine.untrusted`): past one, a 400 naming it
  (`chat_template_limit`); a template that fails them on sample conversations
  keeps the server from starting.
- Each request is logged (its id, sequences, prompt tokens, `user` and `metadata`)
  on the logger `gpuagent.engine.server`.
- `max_model_len` in /v1/models is the longest sequence the KV pool can hold, not
  just the model's position limit; `root` is the model folder's absolute path (as
  vLLM's), which tools that load a tokenizer take instead of the served name
  (guidellm: `--tokenizer kind=huggingface_auto,model=ROOT`).
- Chat logprobs cover exactly the tokens of the returned text: a stop token (EOS or
  a `stop_token_ids` id), which the text leaves out, has no entry either. Completion
  logprobs list every generated token, a stop token too, as vLLM's do: echo scoring
  (lm-evaluation-harness) counts on prompt + max_tokens entries.
- `usage.prompt_tokens_details.cached_tokens` (OpenAI's field) counts the prompt
  tokens the prefix cache served (once per prompt, as `prompt_tokens`), streamed
  usage too. A request may name its session in the `x-session-affinity` header:
  where an environment runs several replicas a router sends a session to the same
  one, whose prefix cache holds its history; this server is one replica, so the
  header is recorded (logged with the request id, counted in
  `engine_session_affinity_requests_total`) and never refused.
- /metrics has, beside the engine's gauges and counters, the histogram
  `engine_iteration_num_requests_running`: the running batch observed once per
  engine step, one bucket per count up to max_num_seqs. Two readings bracket a span
  exactly: its peak of concurrent sequences is the highest count whose bucket grew
  (`gpuagent.loadtest.server_metrics.peak_running`), and `_sum / _count` is its mean
  batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuagent.engine.engine import AsyncLLMEngine, RequestStream
from gpuagent.engine.openai_api import (
    APIError,
    BodyT,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
    _SamplingFields,
    error_response,
    parse_body,
)
from gpuagent.engine.responses import (
    Choice,
    ResponseFormat,
    chat_body,
    collect_finals,
    completion_body,
    prompt_tokens,
    sse_stream,
    stream_chat,
    stream_completion,
)
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.scheduler import RequestTooLargeError
from gpuagent.engine.token_text import TextOffsets, TokenBytes
from gpuagent.engine.untrusted import (
    ChatTemplateRenderer,
    LimitError,
    ProbeError,
    TemplateRefusedError,
)

__all__ = ["TextOffsets", "TokenBytes", "build_app"]

log = logging.getLogger(__name__)

# Answer length when a request gives no max_tokens (bounded, unlike vLLM's "the rest
# of the context": a forgotten max_tokens must not hold a whole context's KV).
DEFAULT_MAX_TOKENS = 1024
SESSION_AFFINITY_HEADER = "x-session-affinity"


class OpenAIServer:
    """What the routes share: the engine, the served names (the first is the one
    answers carry), and the checks, prompts and submissions of requests."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_names: Sequence[str],
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        model_root: str | None = None,
    ) -> None:
        if not model_names:
            raise ValueError("give the server at least one model name")
        self.engine = engine
        self.model_root = model_root
        self.llm = engine.engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.format = ResponseFormat(self.llm, self.model_name)
        self.session_affinity_requests: Counter  # set by server_metrics
        self.metrics = server_metrics(self)
        self.templates = ChatTemplateRenderer()
        tokenizer = self.llm.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if template:
            try:
                self.templates.probe(template, **self.special_tokens())
            except ProbeError:
                self.templates.close()
                raise

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + answer) this server can run: the model's
        limit or the KV pool's, whichever is smaller."""
        return min(self.llm.max_model_len, self.llm.kv.blocks.capacity_tokens)

    def model_card(self, name: str) -> dict[str, Any]:
        """The /v1/models entry of one served name."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "releasegate",
            "root": self.model_root,
            "parent": None,
            "max_model_len": self.max_model_len,
        }

    # -- validation ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """APIError 404 unless `model` (when given) is one of the served names."""
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_name)

    def sampling_params(
        self,
        body: _SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        prompt_logprobs: int | None = None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice (`n`); choice j of a seeded request draws
        from seed + j. The body checked its own ranges; this checks the context."""
        room = self.max_model_len
        if prompt_len >= room + (max_tokens == 0):
            raise APIError(
                f"this model's maximum context length is {room} tokens; the prompt "
                f"has {prompt_len}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room - prompt_len)
        seeds = [body.seed] * body.n
        if body.seed is not None:
            seeds = [body.seed + j for j in range(body.n)]
        try:
            return [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=body.top_k,
                    seed=seed,
                    stop=body.stop or [],
                    stop_token_ids=body.stop_token_ids or [],
                    ignore_eos=body.ignore_eos,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    min_tokens=body.min_tokens,
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    logit_bias=body.logit_bias_ids(),
                )
                for seed in seeds
            ]
        except ValueError as exc:
            param = str(exc).split(" ", 1)[0]
            raise APIError(str(exc), param=param, code="invalid_value") from None

    def completion_choices(self, body: CompletionRequest) -> list[Choice]:
        """The sequences of a /v1/completions request: `n` per prompt, in order."""
        choices: list[Choice] = []
        for prompt in body.prompts:
            ids = self.encode(prompt, "prompt")
            params = self.sampling_params(
                body,
                len(ids),
                body.max_tokens,
                body.logprobs,
                "prompt",
                prompt_logprobs=body.prompt_logprobs,
            )
            text = self.format.prompt_text(prompt, ids) if body.echo else ""
            first = len(choices)
            choices += [Choice(first + j, ids, text, p) for j, p in enumerate(params)]
        return choices

    async def chat_choices(self, body: ChatCompletionRequest) -> list[Choice]:
        """The `n` sequences of a /v1/chat/completions request."""
        ids = self.encode(await self.chat_prompt(body.messages), "messages")
        params = self.sampling_params(
            body, len(ids), body.answer_limit, body.top_logprobs_asked, "messages"
        )
        return [Choice(j, ids, "", p) for j, p in enumerate(params)]

    def submit_all(
        self, choices: Sequence[Choice], prompt_param: str
    ) -> list[RequestStream]:
        """Submit every choice, or none: a refusal closes those already queued."""
        streams: list[RequestStream] = []
        try:
            for choice in choices:
                streams.append(
                    self.submit(choice.prompt_ids, choice.params, prompt_param)
                )
        except APIError:
            for stream in streams:
                stream.close()
            raise
        return streams

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
            param = "logit_bias" if "logit_bias" in str(exc) else prompt_param
            raise APIError(str(exc), param=param) from None

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            ids = self.llm.encode_prompt(prompt)
        except ValueError as exc:
            raise APIError(str(exc), param=param) from None
        if not ids:
            raise APIError("the prompt is empty", param=param)
        return ids

    async def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text of chat `messages`, through the model's chat template,
        rendered in a child process under time, memory and output limits
        (`untrusted.ChatTemplateRenderer`; a thread waits on it, not the loop).

        A `developer` message is rendered as `system` unless the template knows the
        developer role; `tool_calls` are refused unless the template renders them
        (passing them to one that drops them would ignore them)."""
        tokenizer = self.llm.tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        turns = []
        for m in messages:
            role = m.role
            if role == "developer" and "developer" not in template:
                role = "system"
            turn: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            if m.tool_calls is not None:
                if "tool_calls" not in template:
                    raise APIError(
                        "this model's chat template does not render tool_calls",
                        param="messages",
                        code="unsupported_field",
                    )
                turn["tool_calls"] = m.tool_calls
            turns.append(turn)
        if template:
            try:
                return await asyncio.to_thread(
                    self.templates.render,
                    template,
                    turns,
                    add_generation_prompt=True,
                    **self.special_tokens(),
                )
            except TemplateRefusedError as exc:
                # The folder's template refuses these messages (e.g. roles that
                # must alternate, or its `raise_exception`, which we don't provide).
                raise APIError(
                    f"the model's chat template refused the messages: {exc}",
                    param="messages",
                ) from None
            except LimitError as exc:
                raise APIError(
                    str(exc), param="messages", code="chat_template_limit"
                ) from None
        # No template in the folder: a plain transcript ending in the assistant's turn.
        lines = [f"{t['role']}: {t['content']}" for t in turns]
        return "\n".join(lines) + "\nassistant:"

    def special_tokens(self) -> dict[str, Any]:
        """bos_token and eos_token, as a chat template sees them."""
        tokenizer = self.llm.tokenizer
        return {
            name: getattr(tokenizer, name, None) or ""
            for name in ("bos_token", "eos_token")
        }


def model_not_found(model: str, served: str) -> APIError:
    """OpenAI's answer for a model that isn't served: a 404."""
    return APIError(
        f"the model {model!r} does not exist; this server serves {served!r}",
        status=404,
        param="model",
        code="model_not_found",
    )


def log_request(
    server: OpenAIServer,
    request: Request,
    request_id: str,
    body: _SamplingFields,
    choices: Sequence[Choice],
) -> None:
    """The request log's line: what was asked, the caller's `user` and `metadata`
    and the session it names in x-session-affinity (as JSON, so no value can forge
    a line); a named session is counted too (module docstring)."""
    session = request.headers.get(SESSION_AFFINITY_HEADER)
    if session is not None:
        server.session_affinity_requests.inc()
    log.info(
        "%s: %d sequence(s), %d prompt tokens, user %s, metadata %s, session %s",
        request_id,
        len(choices),
        prompt_tokens(choices, body.n),
        json.dumps(body.user),
        json.dumps(body.metadata, sort_keys=True),
        json.dumps(session if session is None else session[:200]),
    )


def server_metrics(server: OpenAIServer) -> CollectorRegistry:
    """The server's own gauges beside the engine's: what a load tester needs to turn
    KV bytes into sessions and cost (weights, context limit, slots, threads)."""
    registry = CollectorRegistry()
    llm = server.llm
    weights = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    Gauge(
        "engine_weights_bytes",
        "Bytes of model weights (a tied matrix once)",
        registry=registry,
    ).set(weights)
    Gauge(
        "engine_max_model_len",
        "Longest sequence served: the model's limit or the KV pool's",
        registry=registry,
    ).set(server.max_model_len)
    Gauge(
        "engine_max_num_seqs", "Sequences the scheduler runs at once", registry=registry
    ).set(llm.scheduler.max_num_seqs)
    Gauge(
        "engine_torch_threads", "Intra-op CPU threads of the engine", registry=registry
    ).set_function(torch.get_num_threads)
    server.session_affinity_requests = Counter(
        "engine_session_affinity_requests",
        f"Requests that named their session in {SESSION_AFFINITY_HEADER}",
        registry=registry,
    )
    return registry


# --------------------------------------------------------------------------- routes


def server_of(request: Request) -> OpenAIServer:
    """The app's `OpenAIServer` (set by `build_app`)."""
    return request.app.state.server


async def server_and_body(
    request: Request, model: type[BodyT]
) -> tuple[OpenAIServer, BodyT]:
    """The app's server and the request's body, parsed as `model`, for a model
    the server serves (APIError otherwise)."""
    server = server_of(request)
    body = await parse_body(request, model)
    server.check_model(body.model)  # type: ignore[attr-defined]
    return server, body


def sse_response(
    events: AsyncIterator[str], streams: Sequence[RequestStream]
) -> StreamingResponse:
    """A streamed answer: `events` as server-sent events (see `sse_stream`)."""
    return StreamingResponse(
        sse_stream(events, streams), media_type="text/event-stream"
    )


async def health(request: Request) -> Response:
    if not server_of(request).engine.is_running:
        return JSONResponse({"status": "engine not running"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def version(request: Request) -> dict[str, str]:
    return {"version": package_version()}


def package_version() -> str:
    """The releasegate package's version ("" when it is not installed)."""
    try:
        return importlib.metadata.version("releasegate")
    except importlib.metadata.PackageNotFoundError:
        return ""


async def metrics(request: Request) -> Response:
    server = server_of(request)
    body = generate_latest(server.llm.metrics.registry)
    body += generate_latest(server.metrics)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    server = server_of(request)
    return {
        "object": "list",
        "data": [server.model_card(n) for n in server.model_names],
    }


async def model_by_id(request: Request, model_id: str) -> dict[str, Any]:
    server = server_of(request)
    server.check_model(model_id)
    return server.model_card(model_id)


async def tokenize(request: Request) -> dict[str, Any]:
    server, body = await server_and_body(request, TokenizeRequest)
    if body.messages is not None:
        ids = server.encode(await server.chat_prompt(body.messages), "messages")
    else:
        ids = server.encode(body.prompt or "", "prompt")
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}


async def completions(request: Request) -> Response:
    server, body = await server_and_body(request, CompletionRequest)
    choices = server.completion_choices(body)
    streams = server.submit_all(choices, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    log_request(server, request, request_id, body, choices)
    fmt = server.format
    if body.stream:
        return sse_response(
            stream_completion(fmt, request_id, body, streams, choices), streams
        )
    offsets = [fmt.text_offsets() for _ in streams] if body.logprobs is not None else []
    finals = await collect_finals(request, streams, offsets)
    return JSONResponse(
        completion_body(fmt, request_id, body, choices, finals, offsets)
    )


async def chat_completions(request: Request) -> Response:
    server, body = await server_and_body(request, ChatCompletionRequest)
    choices = await server.chat_choices(body)
    streams = server.submit_all(choices, "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    log_request(server, request, request_id, body, choices)
    if body.stream:
        return sse_response(
            stream_chat(server.format, request_id, body, streams, choices), streams
        )
    finals = await collect_finals(request, streams)
    return JSONResponse(chat_body(server.format, request_id, body, choices, finals))


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error_response(
        APIError(f"internal error: {exc}", status=500, type="internal_error")
    )


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Runs the engine thread while the app serves (and stops the template
    renderer's children after)."""
    server = app.state.server
    server.engine.start()
    try:
        yield
    finally:
        server.engine.shutdown()
        server.templates.close()


def build_app(
    engine: AsyncLLMEngine,
    model_name: str | Sequence[str],
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    model_root: str | None = None,
) -> FastAPI:
    """The FastAPI app; starts the engine thread at startup, stops it at shutdown.
    `model_name` is the served name, or several (the first is the one answers
    carry; requests may use any); `model_root` is the model folder /v1/models
    names as each name's `root`."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    app = FastAPI(title="releasegate engine", lifespan=lifespan)
    app.state.server = OpenAIServer(engine, names, default_max_tokens, model_root)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.get("/health")(health)
    app.get("/version")(version)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(models)
    app.get("/v1/models/{model_id:path}")(model_by_id)
    app.post("/tokenize")(tokenize)
    app.post("/v1/completions")(completions)
    app.post("/v1/chat/completions")(chat_completions)
    return app
