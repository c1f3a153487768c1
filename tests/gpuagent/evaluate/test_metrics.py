"""KL divergence, same-top-1, perplexity, the top-N KL estimate, bootstrap intervals
and continuation agreement, on hand-made distributions."""

import math

import numpy as np
import pytest
import torch

from gpuagent.evaluate.metrics import (
    Continuation,
    PositionStats,
    TopN,
    bootstrap_ci,
    full_kld,
    full_position_stats,
    perplexity,
    slice_quality,
    top_n_kld,
    top_n_position_stats,
    top_n_tail_kld,
    top_n_tail_mass,
)

P = [0.5, 0.25, 0.125, 0.125]
Q = [0.25, 0.5, 0.125, 0.125]
# KL(P || Q) by hand: 0.5 ln 2 + 0.25 ln(1/2) = 0.25 ln 2
KL_PQ = 0.25 * math.log(2)


def logs(probs) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_full_kld_is_the_textbook_sum():
    kld = full_kld(logs([P, P]), logs([Q, P]))

    assert kld.tolist() == pytest.approx([KL_PQ, 0.0], abs=1e-7)


def test_position_stats_take_top1_and_the_actual_tokens_logprob():
    stats = full_position_stats(logs([P, P]), logs([Q, P]), torch.tensor([1, 2]))

    assert stats.same_top1.tolist() == [False, True]  # Q's argmax is token 1
    assert stats.logprob_candidate.tolist() == pytest.approx(
        [math.log(0.5), math.log(0.125)]
    )
    assert stats.logprob_reference.tolist() == pytest.approx(
        [math.log(0.25), math.log(0.125)]
    )


def as_top_n(probs, token: int, n: int) -> TopN:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:n]
    return TopN(token, math.log(probs[token]), {i: math.log(probs[i]) for i in order})


def test_top_n_kld_is_exact_when_n_covers_the_support():
    assert top_n_kld(as_top_n(P, 2, 4), as_top_n(Q, 2, 4)) == pytest.approx(KL_PQ)
    assert top_n_kld(as_top_n(P, 0, 4), as_top_n(P, 0, 4)) == pytest.approx(0.0)


def test_top_n_kld_errs_low_by_what_the_rest_bucket_hides():
    # Top-2 of both: tokens {0, 1} are known on both sides, {2, 3} merge into the
    # rest bucket, where P and Q agree (0.25 each): nothing is hidden there, so the
    # estimate is exact; make them disagree inside the bucket and it stays below.
    p = [0.5, 0.25, 0.2, 0.05]
    q = [0.25, 0.5, 0.05, 0.2]
    exact = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))

    agree = top_n_kld(as_top_n(P, 0, 2), as_top_n(Q, 0, 2))
    hidden = top_n_kld(as_top_n(p, 0, 2), as_top_n(q, 0, 2))

    assert agree == pytest.approx(KL_PQ)
    assert 0 < hidden < exact
    assert hidden == pytest.approx(0.25 * math.log(2), abs=1e-9)


def test_the_tail_mass_is_what_the_top_n_left_out_and_bounds_the_error():
    # p's top-2 {0, 1} plus the actual token 0: the tail {2, 3} holds 0.25 of p;
    # the estimate misses exactly 0.25 x KL(p's tail shape || q's tail shape).
    p = [0.5, 0.25, 0.2, 0.05]
    q = [0.25, 0.5, 0.05, 0.2]
    exact = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    tail_p, tail_q = [0.8, 0.2], [0.2, 0.8]
    hidden = sum(a * math.log(a / b) for a, b in zip(tail_p, tail_q, strict=True))

    ref, cand = as_top_n(p, 0, 2), as_top_n(q, 0, 2)

    assert top_n_tail_mass(ref) == pytest.approx(0.25)
    assert exact - top_n_kld(ref, cand) == pytest.approx(0.25 * hidden)
    assert top_n_tail_mass(as_top_n(p, 3, 2)) == pytest.approx(0.2)  # actual listed
    assert top_n_tail_mass(as_top_n(p, 0, 4)) == pytest.approx(0.0, abs=1e-12)


def test_the_tail_term_recovers_what_the_bucket_hides_under_logit_noise():
    # A 4000-token vocabulary with a long tail, the candidate's logits the
    # reference's plus noise (what quantization does): the bucketed KL misses the
    # tail's share; with the tail term the mean comes within a few percent.
    gen = torch.Generator().manual_seed(0)
    vocab, n, positions = 4000, 20, 40
    exact, lower, estimate = [], [], []
    for _ in range(positions):
        # Zipf 1.5: the top-20 leave 16% of the mass in the tail
        logits = -1.5 * torch.log(torch.arange(1, vocab + 1.0))
        logits = logits[torch.randperm(vocab, generator=gen)]
        noisy = logits + 0.15 * torch.randn(vocab, generator=gen)
        p, q = torch.log_softmax(logits, -1), torch.log_softmax(noisy, -1)
        token = int(torch.multinomial(p.exp(), 1, generator=gen))
        ref, cand = top_n_of(p, token, n), top_n_of(q, token, n)
        exact.append(float(full_kld(p[None], q[None])))
        lower.append(top_n_kld(ref, cand))
        estimate.append(lower[-1] + top_n_tail_kld(ref, cand))
    exact_mean = np.mean(exact)

    assert np.mean(lower) < 0.85 * exact_mean  # the bucket hides a real share
    assert np.mean(estimate) == pytest.approx(exact_mean, rel=0.05)


def top_n_of(logprobs: torch.Tensor, token: int, n: int) -> TopN:
    top = torch.topk(logprobs, n)
    alternatives = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TopN(token, logprobs[token].item(), alternatives)


def test_the_tail_term_is_zero_without_two_shared_tokens_or_a_tail():
    ref = TopN(0, math.log(0.5), {0: math.log(0.5), 1: math.log(0.3)})
    disjoint = TopN(0, math.log(0.4), {0: math.log(0.4), 2: math.log(0.3)})

    assert top_n_tail_kld(ref, disjoint) == 0.0  # one shared token
    assert top_n_tail_kld(as_top_n(P, 0, 4), as_top_n(Q, 0, 4)) == pytest.approx(0.0)


def test_slice_quality_reports_the_tail_mass_of_top_n_positions_only():
    refs = [as_top_n([0.5, 0.25, 0.2, 0.05], 0, 2), as_top_n(P, 0, 4)]
    cands = [as_top_n([0.25, 0.5, 0.05, 0.2], 0, 2), as_top_n(Q, 0, 4)]
    top_n = top_n_position_stats(refs, cands)
    exact = full_position_stats(logs([P]), logs([Q]), torch.tensor([0]))
    rng = np.random.default_rng(0)

    served = slice_quality("english", [top_n], [], rng)
    mixed = slice_quality("english", [top_n, exact], [], rng)

    assert served.tail_mass_mean == pytest.approx(0.125)
    assert served.tail_mass_max == pytest.approx(0.25)
    assert mixed.tail_mass_mean is None and mixed.tail_mass_max is None
    assert served.mean_kld_lower <= served.mean_kld
    assert mixed.mean_kld_lower is None


def test_top_n_kld_caps_a_token_the_candidate_did_not_list():
    # The reference's top token is outside the candidate's top-1: the candidate's
    # probability of it is at most its own top-1's, and an even share of what it
    # left unlisted.
    ref = TopN(0, math.log(0.7), {0: math.log(0.7)})
    cand = TopN(0, math.log(0.1), {1: math.log(0.6)})

    kld = top_n_kld(ref, cand)

    # the actual token is known on both sides: 0.7 ln(0.7/0.1) + rest 0.3 ln(0.3/0.9)
    expected = 0.7 * math.log(7) + 0.3 * math.log(0.3 / 0.9)
    assert kld == pytest.approx(expected)
    assert TopN(0, -1.0, {}).top1() == 0 and cand.top1() == 1


def test_perplexity_is_exp_of_the_mean_nll():
    assert perplexity(np.log([0.5, 0.25])) == pytest.approx(math.sqrt(8))


def test_bootstrap_interval_is_seeded_and_brackets_the_mean():
    values = np.random.default_rng(1).normal(0.2, 0.05, 400)

    first = bootstrap_ci(values, [0, 200], np.random.default_rng(7))
    again = bootstrap_ci(values, [0, 200], np.random.default_rng(7))
    other = bootstrap_ci(values, [0, 200], np.random.default_rng(8))

    assert first == again
    assert first != other
    assert first.low < values.mean() < first.high
    assert first.high - first.low < 0.03
    assert bootstrap_ci(values[:10], [0], np.random.default_rng(7)) is None


def test_a_flip_is_a_change_in_correctness_not_in_wording():
    same = Continuation("Paris", " Paris, of course", " Paris, of course")
    reworded = Continuation("Paris", " Paris!", " paris, france")
    flipped = Continuation("Paris", " Lyon", " Paris")
    by_ids = Continuation("x", "a", "a", [1, 2], [1, 3])

    assert same.exact_match and not same.flipped
    assert not reworded.exact_match and not reworded.flipped
    assert flipped.flipped
    assert not by_ids.exact_match  # same text, other tokens


def test_slice_quality_summarizes_positions_and_continuations():
    stats = [
        PositionStats(
            np.array([0.0, 0.1, 0.2, 0.3]),
            np.array([True, True, False, True]),
            np.log([0.5, 0.5, 0.5, 0.5]),
            np.log([0.25, 0.25, 0.25, 0.25]),
        )
    ]
    continuations = [
        Continuation("a", "a", "a"),
        Continuation("a", "b", "a"),
    ]

    quality = slice_quality("english", stats, continuations, np.random.default_rng(0))

    assert quality.num_tokens == 4
    assert quality.mean_kld == pytest.approx(0.15)
    assert quality.max_kld == pytest.approx(0.3)
    assert quality.same_top1 == 0.75
    assert quality.ppl_candidate == pytest.approx(2.0)
    assert quality.ppl_ratio == pytest.approx(0.5)
    assert (quality.exact_match, quality.flips) == (0.5, 1)
    with pytest.raises(ValueError, match="no scored positions"):
        slice_quality("code", [], [], np.random.default_rng(0))
