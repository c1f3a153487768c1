"""The request bodies on their own (no server): each checks its own ranges and
answers a bad value with an APIError naming the field."""

import pytest

from gpuagent.engine.openai_api import (
    MAX_N,
    MAX_PROMPTS_PER_REQUEST,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    validate_body,
)
from gpuagent.engine.sampling import MAX_LOGPROBS

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"prompt": "a", "n": 0}, "n"),
        (CompletionRequest, {"prompt": "a", "n": MAX_N + 1}, "n"),
        (CompletionRequest, {"prompt": "a", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "logprobs": -1}, "logprobs"),
        (CompletionRequest, {"prompt": "a", "max_tokens": -1}, "max_tokens"),
        (CompletionRequest, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {"prompt": []}, "prompt"),
        (
            CompletionRequest,
            {"prompt": ["a"] * (MAX_PROMPTS_PER_REQUEST // 2 + 1), "n": 2},
            "prompt",
        ),
        (
            ChatCompletionRequest,
            {"messages": CHAT, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
            "top_logprobs",
        ),
        (ChatCompletionRequest, {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
        (
            ChatCompletionRequest,
            {"messages": CHAT, "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        (ChatCompletionRequest, {"messages": CHAT, "n": MAX_N + 1}, "n"),
        (TokenizeRequest, {}, "prompt"),
        (TokenizeRequest, {"prompt": "a", "messages": CHAT}, "prompt"),
    ],
)
def test_it_checks_each_range_in_the_body_and_names_the_field(model, body, param):
    with pytest.raises(APIError) as refused:
        validate_body(body, model)

    assert refused.value.status == 400
    assert (refused.value.param, refused.value.code) == (param, "invalid_value")
    assert param.split("_")[0] in refused.value.message


def test_it_takes_the_edges_of_each_range():
    completion = validate_body(
        {
            "prompt": "a",
            "n": MAX_N,
            "logprobs": MAX_LOGPROBS,
            "echo": True,
            "max_tokens": 0,
        },
        CompletionRequest,
    )
    chat = validate_body(
        {
            "messages": CHAT,
            "logprobs": True,
            "top_logprobs": 0,
            "max_completion_tokens": 1,
            "max_tokens": 7,
        },
        ChatCompletionRequest,
    )

    assert completion.prompts == ["a"]
    assert completion.prompt_logprobs == MAX_LOGPROBS
    assert chat.answer_limit == 1  # max_completion_tokens wins
    assert chat.top_logprobs_asked == 0
