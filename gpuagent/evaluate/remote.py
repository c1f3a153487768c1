"""An OpenAI-compatible endpoint scored over HTTP: prompt-token logprobs through
`/v1/completions` with `echo=true, logprobs=N` (as lm-evaluation-harness does),
token ids through `/tokenize` (ours and vLLM's), greedy continuations with
`temperature=0`. Only the top-N logprobs of each position come back (N <= 20 on
OpenAI-style servers), so KL against it is the estimate in `metrics.top_n_kld`.
No routing comes back either: a report with an endpoint on either side says its
router agreement is unknown (`evaluate.routing.not_visible`), never measured."""

from __future__ import annotations

from typing import Any

import httpx

from gpuagent.evaluate.metrics import TopN


class EndpointError(RuntimeError):
    """The endpoint refused or failed a request; the message says which and why."""


class Endpoint:
    """One served model at `url` (with or without the /v1 suffix); `model` defaults
    to the first one /v1/models lists."""

    def __init__(
        self, url: str, model: str | None = None, timeout_s: float = 600.0
    ) -> None:
        self.base_url = url.rstrip("/").removesuffix("/v1")
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        cards = self._call("GET", "/v1/models")["data"]
        if not cards:
            raise EndpointError(f"{self.base_url} serves no model")
        card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
        if card is None:
            raise EndpointError(
                f"{self.base_url} does not serve {model!r}; it serves "
                + ", ".join(repr(c["id"]) for c in cards)
            )
        self.model = card["id"]
        self.max_model_len = int(card.get("max_model_len") or 2048)
        self.label = f"{self.base_url} ({self.model})"

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            resp = self.client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{self.base_url}{path}: {exc}") from exc
        if resp.status_code != 200:
            raise EndpointError(
                f"{self.base_url}{path} answered {resp.status_code}: {resp.text[:500]}"
            )
        return resp.json()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as a prompt, by the server's own tokenizer."""
        body = {"model": self.model, "prompt": text}
        return list(self._call("POST", "/tokenize", body)["tokens"])

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as a prompt."""
        return len(self.encode(text))

    def top_n(self, ids: list[int], n: int) -> list[TopN]:
        """Positions 1.. of `ids` with the server's top-`n` logprobs. One token is
        generated and dropped (max_tokens=1: what servers without max_tokens=0
        take, lm-evaluation-harness's request)."""
        body = {
            "model": self.model,
            "prompt": ids,
            "echo": True,
            "max_tokens": 1,
            "logprobs": n,
            "temperature": 0,
        }
        logprobs = self._call("POST", "/v1/completions", body)["choices"][0]["logprobs"]
        tokens = logprobs["tokens"]
        if len(tokens) < len(ids):
            raise EndpointError(
                f"{self.base_url} echoed {len(tokens)} tokens for a {len(ids)}-token "
                "prompt"
            )
        return [
            TopN(tokens[i], logprobs["token_logprobs"][i], logprobs["top_logprobs"][i])
            for i in range(1, len(ids))
        ]

    def greedy(self, ids: list[int], max_tokens: int) -> tuple[None, str]:
        """The greedy continuation's text (token ids aren't returned over HTTP)."""
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return None, self._call("POST", "/v1/completions", body)["choices"][0]["text"]
