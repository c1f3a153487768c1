"""The prefix-cache bench on the demo model with small sizes: its chat sessions
carry their history and hit the cache as their shape implies, its text runs share
no block, and a whole run prints the like-for-like row first and exits with the
number of judged rows that fail."""

from __future__ import annotations

import pytest

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches import prefix_cache as bench
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def demo():
    return load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)


def test_it_carries_each_sessions_history_and_hits_the_cache_for_it(demo):
    model, tokenizer = demo
    engines = bench.make_engines(model, tokenizer, ["bf16"], max_model_len=2048)
    text = bench.TextSource(tokenizer)
    system = text.prompt(100)
    turns = [[text.tokens(20) for _ in range(3)] for _ in range(2)]

    off = bench.run_chat(engines["bf16-off"], system, turns, answer_tokens=5)
    on = bench.run_chat(engines["bf16"], system, turns, answer_tokens=5)

    assert on.answers == off.answers and len(on.answers) == 6
    assert off.cached_tokens == 0
    # turn t's prompt: the system prompt, then each earlier turn and its answer
    lengths = [len(system) + t * 25 + 20 for t in range(3)]
    assert on.prompt_tokens == off.prompt_tokens == 2 * sum(lengths)
    # Both first turns run in one step, so neither finds the other's blocks. Turn
    # t finds the full blocks that turn t - 1 computed: its prompt and all of its
    # answer but the last token (never fed back), short of its own last token.
    block = bench.BLOCK_SIZE
    cached = [
        min((lengths[t - 1] + 5 - 1) // block, (lengths[t] - 1) // block) * block
        for t in (1, 2)
    ]
    assert on.cached_tokens == 2 * sum(cached) > 0


def test_it_cuts_text_runs_that_share_no_block(demo):
    _, tokenizer = demo
    text = bench.TextSource(tokenizer)

    runs = [text.prompt(64) for _ in range(4)]

    first_blocks = {tuple(run[: bench.BLOCK_SIZE]) for run in runs}
    assert len(first_blocks) == len(runs)


def test_it_prints_the_like_for_like_row_first_and_exits_with_the_failures(capsys):
    failed = bench.main(["--prefix-tokens", "96", "--rounds", "1"])

    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.endswith(("PASS", "FAIL", "info"))
    ]
    assert rows[0].startswith("like for like: cold TTFT, cache off / on")
    assert any(line.startswith("chat prefix-cache hit rate") for line in rows)
    assert failed == sum(line.endswith("FAIL") for line in rows)
    assert f"{2 - failed}/2 targets pass" in out
