"""OpenAI-compatible HTTP server over `AsyncLLMEngine` (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions (SSE streaming or not, usage in the
stream with `stream_options.include_usage`, logprobs with each token's exact bytes),
/v1/models (and /v1/models/ID), /tokenize, /health, /metrics (Prometheus). Errors
have OpenAI's body `{"error": {"message", "type", "param", "code"}}`; bad input
(wrong JSON types included: fields are strict) is a 400, a body past MAX_BODY_BYTES
a 413, and the server keeps serving. A client that disconnects mid-stream has its
request aborted, which frees its KV blocks before the next engine step.

What the bodies take is in `gpuagent.engine.openai_api`: every field is implemented
or refused with a 400 naming it. Beyond the basics:

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
- `max_model_len` in /v1/models is the longest sequence the KV pool can hold, not
  just the model's position limit.
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

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
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

from gpuagent.engine.engine import (
    AsyncLLMEngine,
    RequestOutput,
    RequestStream,
    TokenLogprob,
)
from gpuagent.engine.openai_api import (
    APIError,
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
    collect_finals,
    join_logprobs,
    sse_stream,
    stream_chat,
    stream_completion,
)
from gpuagent.engine.sampling import MAX_LOGPROBS, SamplingParams
from gpuagent.engine.scheduler import RequestTooLargeError
from gpuagent.engine.token_text import (
    TextOffsets,
    TokenBytes,
    bytes_text,
    prompt_text_offsets,
)

__all__ = ["TextOffsets", "TokenBytes", "build_app"]

# Each prompt of a batch is a sequence with its own queue and task; OpenAI caps 2048.
MAX_PROMPTS_PER_REQUEST = 2048
# Choices per prompt; each is a sequence of its own in the batch.
MAX_N = 16
# Answer length when a request gives no max_tokens (bounded, unlike vLLM's "the rest
# of the context": a forgotten max_tokens must not hold a whole context's KV).
DEFAULT_MAX_TOKENS = 1024
SESSION_AFFINITY_HEADER = "x-session-affinity"

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- app


class OpenAIServer:
    """Request handling shared by the routes (holds the engine and model names; the
    first name is the one responses carry)."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_names: Sequence[str],
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        if not model_names:
            raise ValueError("give the server at least one model name")
        self.engine = engine
        self.llm = engine.engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self._token_bytes: TokenBytes | None = None
        # set by server_metrics
        self.session_affinity_requests: Counter | None = None

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + answer) this server can run: the model's
        limit or the KV pool's, whichever is smaller."""
        return min(self.llm.max_model_len, self.llm.kv.blocks.capacity_tokens)

    # -- validation ------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_name)

    def sampling_params(
        self,
        body: _SamplingFields,
        prompt_len: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
        prompt_logprobs: int | None = None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice (`n`); choice j of a seeded request draws
        from seed + j."""
        if not 1 <= body.n <= MAX_N:
            raise APIError(
                f"n must be between 1 and {MAX_N}, got {body.n}",
                param="n",
                code="invalid_value",
            )
        least = 0 if prompt_logprobs is not None else 1
        if max_tokens is not None and max_tokens < least:
            raise APIError(
                f"{max_tokens_param} must be at least {least}, got {max_tokens}"
                + (" (0 only with echo=true)" if least else ""),
                param=max_tokens_param,
                code="invalid_value",
            )
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

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text of chat `messages`, through the model's chat template.

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
            from jinja2 import TemplateError  # rendering the template needs it anyway

            try:
                return tokenizer.apply_chat_template(turns, add_generation_prompt=True)
            except (TemplateError, TypeError) as exc:
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
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.token_bytes(token_id)
            return {"token": bytes_text(raw), "logprob": logprob, "bytes": list(raw)}

        content = []
        for lp in logprobs:
            item = entry(lp.token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top_logprobs]
            content.append(item)
        return {"content": content}

    @staticmethod
    def usage(
        prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def note_session(self, headers: Mapping[str, str], request_id: str) -> None:
        """Record the session a request names in x-session-affinity (module
        docstring): logged with the request id and counted."""
        session = headers.get(SESSION_AFFINITY_HEADER)
        if session is None:
            return
        if self.session_affinity_requests is not None:
            self.session_affinity_requests.inc()
        log.info("%s: session %r", request_id, session[:200])


def model_not_found(model: str, served: str) -> APIError:
    """OpenAI's answer for a model that isn't served: a 404."""
    return APIError(
        f"the model {model!r} does not exist; this server serves {served!r}",
        status=404,
        param="model",
        code="model_not_found",
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


def build_app(
    engine: AsyncLLMEngine,
    model_name: str | Sequence[str],
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> FastAPI:
    """The FastAPI app; starts the engine thread at startup, stops it at shutdown.
    `model_name` is the served name, or several (the first is the one answers
    carry; requests may use any)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="releasegate engine", lifespan=lifespan)
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    server = OpenAIServer(engine, names, default_max_tokens)
    app.state.server = server
    extra_metrics = server_metrics(server)

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
        body += generate_latest(extra_metrics)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "releasegate",
            "max_model_len": server.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return model_card(model_id)

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
            "max_model_len": server.max_model_len,
            "tokens": ids,
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        server.check_model(body.model)
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
        if len(prompts) * body.n > MAX_PROMPTS_PER_REQUEST:
            raise APIError(
                f"a request takes at most {MAX_PROMPTS_PER_REQUEST} prompts times n, "
                f"got {len(prompts) * body.n}",
                param="prompt",
                code="invalid_value",
            )
        # Echo scores the prompt when logprobs are asked, or when nothing is to be
        # generated (max_tokens=0), which the engine takes only when scoring.
        prompt_logprobs = None
        if body.echo and (body.logprobs is not None or body.max_tokens == 0):
            prompt_logprobs = body.logprobs or 0
        choices: list[Choice] = []
        for prompt in prompts:
            ids = server.encode(prompt, "prompt")
            params = server.sampling_params(
                body,
                len(ids),
                body.max_tokens,
                body.logprobs,
                "prompt",
                prompt_logprobs=prompt_logprobs,
            )
            text = server.prompt_text(prompt, ids) if body.echo else ""
            first = len(choices)
            choices += [Choice(first + j, ids, text, p) for j, p in enumerate(params)]
        streams = server.submit_all(choices, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        server.note_session(request.headers, request_id)
        prompt_tokens = sum(len(c.prompt_ids) for c in choices[:: body.n])
        if body.stream:
            events = stream_completion(
                server,
                request_id,
                streams,
                choices,
                prompt_tokens,
                body.include_usage,
                body.logprobs is not None,
                body.echo,
                body.continuous_usage,
                body.n,
            )
            return StreamingResponse(
                sse_stream(events, streams), media_type="text/event-stream"
            )
        with_logprobs = body.logprobs is not None
        offsets = [server.text_offsets() for _ in streams] if with_logprobs else []
        finals = await collect_finals(request, streams, offsets)
        answers = []
        for choice, out in zip(choices, finals, strict=True):
            logprobs = None
            if with_logprobs:
                logprobs = server.completion_logprobs(
                    out.new_logprobs, offsets[choice.index].offsets
                )
                if body.echo:
                    logprobs = join_logprobs(
                        server.echo_logprobs(choice.prompt_ids, out.prompt_logprobs),
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
        completion_tokens = sum(o.num_output_tokens for o in finals)
        cached_tokens = sum(o.num_cached_tokens for o in finals[:: body.n])
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": server.model_name,
                "choices": answers,
                "usage": server.usage(prompt_tokens, completion_tokens, cached_tokens),
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
        choices = [Choice(j, ids, "", p) for j, p in enumerate(params)]
        streams = server.submit_all(choices, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        server.note_session(request.headers, request_id)
        if body.stream:
            events = stream_chat(
                server,
                request_id,
                streams,
                choices,
                len(ids),
                body.include_usage,
                body.logprobs,
                body.continuous_usage,
            )
            return StreamingResponse(
                sse_stream(events, streams), media_type="text/event-stream"
            )
        finals = await collect_finals(request, streams)
        answers = [
            {
                "index": choice.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": server.chat_logprobs(
                    server.answer_logprobs(out, choice.params)
                )
                if body.logprobs
                else None,
                "finish_reason": out.finish_reason,
            }
            for choice, out in zip(choices, finals, strict=True)
        ]
        completion_tokens = sum(o.num_output_tokens for o in finals)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": server.model_name,
                "choices": answers,
                "usage": server.usage(
                    len(ids), completion_tokens, finals[0].num_cached_tokens
                ),
            }
        )

    return app
