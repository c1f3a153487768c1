"""Request fields beyond the basics, on a live server: each is implemented or refused
with a 400 naming it (unknown and unsupported fields, OpenAI's bookkeeping fields
user, metadata, store and service_tier, penalties, logit_bias,
min_tokens, n, echo with prompt logprobs, chat roles, unknown model, default
max_tokens, max_model_len, chat logprobs without the stop token)."""

import json
import logging

import httpx
import openai
import pytest
import torch

from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.tokenizer import SPECIAL_TOKENS
from tests.gpuagent.serving import MODEL, serve, sse_events, wait_until_idle


@pytest.fixture(scope="module")
def served_fp32(tiny_model_and_tokenizer):
    """(base URL, LLMEngine) over the tiny model with an fp32 KV cache (exact
    logprobs), answers at most 6 tokens without max_tokens, 8 blocks of 8 tokens."""
    model, tokenizer = tiny_model_and_tokenizer
    engine = LLMEngine(
        model,
        tokenizer,
        kv_cache_dtype="fp32",
        num_blocks=24,
        block_size=8,
        max_num_seqs=16,
        max_model_len=128,
    )
    with serve(engine, default_max_tokens=6) as (base_url, _):
        yield base_url, engine


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def complete(base_url: str, **body) -> dict:
    resp = post(base_url, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream_events(base_url: str, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed request ([DONE] left out)."""
    with httpx.stream(
        "POST",
        f"{base_url}{path}",
        json={"model": MODEL, **body, "stream": True},
        timeout=60,
    ) as resp:
        return [e for e in sse_events(resp.iter_lines()) if e]


def token_id(text: str) -> int:
    """The byte-level tokenizer's id of a logprobs token text."""
    if text.startswith("bytes:"):
        return int(text[len("bytes:\\x") :], 16)
    if text.startswith("<|"):
        return 256 + SPECIAL_TOKENS.index(text)
    (byte,) = text.encode()
    return byte


def greedy_ids(base_url: str, prompt, n: int, **extra) -> list[int]:
    """The greedy answer's token ids."""
    out = complete(
        base_url,
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        ignore_eos=True,
        logprobs=1,
        **extra,
    )
    return [token_id(t) for t in out["choices"][0]["logprobs"]["tokens"]]


# ------------------------------------------------------------------ refused fields


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "guided_json": {}}, "guided_json"),
        (
            "/v1/completions",
            {"prompt": "hi", "use_beam_search": True},
            "use_beam_search",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"x": 1}},
            "stream_options.x",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
            "messages.0.name",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "echo": True},
            "echo",
        ),
    ],
)
def test_it_answers_unknown_fields_with_a_400_naming_them(
    served_fp32, path, body, param
):
    base_url, _ = served_fp32

    resp = post(base_url, path, body)

    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["code"]) == (param, "unsupported_field")
    assert param.rsplit(".", 1)[-1] in error["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
        ("suffix", "end"),
        ("best_of", 3),
        ("prediction", {"type": "content", "content": "x"}),
    ],
)
def test_it_refuses_openai_fields_it_does_not_implement(served_fp32, field, value):
    base_url, _ = served_fp32

    refused = post(
        base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: value}
    )
    as_null = post(
        base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: None}
    )

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["param"], error["code"]) == (field, "unsupported_field")
    assert as_null.status_code == 200, as_null.text  # null asks for nothing


BOOKKEEPING = {
    "user": "user-42",
    "store": False,
    "metadata": {"team": "search", "ticket": "T-7"},
    "service_tier": "auto",
}
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
}


def test_it_takes_openai_bookkeeping_fields_and_records_them(served_fp32, caplog):
    base_url, _ = served_fp32
    caplog.set_level(logging.INFO, logger="gpuagent.engine.server")
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=30)

    answers = {
        path: post(base_url, path, {**body, **BOOKKEEPING})
        for path, body in BODIES.items()
    }
    events = stream_events(
        base_url,
        "/v1/chat/completions",
        {**BODIES["/v1/chat/completions"], **BOOKKEEPING},
    )
    by_client = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        user="user-42",
        store=False,
        metadata={"team": "search"},
        service_tier="default",
    )

    for path, resp in answers.items():
        assert resp.status_code == 200, (path, resp.text)
        assert resp.json()["metadata"] == BOOKKEEPING["metadata"]
        assert resp.json()["service_tier"] == "default"  # the tier that served it
    assert {e["service_tier"] for e in events} == {"default"}
    assert by_client.metadata == {"team": "search"}
    logged = [r.getMessage() for r in caplog.records if "user-42" in r.getMessage()]
    assert len(logged) == 4
    metadata = json.dumps(BOOKKEEPING["metadata"], sort_keys=True)
    assert sum(metadata in line for line in logged) == 3


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("store", True, "store"),
        ("service_tier", "flex", "flex"),
        ("metadata", {f"k{i}": "v" for i in range(17)}, "16"),
        ("metadata", {"k" * 65: "v"}, "64"),
        ("metadata", {"k": "v" * 513}, "512"),
        ("metadata", {"k": 1}, "metadata"),
        ("user", "u" * 513, "512"),
    ],
)
def test_it_refuses_bookkeeping_values_it_cannot_honour(
    served_fp32, path, field, value, named
):
    base_url, _ = served_fp32

    refused = post(base_url, path, {**BODIES[path], field: value})
    as_null = post(base_url, path, {**BODIES[path], field: None})

    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"].split(".")[0] == field
    assert named in error["message"]
    assert as_null.status_code == 200, as_null.text


def test_it_takes_best_of_equal_to_n(served_fp32):
    base_url, _ = served_fp32

    out = complete(base_url, prompt="hi", max_tokens=1, n=2, best_of=2, seed=1)

    assert len(out["choices"]) == 2


def test_it_refuses_stream_options_and_top_logprobs_that_would_do_nothing(
    served_fp32,
):
    base_url, _ = served_fp32
    chat = [{"role": "user", "content": "hi"}]

    options = post(
        base_url,
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
    )
    top = post(base_url, "/v1/chat/completions", {"messages": chat, "top_logprobs": 2})

    assert options.status_code == 400 and "stream" in options.json()["error"]["message"]
    assert top.status_code == 400 and "logprobs" in top.json()["error"]["message"]


# ------------------------------------------------------------- sampling fields


def test_logit_bias_forces_and_forbids_tokens(served_fp32):
    base_url, _ = served_fp32
    plain = greedy_ids(base_url, "abc", 4)

    forced = greedy_ids(base_url, "abc", 4, logit_bias={str(ord("z")): 100})
    forbidden = greedy_ids(base_url, "abc", 4, logit_bias={str(plain[0]): -100})
    out_of_range = post(
        base_url, "/v1/completions", {"prompt": "a", "logit_bias": {"99999": 5}}
    )
    not_an_id = post(
        base_url, "/v1/completions", {"prompt": "a", "logit_bias": {"x": 5}}
    )
    too_big = post(
        base_url, "/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}
    )

    assert forced == [ord("z")] * 4
    assert forbidden[0] != plain[0]
    for resp in (out_of_range, not_an_id, too_big):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "logit_bias"


def test_frequency_and_presence_penalties_stop_the_repeats_greedy_makes(
    served_fp32,
):
    base_url, _ = served_fp32
    plain = greedy_ids(base_url, "aaaa", 24)

    penalized = {
        name: greedy_ids(base_url, "aaaa", 24, **{name: 2.0})
        for name in ("frequency_penalty", "presence_penalty")
    }
    repetition = greedy_ids(base_url, "aaaa", 24, repetition_penalty=50.0)
    bad = post(base_url, "/v1/completions", {"prompt": "a", "presence_penalty": 3})

    # Random weights repeat a few tokens; a penalty of 2 nats per use spreads them.
    assert len(set(plain)) < len(set(penalized["frequency_penalty"]))
    assert len(set(plain)) < len(set(penalized["presence_penalty"]))
    assert ord("a") not in repetition  # in the prompt: divided by 50 if positive
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "presence_penalty"


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(served_fp32):
    base_url, _ = served_fp32
    first = greedy_ids(base_url, "hello", 1)[0]

    def finish(**extra) -> tuple[str, int]:
        out = complete(
            base_url,
            prompt="hello",
            max_tokens=8,
            temperature=0,
            stop_token_ids=[first],
            **extra,
        )
        return out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]

    stopped = finish()
    held = finish(min_tokens=5)
    too_many = post(
        base_url, "/v1/completions", {"prompt": "a", "max_tokens": 2, "min_tokens": 3}
    )

    assert stopped == ("stop", 1)
    assert held[1] >= 5
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "min_tokens"


def test_n_gives_n_seeded_choices_and_streams_each(served_fp32):
    base_url, _ = served_fp32
    body = {"prompt": "xy", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}

    first = complete(base_url, **body)
    again = complete(base_url, **body)
    two_prompts = complete(base_url, **{**body, "prompt": ["xy", "ab"]})
    chat_body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "n": 2,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    events = stream_events(base_url, "/v1/chat/completions", chat_body)
    too_many = post(base_url, "/v1/completions", {"prompt": "a", "n": 17})

    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1  # seed + j: the choices differ
    assert [c["index"] for c in two_prompts["choices"]] == list(range(6))
    assert [c["text"] for c in two_prompts["choices"][:3]] == texts
    assert first["usage"]["prompt_tokens"] == 3  # BOS + "xy", counted once
    content = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            content[choice["index"]] += choice["delta"].get("content", "")
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert all(content.values())
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


# ------------------------------------------------------------------------- echo


def test_echo_scores_the_prompt_as_the_model_does(served_fp32):
    base_url, engine = served_fp32
    prompt = "def add(a, b):"
    ids = engine.encode_prompt(prompt)

    out = complete(base_url, prompt=prompt, echo=True, max_tokens=0, logprobs=2)

    with torch.inference_mode():
        dense = torch.log_softmax(engine.model.forward_dense(torch.tensor([ids])), -1)
    expected = [dense[0, i - 1, ids[i]].item() for i in range(1, len(ids))]
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == prompt
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
        # prompt logprobs need every position computed: nothing from the cache
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert logprobs["tokens"] == ["<|bos|>", *prompt]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert logprobs["text_offset"] == [0, *range(len(prompt))]


def test_echo_of_prompt_and_answer_gives_the_answers_own_logprobs(served_fp32):
    base_url, _ = served_fp32
    answer = complete(
        base_url, prompt="abc", max_tokens=4, temperature=0, ignore_eos=True, logprobs=1
    )["choices"][0]
    answer_ids = [token_id(t) for t in answer["logprobs"]["tokens"]]

    # As lm-evaluation-harness asks: token ids, echo, max_tokens=1, logprobs=1.
    scored = complete(
        base_url,
        prompt=[256, *b"abc", *answer_ids],
        echo=True,
        max_tokens=1,
        logprobs=1,
        temperature=0,
    )["choices"][0]

    lps = scored["logprobs"]["token_logprobs"]
    assert len(lps) == 1 + 3 + 4 + 1  # prompt tokens, then the one generated
    assert lps[4:8] == pytest.approx(answer["logprobs"]["token_logprobs"], abs=1e-4)
    assert scored["text"].startswith("abc" + answer["text"])
    tops = scored["logprobs"]["top_logprobs"][4:8]
    for token_lp, top in zip(lps[4:8], tops, strict=True):
        assert token_lp == pytest.approx(max(top.values()), abs=1e-6)  # greedy


def test_echo_streams_the_prompt_first_and_keeps_offsets_past_it(served_fp32):
    base_url, _ = served_fp32
    body = {
        "prompt": "한글",
        "echo": True,
        "max_tokens": 3,
        "logprobs": 0,
        "temperature": 0,
        "ignore_eos": True,
    }
    plain = complete(base_url, **body)["choices"][0]

    events = stream_events(base_url, "/v1/completions", body)

    text = "".join(e["choices"][0]["text"] for e in events)
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert text == plain["text"]
    assert tokens == plain["logprobs"]["tokens"]
    assert offsets == plain["logprobs"]["text_offset"]
    # BOS, then three bytes per Hangul syllable, each pointing at its syllable.
    assert offsets[:7] == [0, 0, 0, 0, 1, 1, 1]
    assert events[0]["choices"][0]["text"].startswith("한글")


def test_max_tokens_0_is_only_for_echo(served_fp32):
    base_url, _ = served_fp32

    resp = post(base_url, "/v1/completions", {"prompt": "a", "max_tokens": 0})

    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_tokens"
    assert "echo" in resp.json()["error"]["message"]


# ------------------------------------------------------------------------- chat


def test_chat_takes_developer_and_tool_roles_and_null_assistant_content(
    served_fp32,
):
    base_url, _ = served_fp32

    def tokens(messages) -> list[int]:
        resp = post(base_url, "/tokenize", {"messages": messages})
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]

    as_system = tokens([{"role": "system", "content": "be brief"}])
    as_developer = tokens([{"role": "developer", "content": "be brief"}])
    conversation = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "sunny", "tool_call_id": "call-1"},
    ]
    answer = post(
        base_url, "/v1/chat/completions", {"messages": conversation, "max_tokens": 2}
    )
    rendered = bytes(t for t in tokens(conversation) if t < 256).decode()
    no_call_id = post(
        base_url,
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "content": "x"}]},
    )
    with_tool_calls = post(
        base_url,
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]},
    )

    assert as_developer == as_system  # the template knows no developer role
    assert answer.status_code == 200, answer.text
    assert "<|tool|>\nsunny" in rendered
    assert no_call_id.status_code == 400
    assert with_tool_calls.status_code == 400  # this template would drop them
    assert "tool_calls" in with_tool_calls.json()["error"]["message"]


def test_chat_logprobs_leave_out_the_stop_token_the_text_leaves_out(served_fp32):
    base_url, _ = served_fp32
    chat = [{"role": "user", "content": "hi"}]
    free = post(
        base_url,
        "/v1/chat/completions",
        {
            "messages": chat,
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
        },
    ).json()["choices"][0]
    third = free["logprobs"]["content"][2]["bytes"][0]
    body = {
        "messages": chat,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "stop_token_ids": [third],
    }

    stopped = post(base_url, "/v1/chat/completions", body).json()
    events = stream_events(base_url, "/v1/chat/completions", body)

    choice = stopped["choices"][0]
    content = choice["logprobs"]["content"]
    streamed = [
        lp
        for e in events
        if e["choices"][0]["logprobs"]
        for lp in e["choices"][0]["logprobs"]["content"]
    ]
    assert choice["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 3  # the stop token counts
    assert len(content) == 2
    assert (
        bytes(b for lp in content for b in lp["bytes"]).decode()
        == choice["message"]["content"]
    )
    assert streamed == content


# ------------------------------------------------------------ model and limits


def test_an_unknown_model_is_a_404_everywhere(served_fp32):
    base_url, _ = served_fp32
    chat = [{"role": "user", "content": "hi"}]

    answers = [
        httpx.post(
            f"{base_url}/v1/completions", json={"model": "gpt-9", "prompt": "hi"}
        ),
        httpx.post(
            f"{base_url}/v1/chat/completions", json={"model": "gpt-9", "messages": chat}
        ),
        httpx.post(f"{base_url}/tokenize", json={"model": "gpt-9", "prompt": "hi"}),
        httpx.get(f"{base_url}/v1/models/gpt-9"),
    ]

    for resp in answers:
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert "gpt-9" in error["message"]


def test_without_max_tokens_an_answer_stops_at_the_default(served_fp32):
    base_url, _ = served_fp32

    out = complete(base_url, prompt="hi", temperature=0, ignore_eos=True)
    near_the_end = complete(base_url, prompt="x" * 120, temperature=0, ignore_eos=True)

    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "length"
    # 121 prompt tokens of the 128-token context leave room for 6 (never past it)
    assert near_the_end["usage"]["completion_tokens"] == 6
    wait_until_idle(base_url)


def test_models_report_the_context_the_kv_pool_can_hold(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    # 8 blocks of 8 tokens hold 64 tokens, less than the model's 256 positions.
    engine = LLMEngine(model, tokenizer, num_blocks=8, block_size=8)

    with serve(engine, ["tiny", "alias"], model_root="/models/tiny") as (base_url, _):
        models = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"]
        by_alias = post(
            base_url, "/v1/completions", {"prompt": "a", "max_tokens": 1}
        ).json()
        alias = httpx.post(
            f"{base_url}/v1/completions",
            json={"model": "alias", "prompt": "a", "max_tokens": 1},
            timeout=30,
        )
        too_long = post(base_url, "/v1/completions", {"prompt": "x" * 64})

    assert [(m["id"], m["max_model_len"], m["root"]) for m in models] == [
        ("tiny", 64, "/models/tiny"),
        ("alias", 64, "/models/tiny"),
    ]
    assert alias.status_code == 200 and alias.json()["model"] == "tiny"
    assert by_alias["model"] == "tiny"
    assert too_long.status_code == 400
    assert "64" in too_long.json()["error"]["message"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served_fp32):
    base_url, _ = served_fp32
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }

    events = stream_events(base_url, "/v1/chat/completions", body)
    without_usage = post(
        base_url,
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"continuous_usage_stats": True}},
    )

    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4
    assert len({e["usage"]["prompt_tokens"] for e in events}) == 1
    assert without_usage.status_code == 400
