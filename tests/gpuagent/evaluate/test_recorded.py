"""A side recorded while its server ran and replayed after it stopped: the
replay answers what was asked, once, and refuses by name what was not."""

import pytest

from gpuagent.evaluate import Settings, evaluate_quality
from gpuagent.evaluate.metrics import TopN
from gpuagent.evaluate.recorded import Recording

TINY = Settings(
    slices=("english",), max_items=1, passage_tokens=12, continuation_tokens=2
)


class CountingSide:
    """A stand-in endpoint over a byte 'tokenizer' that counts its calls."""

    label = "counting"
    max_model_len = 64

    def __init__(self):
        self.calls = {"encode": 0, "top_n": 0, "greedy": 0}

    def encode(self, text):
        self.calls["encode"] += 1
        return list(text.encode())[:60]

    def count_tokens(self, text):
        return len(self.encode(text))

    def top_n(self, ids, n):
        self.calls["top_n"] += 1
        return [TopN(t, -0.5, {t: -0.5, -1: -1.5}) for t in ids[1:]]

    def greedy(self, ids, max_tokens):
        self.calls["greedy"] += 1
        return None, "ab"


def test_scoring_a_recording_against_itself_asks_each_question_once():
    side = CountingSide()
    recording = Recording(side)

    evaluate_quality(recording, recording, TINY)

    assert side.calls["top_n"] == 1 and side.calls["greedy"] == 1


def test_the_replay_gives_the_same_report_without_its_side():
    side = CountingSide()
    recording = Recording(side)
    evaluate_quality(recording, recording, TINY)
    before = dict(side.calls)

    replayed = evaluate_quality(CountingSide(), recording.replay(), TINY)
    live = evaluate_quality(CountingSide(), CountingSide(), TINY)

    assert side.calls == before  # the recorded side was not asked again
    assert replayed.slices == live.slices


def test_the_replay_refuses_what_it_was_not_asked():
    recording = Recording(CountingSide())
    recording.top_n([1, 2, 3], 20)
    replay = recording.replay()

    assert len(replay.top_n([1, 2, 3], 20)) == 2
    with pytest.raises(ValueError, match="did not score this 4-token sequence"):
        replay.top_n([1, 2, 3, 4], 20)
    with pytest.raises(ValueError, match="top-5"):
        replay.top_n([1, 2, 3], 5)
    with pytest.raises(ValueError, match="was not asked to encode"):
        replay.encode("never asked")
    with pytest.raises(ValueError, match="did not continue"):
        replay.greedy([1], 4)
