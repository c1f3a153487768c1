"""OpenAI request bodies as the server takes them, and OpenAI's error body.

Every field of a body is either implemented or refused: a field the server doesn't
know, or an OpenAI field it doesn't implement (`UNSUPPORTED_FIELDS`), is a 400 naming
it, never a 200 that silently does nothing. A known-unsupported field sent as `null`
asks for nothing and passes. Types are strict, as OpenAI's: "5" or true is no
max_tokens (an int is a float). The bodies check their own ranges (`n`, `logprobs`,
`max_tokens`, prompts per request, ...); what needs the model (the context length,
token ids) is checked by the server.

OpenAI's bookkeeping fields are taken where the server honours them: `user` and
`metadata` are recorded (the request log; answers echo `metadata`), `store: false`
and `service_tier` `auto`/`default` ask for what the server does anyway. `store:
true` (nothing is stored) and any other tier are refused, naming the value.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpuagent.engine.sampling import MAX_LOGPROBS

# Each prompt of a batch is a sequence with its own queue and task; OpenAI caps 2048.
MAX_PROMPTS_PER_REQUEST = 2048
# Choices per prompt; each is a sequence of its own in the batch.
MAX_N = 16
# OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# `user` goes into the request log: bounded as a metadata value is.
MAX_USER_CHARS = 512
# The tiers a request may ask for: this server has one, which OpenAI calls "default".
SERVICE_TIERS = ("auto", "default")
SERVED_TIER = "default"

# Far above any prompt the context holds (a 128k-token prompt is ~1 MB of JSON); a
# bigger body is refused before it is read into memory.
MAX_BODY_BYTES = 16 * 2**20

# OpenAI fields this server does not implement, and why (answered with a 400).
UNSUPPORTED_FIELDS = {
    "best_of": "best-of-n sampling is not implemented (use n)",
    "suffix": "insertion after a suffix is not implemented",
    "response_format": "structured output is not implemented",
    "tools": "tool calling is not implemented",
    "tool_choice": "tool calling is not implemented",
    "parallel_tool_calls": "tool calling is not implemented",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
    "modalities": "only text output is implemented",
    "audio": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "reasoning effort is not implemented",
    "web_search_options": "web search is not implemented",
}


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


class InvalidField(ValueError):
    """A request body's check failed, blaming `param` (raised in a validator, so
    that a check across fields names the field, not the body)."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
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


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM extra: usage so far in every chunk (with include_usage)
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> StreamOptions:
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats needs include_usage=true")
        return self


class _SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM extra
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extra
    ignore_eos: bool = False  # vLLM extra
    min_tokens: int = 0  # vLLM extra
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extra
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)  # recorded (log)
    metadata: dict[str, str] | None = None  # recorded (log) and echoed
    store: bool | None = None  # only false: nothing is stored
    service_tier: str | None = None  # only the tier served

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise InvalidField(
                "metadata",
                f"metadata takes at most {MAX_METADATA_PAIRS} pairs, got {len(value)}",
            )
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise InvalidField(
                    "metadata",
                    f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters, "
                    f"got {len(key)} in {key[:MAX_METADATA_KEY_CHARS]!r}...",
                )
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise InvalidField(
                    "metadata",
                    f"metadata values are at most {MAX_METADATA_VALUE_CHARS} "
                    f"characters, got {len(text)} for {key!r}",
                )
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: bool | None) -> bool | None:
        if value:
            raise InvalidField(
                "store",
                "store=true is not supported: this server does not store "
                "completions (send false or leave it out)",
                code="unsupported_value",
            )
        return value

    @field_validator("service_tier")
    @classmethod
    def _check_service_tier(cls, value: str | None) -> str | None:
        if value is not None and value not in SERVICE_TIERS:
            raise InvalidField(
                "service_tier",
                f"service_tier {value!r} is not offered: this server has one tier "
                f"(ask for {' or '.join(repr(t) for t in SERVICE_TIERS)})",
                code="unsupported_value",
            )
        return value

    @property
    def answer_fields(self) -> dict[str, Any]:
        """What a non-streamed answer echoes of the request: its `metadata`, and
        the tier that served it when it asked for one (as OpenAI answers)."""
        fields: dict[str, Any] = {}
        if self.metadata is not None:
            fields["metadata"] = self.metadata
        if self.service_tier is not None:
            fields["service_tier"] = SERVED_TIER
        return fields

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` keyed by token id (APIError when a key isn't one)."""
        biases = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                biases[int(key)] = bias
            except ValueError:
                raise APIError(
                    f"logit_bias keys must be token ids, got {key!r}",
                    param="logit_bias",
                    code="invalid_value",
                ) from None
        return biases


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _check_prompts_and_max_tokens(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidField(
                "max_tokens",
                "max_tokens must be at least 1, got 0 (0 only with echo=true)",
            )
        prompts = self.prompts
        if not prompts:
            raise InvalidField("prompt", "the prompt is empty")
        if len(prompts) * self.n > MAX_PROMPTS_PER_REQUEST:
            raise InvalidField(
                "prompt",
                f"a request takes at most {MAX_PROMPTS_PER_REQUEST} prompts times n, "
                f"got {len(prompts) * self.n}",
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request (one text or token-id list, or several)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def prompt_logprobs(self) -> int | None:
        """The top-N of each prompt token to score, or None. Echo scores the prompt
        when logprobs are asked, or when nothing is to be generated (max_tokens=0),
        which the engine takes only when scoring."""
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            return self.logprobs or 0
        return None


class ChatMessage(_Body):
    """One message. `developer` is OpenAI's newer name for the system prompt; `tool`
    carries a tool's answer (`tool_call_id`); an assistant turn may have no text
    (`content: null`), e.g. when it made tool calls."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError(
                "tool_call_id is required on tool messages, and only there"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        return self

    def text(self) -> str:
        """The message's text ("" for an assistant turn without content)."""
        if self.content is None:
            return ""
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
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def answer_limit(self) -> int | None:
        """The answer's token limit: OpenAI's newer max_completion_tokens wins over
        max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def top_logprobs_asked(self) -> int | None:
        """Alternatives per answer token (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


BodyT = TypeVar("BodyT", bound=BaseModel)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_of_prompt_and_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidField("prompt", "give exactly one of prompt and messages")
        return self


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


def refuse_unsupported(data: dict[str, Any]) -> None:
    """Raise APIError for an OpenAI field this server doesn't implement; drop those
    sent as null (they ask for nothing), and a `best_of` equal to `n`."""
    for name, reason in UNSUPPORTED_FIELDS.items():
        if name not in data:
            continue
        value = data[name]
        if value is None or (name == "best_of" and value == data.get("n", 1)):
            del data[name]
            continue
        raise APIError(
            f"{name} is not supported: {reason}", param=name, code="unsupported_field"
        )


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """The request's JSON body validated as `model` (APIError 400 otherwise, naming
    the field; 413 past MAX_BODY_BYTES)."""
    raw = await read_body(request)
    try:
        data = json.loads(raw)
    # ValueError covers JSONDecodeError, bad UTF-8 and ints past Python's digit limit.
    except (ValueError, RecursionError) as exc:
        raise APIError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    return validate_body(data, model)


def validate_body(data: Any, model: type[BodyT]) -> BodyT:
    """`data` (a decoded JSON body) validated as `model`: APIError 400 otherwise,
    naming the field (the one a check across fields blames, see `InvalidField`)."""
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object", code="invalid_json")
    refuse_unsupported(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        blamed = first.get("ctx", {}).get("error")
        if isinstance(blamed, InvalidField):
            raise APIError(str(blamed), param=blamed.param, code=blamed.code) from None
        param = ".".join(str(p) for p in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise APIError(
                f"unknown field {param!r}: this server does not implement it",
                param=param,
                code="unsupported_field",
            ) from None
        raise APIError(
            f"invalid field {param}: {first['msg']}", param=param, code="invalid_value"
        ) from None
