"""The OpenAI-compatible server, run for real: uvicorn on 127.0.0.1 in a thread."""

import asyncio
import contextlib
import importlib.metadata
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

import gpuagent.engine
from gpuagent.engine.engine import (
    LLMEngine,
    RequestOutput,
    TokenLogprob,
)
from gpuagent.engine.server import TextOffsets, TokenBytes
from tests.gpuagent.serving import metric, serve, sse_events, wait_until_idle

MODEL = "tiny"
DEMO_MODEL_DIR = Path(gpuagent.engine.__file__).parent / "demo_model"


@contextlib.contextmanager
def serve_tiny(tiny_model_and_tokenizer, num_blocks: int):
    """(base URL, LLMEngine, AsyncLLMEngine) of a live server over the tiny model,
    with `num_blocks` KV blocks of 8 tokens."""
    model, tokenizer = tiny_model_and_tokenizer
    engine = LLMEngine(
        model,
        tokenizer,
        num_blocks=num_blocks,
        block_size=8,
        max_num_seqs=64,
        max_model_len=128,
    )
    with serve(engine) as (base_url, async_engine):
        yield base_url, engine, async_engine


@pytest.fixture(scope="module")
def served_async(tiny_model_and_tokenizer):
    """(base URL, LLMEngine, AsyncLLMEngine) of a live server."""
    with serve_tiny(tiny_model_and_tokenizer, num_blocks=256) as served:
        yield served


@pytest.fixture(scope="module")
def served_tight(tiny_model_and_tokenizer):
    """A live server (as `served_async`) whose KV pool holds only 24 blocks of 8
    tokens: a few 54-token requests fill it."""
    with serve_tiny(tiny_model_and_tokenizer, num_blocks=24) as served:
        yield served


@pytest.fixture(scope="module")
def served_demo():
    """(base URL, LLMEngine) of a live server over the byte-level demo model, which
    answers Korean in Korean."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    engine = LLMEngine(
        load_model(DEMO_MODEL_DIR),
        load_tokenizer(DEMO_MODEL_DIR),
        num_blocks=64,
        block_size=16,
    )
    with serve(engine, "demo") as (base_url, _):
        yield base_url, engine


@pytest.fixture
def served(served_async):
    """(base URL, LLMEngine) of the live server."""
    return served_async[:2]


def aborted_requests(engine) -> float:
    """Requests the engine finished as aborted so far."""
    count = engine.metrics.registry.get_sample_value(
        "engine_requests_finished_total", {"finish_reason": "abort"}
    )
    return count or 0.0


def slow_down_steps(engine, monkeypatch) -> None:
    """Make each engine step take 20 ms longer: 100 tokens then take ~2 s."""
    real_forward = engine._forward

    def slow_forward(chunks):
        time.sleep(0.02)
        return real_forward(chunks)

    monkeypatch.setattr(engine, "_forward", slow_forward)


def test_it_answers_a_completion(served):
    base_url, _ = served

    resp = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": "hello",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
        },
        timeout=30,
    )

    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens"] == 6  # BOS + 5 bytes
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 5
    # One entry per distinct token: byte tokens >= 0x80 used to share the key U+FFFD.
    assert [len(top) for top in logprobs["top_logprobs"]] == [2] * 5


def token_bytes(token: str) -> bytes:
    """The bytes a logprobs `token` stands for (`bytes:\\xNN...` or its text)."""
    if token.startswith("bytes:"):
        return bytes.fromhex(token.removeprefix("bytes:").replace("\\x", ""))
    return token.encode()


def expected_offsets(text: str, pieces: list[bytes]) -> list[int]:
    """Where in `text` the character holding each piece's first byte starts, found
    from the bytes alone: `text` has no U+FFFD but maybe a last one (cut off)."""
    data = b"".join(pieces)
    assert data.decode("utf-8", "replace") == text
    assert "\ufffd" not in text[:-1]
    char_of_byte = []
    for index, char in enumerate(text.removesuffix("\ufffd")):
        char_of_byte += [index] * len(char.encode())
    char_of_byte += [len(text) - 1] * (len(data) - len(char_of_byte))
    offsets, pos = [], 0
    for piece in pieces:
        offsets.append(char_of_byte[pos] if pos < len(data) else len(text))
        pos += len(piece)
    return offsets


def test_it_keeps_each_byte_tokens_identity_in_completion_logprobs(served_demo):
    base_url, _ = served_demo
    payload = {
        "model": "demo",
        "prompt": "안녕하세요",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 3,
    }

    plain = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=60)
    with httpx.stream(
        "POST",
        f"{base_url}/v1/completions",
        json={**payload, "stream": True},
        timeout=60,
    ) as resp:
        chunks = [e["choices"][0] for e in sse_events(resp.iter_lines()) if e]

    assert plain.status_code == 200, plain.text
    choice = plain.json()["choices"][0]
    text, logprobs = choice["text"], choice["logprobs"]
    tokens, top = logprobs["tokens"], logprobs["top_logprobs"]
    assert len(tokens) == 12
    assert any(len(c.encode()) > 1 for c in text), f"no Korean in {text!r}"
    assert any(t.startswith("bytes:\\x") for t in tokens)
    # Three distinct alternatives per position, the greedy choice the best of them.
    assert [len(alternatives) for alternatives in top] == [3] * 12
    for token, logprob, alternatives in zip(
        tokens, logprobs["token_logprobs"], top, strict=True
    ):
        assert alternatives[token] == logprob == max(alternatives.values())
        assert len({token_bytes(t) for t in alternatives}) == 3
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets)
    assert offsets == expected_offsets(text, [token_bytes(t) for t in tokens])
    # Streamed: the same tokens, alternatives and offsets, chunk by chunk.
    assert "".join(c["text"] for c in chunks) == text
    streamed = [c["logprobs"] for c in chunks]
    for key in ("tokens", "top_logprobs", "text_offset"):
        assert sum((lp[key] for lp in streamed), []) == logprobs[key]


def test_it_reports_the_real_bytes_of_each_chat_token(served_demo):
    base_url, _ = served_demo

    resp = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": "demo",
            "messages": [{"role": "user", "content": "안녕하세요"}],
            "max_tokens": 9,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
        timeout=60,
    )

    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert any(len(c.encode()) > 1 for c in content), f"no Korean in {content!r}"
    if choice["finish_reason"] == "stop":  # the eos token isn't part of the text
        assert entries.pop()["token"] == "<|eos|>"
    assert b"".join(bytes(e["bytes"]) for e in entries) == content.encode()
    for entry in entries:
        alternatives = entry["top_logprobs"]
        assert len({a["token"] for a in alternatives}) == 3
        assert len({bytes(a["bytes"]) for a in alternatives}) == 3
        assert entry["token"] in {a["token"] for a in alternatives}
        for item in [entry, *alternatives]:
            assert token_bytes(item["token"]) == bytes(item["bytes"])


def fake_output(tokenizer, ids: list[int], new: int) -> RequestOutput:
    """The engine's output after `ids`, the last `new` of them from this step."""
    return RequestOutput(
        request_id="r",
        prompt_token_ids=[1],
        token_ids=list(ids),
        text=tokenizer.decode(ids, skip_special_tokens=True),
        new_token_ids=ids[-new:],
        new_text="",
        new_logprobs=[TokenLogprob(i, 0.0) for i in ids[-new:]],
        finished=False,
        finish_reason=None,
    )


# 0xff is never UTF-8; 0xe3 before 0xe3 is a cut-off character; <|eos|> has no text.
OFFSET_IDS = [0xFF, *b"a", *"한".encode(), *b"b", 0xE3, *"あ".encode(), 257]
OFFSET_TEXT = "\ufffda한b\ufffdあ"
OFFSETS = [0, 1, 2, 2, 2, 3, 4, 5, 5, 5, 6]


def test_text_offsets_point_each_byte_at_the_character_it_belongs_to(
    tiny_model_and_tokenizer,
):
    _, tokenizer = tiny_model_and_tokenizer
    one_by_one, all_at_once = TextOffsets(tokenizer), TextOffsets(tokenizer)

    streamed = [
        one_by_one.feed(fake_output(tokenizer, OFFSET_IDS[:n], 1))
        for n in range(1, len(OFFSET_IDS) + 1)
    ]
    at_once = all_at_once.feed(fake_output(tokenizer, OFFSET_IDS, len(OFFSET_IDS)))

    assert tokenizer.decode(OFFSET_IDS, skip_special_tokens=True) == OFFSET_TEXT
    assert streamed == [[offset] for offset in OFFSETS]
    assert one_by_one.offsets == at_once == all_at_once.offsets == OFFSETS


def _tokenizer(inner, **config):
    from gpuagent.engine.tokenizer import Tokenizer

    return Tokenizer(inner, config)


def test_token_bytes_are_exact_for_the_byte_level_tokenizer(
    tiny_model_and_tokenizer,
):
    _, tokenizer = tiny_model_and_tokenizer
    token_bytes_of = TokenBytes(tokenizer)

    assert [token_bytes_of(i) for i in range(256)] == [bytes([i]) for i in range(256)]
    assert token_bytes_of(257) == b"<|eos|>"


def test_token_bytes_are_exact_for_a_gpt2_style_byte_level_bpe():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>"],
    )
    inner.train_from_iterator(
        ["안녕하세요 한국어 텍스트입니다", "hello 안녕"] * 10, trainer
    )
    text = "안녕하세요 hello 한국어!"
    ids = inner.encode(text).ids
    token_bytes_of = TokenBytes(_tokenizer(inner))

    pieces = [token_bytes_of(i) for i in ids]

    assert b"".join(pieces) == text.encode()
    assert any(len(p) > 1 and b"\xef\xbf\xbd" not in p for p in pieces)
    assert token_bytes_of(inner.token_to_id("<s>")) == b"<s>"


def test_token_bytes_are_exact_for_byte_fallback_tokens():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"a": 0, "b": 1, "ab": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    inner = HFTokenizer(models.BPE(vocab, [("a", "b")], byte_fallback=True))
    inner.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    ids = inner.encode("ab한a").ids
    token_bytes_of = TokenBytes(_tokenizer(inner))

    pieces = [token_bytes_of(i) for i in ids]

    assert pieces == [b"ab", *(bytes([b]) for b in "한".encode()), b"a"]


def test_token_bytes_of_other_tokenizers_are_their_decoded_text():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    inner = HFTokenizer(models.WordLevel({"hello": 0, "한국": 1, "<0x41>": 2}, "hello"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    token_bytes_of = TokenBytes(_tokenizer(inner))

    # No byte-fallback decoder: "<0x41>" is just text.
    assert [token_bytes_of(i) for i in (0, 1, 2)] == [
        b"hello",
        "한국".encode(),
        b"<0x41>",
    ]


def test_it_streams_a_completion_with_usage_last(served):
    base_url, _ = served
    payload = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    plain_payload = {**payload, "stream": False}
    del plain_payload["stream_options"]  # OpenAI takes them only with stream=true
    plain = httpx.post(
        f"{base_url}/v1/completions", json=plain_payload, timeout=30
    ).json()

    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=payload, timeout=30
    ) as resp:
        events = list(sse_events(resp.iter_lines()))

    assert events[-1] is None
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 7
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == plain["choices"][0]["text"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def stream_concurrently(base_url: str, payloads: list[dict]) -> list[tuple]:
    """Stream each completion payload from its own client, all at once: per request
    (last finish_reason, usage's completion_tokens, the [DONE] marker, text)."""

    async def one(client, payload):
        async with client.stream("POST", "/v1/completions", json=payload) as resp:
            assert resp.status_code == 200
            events = [e async for e in _aiter_events(resp)]
        finish = [e["choices"][0]["finish_reason"] for e in events[:-2]]
        text = "".join(e["choices"][0]["text"] for e in events[:-2])
        return finish[-1], events[-2]["usage"]["completion_tokens"], events[-1], text

    async def main():
        limits = httpx.Limits(max_connections=len(payloads))
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(one(c, p) for p in payloads)), timeout=120
            )

    return asyncio.run(main())


def unstreamed(payload: dict) -> dict:
    """`payload` asking for one answer, not a stream (OpenAI takes stream_options
    only with stream=true)."""
    return {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}


def streamed_payload(i: int, max_tokens: int, **sampling) -> dict:
    return {
        "model": MODEL,
        "prompt": f"request {i}: ",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


def test_it_serves_64_concurrent_streaming_clients_without_losing_one(served):
    base_url, engine = served
    payloads = [streamed_payload(i, 8, temperature=0.8, seed=i) for i in range(64)]

    results = stream_concurrently(base_url, payloads)

    assert [r[:3] for r in results] == [("length", 8, None)] * 64
    wait_until_idle(base_url)
    finished = engine.metrics.registry.get_sample_value(
        "engine_requests_finished_total", {"finish_reason": "length"}
    )
    assert finished >= 64
    assert engine.kv.blocks.num_used_blocks == 0


def test_it_serves_64_streams_through_a_kv_pool_that_holds_three(served_tight):
    # Each request needs 14 prompt + 40 generated tokens = 7 blocks of the 24, so
    # most wait and running ones are preempted (recomputed) when the pool runs out.
    base_url, engine, async_engine = served_tight
    preemptions_before = metric(base_url, "engine_preemptions_total")
    payloads = [streamed_payload(i, 40, temperature=0) for i in range(64)]

    results = stream_concurrently(base_url, payloads)
    preemptions = metric(base_url, "engine_preemptions_total") - preemptions_before
    wait_until_idle(base_url)
    alone = [  # one at a time, nothing preempted
        httpx.post(
            f"{base_url}/v1/completions",
            json=unstreamed(payloads[i]),
            timeout=60,
        ).json()["choices"][0]["text"]
        for i in range(8)
    ]

    assert [r[:3] for r in results] == [("length", 40, None)] * 64
    assert preemptions > 0
    assert async_engine.step_errors == 0
    assert engine.kv.blocks.num_used_blocks == 0
    assert metric(base_url, "engine_kv_blocks_free") == 24
    assert [r[3] for r in results[:8]] == alone


async def _aiter_events(resp):
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield None if payload == "[DONE]" else json.loads(payload)


def test_it_frees_the_blocks_of_a_client_that_disconnects_mid_stream(
    served, monkeypatch
):
    base_url, engine = served
    wait_until_idle(base_url)
    # Unslowed, the tiny model can finish all 100 tokens before a client on a loaded
    # machine reads its third event, and the request would end on its own.
    slow_down_steps(engine, monkeypatch)
    aborted_before = aborted_requests(engine)
    payload = {
        "model": MODEL,
        "prompt": "long story",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=payload, timeout=30
    ) as resp:
        for seen, _event in enumerate(sse_events(resp.iter_lines()), start=1):
            if seen == 3:
                assert metric(base_url, "engine_kv_blocks_used") > 0
                break  # leaving the block closes the connection

    wait_until_idle(base_url)
    aborted = aborted_requests(engine)
    assert aborted == aborted_before + 1


def test_it_aborts_a_non_streamed_request_whose_client_gave_up(served, monkeypatch):
    base_url, engine = served
    wait_until_idle(base_url)
    slow_down_steps(engine, monkeypatch)
    before = aborted_requests(engine)
    payload = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 100,
        "temperature": 0,
        "ignore_eos": True,
    }

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=payload, timeout=0.3)

    wait_until_idle(base_url)
    after = aborted_requests(engine)
    assert after == before + 1


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"model": MODEL, "prompt": "hi", "max_tokens": -1},
            "max_tokens",
            "invalid_value",
        ),
        ({"model": MODEL, "prompt": "x" * 500}, "prompt", "context_length_exceeded"),
        (
            {"model": MODEL, "prompt": "x" * 100, "max_tokens": 50},
            "prompt",
            "context_length_exceeded",
        ),
        ({"model": MODEL}, "prompt", "invalid_value"),
        (
            {"model": MODEL, "prompt": "hi", "temperature": -2},
            "temperature",
            "invalid_value",
        ),
        ({"model": MODEL, "prompt": [99999]}, "prompt", None),
        # OpenAI's types are strict: a string or a bool is not a number.
        (
            {"model": MODEL, "prompt": "hi", "max_tokens": "5"},
            "max_tokens",
            "invalid_value",
        ),
        (
            {"model": MODEL, "prompt": "hi", "max_tokens": True},
            "max_tokens",
            "invalid_value",
        ),
        (
            {"model": MODEL, "prompt": "hi", "temperature": "0"},
            "temperature",
            "invalid_value",
        ),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "seed": 2**64}, "seed", "invalid_value"),
        (
            {"model": MODEL, "prompt": "hi", "stop": [f"s{i}" for i in range(1000)]},
            "stop",
            "invalid_value",
        ),
        ({"model": MODEL, "prompt": [[1]] * 2049}, "prompt", "invalid_value"),
    ],
)
def test_it_answers_bad_completions_with_openai_400s(served, body, param, code):
    base_url, _ = served

    resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)

    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"model": MODEL, "messages": chat("x" * 500)},
            "messages",
            "context_length_exceeded",
        ),
        # 107 prompt tokens fit the 128-token context, 107 + 50 don't.
        (
            {"model": MODEL, "messages": chat("x" * 100), "max_tokens": 50},
            "messages",
            "context_length_exceeded",
        ),
        (
            {"model": MODEL, "messages": chat("x" * 100), "max_completion_tokens": 50},
            "messages",
            "context_length_exceeded",
        ),
    ],
)
def test_it_answers_bad_chats_with_openai_400s_and_keeps_serving(
    served, body, param, code
):
    base_url, _ = served

    resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    after = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": chat("hi"), "max_tokens": 3},
        timeout=30,
    )

    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]
    assert after.status_code == 200, after.text
    assert after.json()["usage"]["completion_tokens"] >= 1
    wait_until_idle(base_url)


def test_it_answers_bodies_json_allows_but_python_chokes_on_with_400s(served):
    base_url, _ = served
    headers = {"content-type": "application/json"}
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    long_int = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    # A JSON escape may encode a lone surrogate, which no tokenizer can take.
    surrogate_prompt = b'{"prompt": "a\\ud800", "max_tokens": 2}'
    surrogate_chat = (
        b'{"max_tokens": 2, "messages": [{"role": "user", "content": "\\udc00"}]}'
    )

    answers = [
        httpx.post(f"{base_url}{path}", content=body, headers=headers, timeout=30)
        for path, body in [
            ("/v1/completions", deep),
            ("/v1/completions", long_int),
            ("/v1/completions", surrogate_prompt),
            ("/v1/chat/completions", surrogate_chat),
            ("/tokenize", b'{"prompt": "\\ud800"}'),
        ]
    ]

    assert [a.status_code for a in answers] == [400] * 5, [a.text for a in answers]
    errors = [a.json()["error"] for a in answers]
    assert [e["code"] for e in errors[:2]] == ["invalid_json"] * 2
    assert [e["param"] for e in errors[2:]] == ["prompt", "messages", "prompt"]
    assert all(e["type"] == "invalid_request_error" for e in errors)
    wait_until_idle(base_url)


def test_it_refuses_a_body_over_the_limit_before_reading_it_all(served, monkeypatch):
    import gpuagent.engine.openai_api as openai_api

    base_url, _ = served
    monkeypatch.setattr(openai_api, "MAX_BODY_BYTES", 10_000)
    big = {"model": MODEL, "prompt": "x" * 10_000, "max_tokens": 1}

    declared = httpx.post(f"{base_url}/v1/completions", json=big, timeout=30)
    chunked = httpx.post(  # no content-length: counted as it arrives
        f"{base_url}/v1/completions",
        content=iter([json.dumps(big).encode()]),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    small = httpx.post(
        f"{base_url}/v1/completions",
        json={**big, "prompt": "x"},
        timeout=30,
    )

    for resp in (declared, chunked):
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "request_too_large"
    assert small.status_code == 200


def test_it_answers_messages_the_chat_template_refuses_with_a_400(served, monkeypatch):
    base_url, engine = served
    # HF templates call raise_exception(...) for conversations they can't render.
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('no') }}"
    monkeypatch.setattr(engine.tokenizer, "chat_template", template + "{% endif %}")
    payload = {"model": MODEL, "max_tokens": 2}

    refused = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={**payload, "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    rendered = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={**payload, "messages": [{"role": "system", "content": "hi"}]},
        timeout=30,
    )

    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages"
    assert rendered.status_code == 200


def test_it_names_max_completion_tokens_when_that_is_the_bad_field(served):
    base_url, _ = served

    resp = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "max_completion_tokens": 0,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=30,
    )

    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_completion_tokens"


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-320}]
)
def test_it_serves_extreme_sampling_as_greedy_without_failing_the_batch(
    served_async, sampling
):
    # Both round to 0 in float32: logits / 0 and a nucleus of nothing are NaN draws.
    base_url, _, async_engine = served_async
    errors_before = async_engine.step_errors
    payload = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "ignore_eos": True}

    extreme = httpx.post(
        f"{base_url}/v1/completions",
        json={**payload, **sampling, "seed": 3},
        timeout=30,
    )
    greedy = httpx.post(
        f"{base_url}/v1/completions", json={**payload, "temperature": 0}, timeout=30
    )

    assert extreme.status_code == 200, extreme.text
    assert extreme.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert async_engine.step_errors == errors_before


def test_it_aborts_a_stream_whose_client_left_before_the_response_started(
    served_async, monkeypatch
):
    base_url, engine, async_engine = served_async
    wait_until_idle(base_url)
    slow_down_steps(engine, monkeypatch)
    aborted_before = aborted_requests(engine)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "gone",
            "max_tokens": 100,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    host, port = base_url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)  # and hang up at once, before any response byte

    wait_until_idle(base_url)
    aborted = aborted_requests(engine)
    assert aborted == aborted_before + 1
    assert async_engine.num_live_streams == 0


def test_it_rejects_malformed_json_and_keeps_serving(served):
    base_url, _ = served

    bad = httpx.post(
        f"{base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    not_object = httpx.post(f"{base_url}/v1/completions", json=[1, 2], timeout=30)
    no_messages = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": []},
        timeout=30,
    )
    good = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=30,
    )

    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert not_object.status_code == 400
    assert no_messages.status_code == 400
    assert no_messages.json()["error"]["param"] == "messages"
    assert good.status_code == 200
    assert good.json()["choices"][0]["message"]["role"] == "assistant"


def test_it_lists_the_model_tokenizes_and_reports_health(served):
    base_url, engine = served

    models = httpx.get(f"{base_url}/v1/models", timeout=10).json()
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "한"}, timeout=10)
    health = httpx.get(f"{base_url}/health", timeout=10)
    missing = httpx.get(f"{base_url}/v1/nothing", timeout=10)

    assert [m["id"] for m in models["data"]] == [MODEL]
    assert tokens.json()["tokens"] == [256, *"한".encode()]
    assert health.status_code == 200
    assert missing.status_code == 404 and "error" in missing.json()
    assert metric(base_url, "engine_kv_bytes_per_token") == engine.kv.bytes_per_token
    assert metric(base_url, "engine_kv_blocks_free") == engine.kv.num_blocks


def test_it_works_with_the_official_openai_client(served):
    base_url, _ = served
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=30)

    completion = client.completions.create(
        model=MODEL, prompt="def f(", max_tokens=6, temperature=0, seed=1
    )
    stream = client.completions.create(
        model=MODEL,
        prompt="def f(",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = list(stream)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "안녕"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    chat_stream = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "안녕"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    assert completion.choices[0].finish_reason in ("stop", "length")
    streamed_text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert streamed_text == completion.choices[0].text
    assert streamed[-1].usage.completion_tokens == completion.usage.completion_tokens
    assert chat.choices[0].message.content is not None
    content_logprobs = chat.choices[0].logprobs.content
    assert len(content_logprobs) == chat.usage.completion_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in content_logprobs)
    chat_text = "".join(
        c.choices[0].delta.content or "" for c in chat_stream if c.choices
    )
    assert chat_text == chat.choices[0].message.content
    assert chat_stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_it_builds_the_engine_the_cli_asks_for(tiny_model_dir):
    from gpuagent.engine.__main__ import build_engine, build_parser
    from gpuagent.engine.cache import num_blocks_for_budget

    args = build_parser().parse_args(
        [
            "serve",
            str(tiny_model_dir),
            "--kv-cache-dtype",
            "int8",
            "--kv-memory-gb",
            "0.001",
            "--block-size",
            "8",
            "--device",
            "cpu",
        ]
    )

    engine = build_engine(args)

    budget = int(0.001 * 2**30)
    assert engine.kv.kv_dtype == "int8"
    assert engine.kv.num_blocks == num_blocks_for_budget(
        engine.config, "int8", budget, 8
    )
    assert engine.kv.nbytes <= budget
    assert (args.host, args.port) == ("127.0.0.1", 8100)


def test_it_serves_only_verified_bytes_when_given_a_manifest_digest(
    tiny_model_dir, tmp_path
):
    import shutil

    from gpuagent.engine.__main__ import build_engine, build_parser
    from gpuagent.engine.sampling import SamplingParams
    from gpuagent.integrity import IntegrityError, hash_model

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    digest = hash_model(model_dir).digest
    argv = [
        "serve",
        str(model_dir),
        "--manifest-digest",
        digest,
        "--device",
        "cpu",
        "--kv-memory-gb",
        "0.001",
    ]

    engine = build_engine(build_parser().parse_args(argv))
    out = engine.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0]
    config = model_dir / "tokenizer_config.json"
    config.write_text(config.read_text().replace("<|eos|>", "<|pad|>"))

    assert len(out.token_ids) >= 1
    with pytest.raises(IntegrityError):
        build_engine(build_parser().parse_args(argv))


def test_it_builds_model_and_tokenizer_from_the_verified_bytes_only(
    tiny_model_dir, tmp_path
):
    import shutil

    from gpuagent.engine.engine import LLMEngine
    from gpuagent.integrity import hash_model, read_verified_files

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    files = read_verified_files(model_dir, hash_model(model_dir).digest)
    expected = LLMEngine.from_model_dir(model_dir, num_blocks=4).encode_prompt("hi")
    # Swapped on disk after verification: nothing may be read from there again.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (model_dir / name).write_text("{not json")

    engine = LLMEngine.from_model_dir(model_dir, files=files, num_blocks=4)

    assert engine.encode_prompt("hi") == expected


def test_it_routes_to_module_level_functions_that_find_the_server_on_the_app(
    tiny_model_and_tokenizer,
):
    from fastapi.routing import APIRoute

    import gpuagent.engine.server as server_module

    model, tokenizer = tiny_model_and_tokenizer
    engines = [LLMEngine(model, tokenizer, num_blocks=8, block_size=8) for _ in "ab"]

    with (
        serve(engines[0], "first") as (one, _),
        serve(engines[1], "second") as (
            two,
            async_two,
        ),
    ):
        listed = [
            [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
            for url in (one, two)
        ]
        version = httpx.get(f"{one}/version", timeout=10).json()
    app = server_module.build_app(async_two, "x")
    endpoints = [r.endpoint for r in app.routes if isinstance(r, APIRoute)]

    assert listed == [["first"], ["second"]]
    assert version == {"version": importlib.metadata.version("releasegate")}
    assert len(endpoints) == 8
    for endpoint in endpoints:  # the same function for every app, not a closure
        assert getattr(server_module, endpoint.__name__) is endpoint


@pytest.mark.parametrize(
    ("template", "named"),
    [
        (  # nested loops: 10^10 iterations
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
            "{% endfor %}",
            "longer than 2 s",
        ),
        ("{{ 'x' * 4000000000 }}", "1024 MiB of memory"),  # about 4 GB at once
        (
            "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
            "33554432 characters",
        ),
    ],
)
def test_it_answers_a_chat_template_past_a_limit_with_a_400_and_keeps_serving(
    served, monkeypatch, template, named
):
    base_url, engine = served
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    good_template = engine.tokenizer.chat_template
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)

    started = time.monotonic()
    stopped = httpx.post(f"{base_url}/v1/chat/completions", json=chat, timeout=60)
    took_s = time.monotonic() - started
    tokenized = httpx.post(f"{base_url}/tokenize", json=chat, timeout=60)
    monkeypatch.setattr(engine.tokenizer, "chat_template", good_template)
    after = httpx.post(
        f"{base_url}/v1/chat/completions", json={**chat, "max_tokens": 2}, timeout=60
    )

    assert stopped.status_code == 400, stopped.text
    error = stopped.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "chat_template_limit")
    assert named in error["message"]
    assert took_s < 5
    assert tokenized.status_code == 400
    assert after.status_code == 200, after.text


def test_it_refuses_to_start_with_a_chat_template_that_fails_its_probe(
    tiny_model_and_tokenizer,
):
    from gpuagent.engine.engine import AsyncLLMEngine
    from gpuagent.engine.server import build_app
    from gpuagent.engine.tokenizer import Tokenizer
    from gpuagent.engine.untrusted import ProbeError

    model, tokenizer = tiny_model_and_tokenizer
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    config = {**tokenizer.config, "chat_template": endless + "{% endfor %}"}
    engine = LLMEngine(model, Tokenizer(tokenizer.inner, config), num_blocks=8)

    with pytest.raises(ProbeError) as refused:
        build_app(AsyncLLMEngine(engine), MODEL)

    assert "chat template failed its probe" in str(refused.value)
    assert "longer than 2 s" in str(refused.value)


def test_it_answers_a_prompt_the_tokenizer_panics_on_with_a_400_and_keeps_serving(
    tiny_model_and_tokenizer,
):
    from gpuagent.engine.tokenizer import Tokenizer
    from tests.gpuagent.engine.test_tokenizer import backtracking_tokenizer

    model, tokenizer = tiny_model_and_tokenizer
    panicky = Tokenizer(backtracking_tokenizer(), tokenizer.config)
    engine = LLMEngine(model, panicky, num_blocks=16, block_size=8)
    hostile = "a" * 40 + "!"  # 41 characters

    with serve(engine) as (base_url, _):
        answers = [
            httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=60)
            for path, body in [
                ("/v1/completions", {"prompt": hostile, "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": chat(hostile)}),
                ("/tokenize", {"prompt": hostile}),
                ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
            ]
        ]
        health = httpx.get(f"{base_url}/health", timeout=10)

    for resp, param in zip(answers[:3], ["prompt", "messages", "prompt"], strict=True):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        assert "tokenizer failed" in resp.json()["error"]["message"]
    assert answers[3].status_code == 200, answers[3].text
    assert health.status_code == 200
