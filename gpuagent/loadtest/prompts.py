"""Prompts of a profile's length in the server's own tokens.

A prompt is one user message: a request tag ("Request 000123."), text cut from the
profile's source passages (each variant starting at another passage), and the
profile's instruction. Its length is measured by the server itself, chat template
included: `POST /tokenize` with the messages (this engine and vLLM have it), or,
where that route is missing, the `usage.prompt_tokens` of a one-token request. The
cut is found by bisection on the text's length, so a prompt has exactly the
profile's tokens where the tokenizer allows it (short by less than one
character's tokens otherwise: the cut falls between characters).
The tag's digits make every request's prompt distinct (no server-side prefix cache
turns the load into a cache benchmark) at the same length.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from gpuagent.evaluate.evalsets import load_text_slices
from gpuagent.loadtest.profiles import Profile

TAG_TEMPLATE = "Request {:06d}."
# Prompt variants per profile (distinct cuts of the source text).
DEFAULT_VARIANTS = 4


class PromptError(RuntimeError):
    """A prompt of the asked length can't be built against this server."""


def messages(content: str) -> list[dict[str, str]]:
    """The chat messages of one prompt."""
    return [{"role": "user", "content": content}]


@dataclass
class PromptSet:
    """Calibrated prompt variants of one profile; `content(i)` is request i's."""

    profile: Profile
    variants: list[str]  # each with a placeholder tag of the same width
    prompt_tokens: list[int]  # measured, per variant

    def content(self, request_index: int) -> str:
        """Request `request_index`'s message text (distinct per request)."""
        base = self.variants[request_index % len(self.variants)]
        return base.replace(
            TAG_TEMPLATE.format(0), TAG_TEMPLATE.format(request_index), 1
        )


async def tokenize_counter(
    session: aiohttp.ClientSession, base_url: str, model: str
) -> Callable[[str], Awaitable[int]]:
    """`count(content) -> prompt tokens` through the server: /tokenize, else the
    usage of a one-token request."""

    async def by_tokenize(content: str) -> int:
        body = {"model": model, "messages": messages(content)}
        async with session.post(f"{base_url}/tokenize", json=body) as resp:
            if resp.status != 200:
                raise PromptError(f"/tokenize answered {resp.status}")
            return int((await resp.json())["count"])

    async def by_usage(content: str) -> int:
        body = {"model": model, "messages": messages(content), "max_tokens": 1}
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise PromptError(
                    f"/v1/chat/completions answered {resp.status}: "
                    f"{(await resp.text())[:300]}"
                )
            return int((await resp.json())["usage"]["prompt_tokens"])

    try:
        await by_tokenize("hello")
        return by_tokenize
    except (PromptError, aiohttp.ClientError, KeyError, ValueError):
        return by_usage


def source_text(source: str, start: int, min_chars: int) -> str:
    """The `source` slice's passages from passage `start` on, round and round, to at
    least `min_chars` characters."""
    passages = next(s for s in load_text_slices() if s.name == source).passages
    parts, size, index = [], 0, start
    while size < min_chars:
        passage = passages[index % len(passages)]
        parts.append(passage)
        size += len(passage) + 2
        index += 1
    return "\n\n".join(parts)


async def fit(
    profile: Profile,
    prompt_tokens: int,
    start: int,
    count: Callable[[str], Awaitable[int]],
) -> tuple[str, int]:
    """The longest content from passage `start` on that is at most `prompt_tokens`
    tokens, and its length."""

    # At least one character per token; korean/code take more characters.
    text = source_text(profile.source, start, 8 * prompt_tokens)

    def content(chars: int) -> str:
        return f"{TAG_TEMPLATE.format(0)}\n\n{text[:chars]}\n\n{profile.instruction}"

    overhead = await count(content(0))
    if overhead > prompt_tokens:
        raise PromptError(
            f"profile {profile.name!r}: the tag, instruction and chat template alone "
            f"are {overhead} tokens, more than {prompt_tokens}"
        )
    low, high = 0, len(text)  # count(content(low)) <= prompt_tokens
    while high - low > 1:
        middle = (low + high) // 2
        if await count(content(middle)) <= prompt_tokens:
            low = middle
        else:
            high = middle
    return content(low), await count(content(low))


async def build_prompts(
    profile: Profile,
    count: Callable[[str], Awaitable[int]],
    variants: int = DEFAULT_VARIANTS,
) -> PromptSet:
    """`variants` prompts of the profile's length."""
    fitted = [
        await fit(profile, profile.prompt_tokens, start, count)
        for start in range(variants)
    ]
    return PromptSet(profile, [c for c, _ in fitted], [n for _, n in fitted])
