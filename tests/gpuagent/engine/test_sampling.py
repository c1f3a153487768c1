import pytest
import torch

from gpuagent.engine.sampling import (
    SamplingParams,
    adjust_logits,
    apply_top_k_top_p,
    find_stop_string,
    sample,
    stop_holdback,
)


def random_logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw_stream(logits_steps, params, position, batch_mates):
    """Tokens a seeded request draws over several steps while sitting at `position`
    in a batch with other (random, unseeded) requests."""
    generator = params.make_generator()
    tokens = []
    for step_logits in logits_steps:
        rows = [row.clone() for row in batch_mates]
        rows.insert(position, step_logits)
        all_params = [SamplingParams(temperature=1.0) for _ in batch_mates]
        all_params.insert(position, params)
        generators = [None] * len(batch_mates)
        generators.insert(position, generator)
        result = sample(torch.stack(rows), all_params, generators)
        tokens.append(result[position].token_id)
    return tokens


def test_it_picks_the_argmax_when_greedy():
    logits = random_logits(4)

    result = sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)

    assert [r.token_id for r in result] == logits.argmax(-1).tolist()


def test_it_gives_the_same_tokens_for_the_same_seed_whatever_the_batch():
    steps = list(random_logits(6, seed=3))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    mates = list(random_logits(3, seed=9))

    alone = draw_stream(steps, params, 0, [])
    batched = draw_stream(steps, params, 2, mates)
    other_seed = draw_stream(steps, SamplingParams(temperature=0.9, seed=43), 0, [])

    assert alone == batched
    assert alone != other_seed


def test_it_draws_according_to_the_softmax_at_temperature_one():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)

    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [params], [generator])[0].token_id] += 1

    assert torch.allclose(counts / 3000, logits[0].softmax(-1), atol=0.03)


def test_it_samples_only_within_the_top_k():
    logits = random_logits(1, vocab=30, seed=5)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3)
    generator = torch.Generator().manual_seed(0)

    drawn = {sample(logits, [params], [generator])[0].token_id for _ in range(200)}

    assert drawn <= allowed
    assert len(drawn) == 3


def test_it_keeps_the_smallest_nucleus_covering_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    kept = apply_top_k_top_p(logits, top_k=0, top_p=0.7).isfinite().tolist()

    assert kept == [True, True, False, False]


def test_it_keeps_the_top_token_even_for_a_tiny_top_p():
    logits = random_logits(1, seed=2)
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    generator = torch.Generator().manual_seed(0)

    result = sample(logits, [params], [generator])

    assert result[0].token_id == logits.argmax().item()


def test_it_reports_raw_logprobs_of_the_chosen_and_top_tokens():
    logits = random_logits(2, seed=7)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0),
    ]

    result = sample(logits, params, [None, None])

    expected = torch.log_softmax(logits, -1)
    chosen = result[0].token_id
    assert result[0].logprob == pytest.approx(expected[0, chosen].item(), abs=1e-6)
    top = result[0].top_logprobs
    assert [t for t, _ in top] == torch.topk(expected[0], 3).indices.tolist()
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert result[1].top_logprobs == []


def test_it_finds_the_earliest_stop_string_in_new_text():
    assert find_stop_string("hello world\n\nbye", ["\n\n", "bye"], 5) == 11
    assert find_stop_string("abc STOP", ["STOP"], 6) == 4  # spans old and new text
    assert find_stop_string("STOP then", ["STOP"], 8) is None  # already checked


def test_it_holds_back_text_that_may_begin_a_stop_string():
    assert stop_holdback("answer: 42\n", ["\n\n"]) == 1
    assert stop_holdback("answer: 42 EN", ["END"]) == 2
    assert stop_holdback("answer: 42", ["END", "\n\n"]) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("logprobs", 21),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("stop", [f"s{i}" for i in range(17)]),
    ],
)
def test_it_rejects_bad_parameters(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_it_accepts_a_single_stop_string():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_it_samples_a_tiny_temperature_as_argmax_instead_of_failing():
    # logits / 1e-45 overflows float32 to inf; softmax of inf is NaN.
    logits = random_logits(2)
    params = [SamplingParams(temperature=1e-45, seed=0), SamplingParams(temperature=0)]

    tokens = sample(logits, params, [params[0].make_generator(), None])

    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_it_accepts_every_64_bit_seed():
    for seed in (-(2**63), 2**64 - 1):
        assert SamplingParams(seed=seed).make_generator() is not None


def test_it_keeps_the_top_token_for_a_top_p_below_float32_range():
    logits = random_logits(1)[0]

    kept = apply_top_k_top_p(logits, 0, 1e-320)

    assert torch.isfinite(kept).nonzero().flatten().tolist() == [int(logits.argmax())]


def adjusted_row(params: SamplingParams, logits, prompt=(), output=(), stops=()):
    return adjust_logits(
        logits[None], [params], [list(prompt)], [list(output)], [stops]
    )[0]


def test_logit_bias_adds_to_the_biased_logits_only():
    logits = torch.zeros(6)

    out = adjusted_row(SamplingParams(logit_bias={2: 5.0, 4: -1.5}), logits)

    assert out.tolist() == [0, 0, 5.0, 0, -1.5, 0]
    assert logits.tolist() == [0] * 6  # the raw logits are left alone


def test_penalties_follow_openai_and_ctrl_definitions():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0, 0.5])
    output = [0, 0, 1, 2]  # token 0 twice, 1 and 2 once; 3 only in the prompt

    frequency = adjusted_row(SamplingParams(frequency_penalty=0.5), logits, [3], output)
    presence = adjusted_row(SamplingParams(presence_penalty=0.5), logits, [3], output)
    repetition = adjusted_row(
        SamplingParams(repetition_penalty=2.0), logits, [3], output
    )

    assert frequency.tolist() == [1.0, -2.5, 0.5, 1.0, 0.5]
    assert presence.tolist() == [1.5, -2.5, 0.5, 1.0, 0.5]
    # seen in prompt or output: positive halved, negative doubled; 4 unseen
    assert repetition.tolist() == [1.0, -4.0, 0.5, 0.5, 0.5]


def test_min_tokens_bans_stop_tokens_until_the_output_is_long_enough():
    logits = torch.zeros(5)
    params = SamplingParams(min_tokens=2, max_tokens=4)

    early = adjusted_row(params, logits, output=[1], stops={3, 4})
    later = adjusted_row(params, logits, output=[1, 2], stops={3, 4})

    assert early.tolist() == [0, 0, 0, float("-inf"), float("-inf")]
    assert later.tolist() == [0] * 5


def test_sample_picks_from_adjusted_logits_but_reports_raw_logprobs():
    logits = torch.tensor([[3.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.0, logit_bias={2: 10.0}, logprobs=1)]
    adjusted = adjust_logits(logits, params, [[]], [[]], [set()])

    (token,) = sample(logits, params, [None], adjusted)

    raw = torch.log_softmax(logits[0], -1)
    assert token.token_id == 2
    assert token.logprob == pytest.approx(raw[2].item())
    assert token.top_logprobs == [(0, pytest.approx(raw[0].item()))]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {1: 200.0}}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_it_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_max_tokens_0_is_valid_when_scoring_the_prompt():
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)

    assert params.max_tokens == 0
