"""lm-evaluation-harness, unchanged, scores a loglikelihood task against our server
(its `local-completions` model: echo=true, logprobs=1, max_tokens=1, token ids as
the prompt), and gets the model's own numbers. The task is a local file: nothing is
downloaded."""

import json
import math
from pathlib import Path

import pytest
import torch

import gpuagent.engine
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.engine.tokenizer import load_tokenizer
from tests.gpuagent.serving import serve

DEMO = Path(gpuagent.engine.__file__).parent / "demo_model"
DOCS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "def add(a, b):\n    return a", "continuation": " + b"},
    {"context": "대한민국의 수도는", "continuation": " 서울"},
]


def write_task(folder: Path) -> str:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCS))
    (folder / "tiny.yaml").write_text(
        "task: releasegate_tiny_loglikelihood\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        "metric_list:\n"
        "  - metric: perplexity\n"
        "    aggregation: perplexity\n"
        "    higher_is_better: false\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )
    return "releasegate_tiny_loglikelihood"


def own_loglikelihood(model, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of the continuation's token logprobs given the context, and whether each
    was the argmax (byte-level tokens, no BOS: as lm-eval tokenizes them)."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    ids = torch.tensor([ctx + cont])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model.forward_dense(ids), -1)[0]
    rows = range(len(ctx) - 1, len(ctx) + len(cont) - 1)
    total = sum(logprobs[r, t].item() for r, t in zip(rows, cont, strict=True))
    greedy = all(
        logprobs[r].argmax().item() == t for r, t in zip(rows, cont, strict=True)
    )
    return total, greedy


def test_lm_eval_scores_a_loglikelihood_task_against_our_server(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    task = write_task(tmp_path)
    model, tokenizer = load_model(DEMO), load_tokenizer(DEMO)
    engine = LLMEngine(model, tokenizer, kv_cache_dtype="fp32", num_blocks=32)
    served_name = str(
        DEMO
    )  # serve's default: the path, where lm-eval finds the tokenizer

    with serve(engine, served_name) as (base_url, _):
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": served_name,
                "base_url": f"{base_url}/v1/completions",
                "tokenizer_backend": "huggingface",
                "max_retries": 1,
            },
            tasks=[task],
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )

    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    expected = [own_loglikelihood(model, d["context"], d["continuation"]) for d in DOCS]
    got = [tuple(s["resps"][0][0]) for s in samples]
    assert len(got) == len(DOCS)
    for (ll, greedy), (want_ll, want_greedy) in zip(got, expected, strict=True):
        assert ll == pytest.approx(want_ll, abs=1e-3)
        assert bool(greedy) == want_greedy
    perplexity = results["results"][task]["perplexity,none"]
    assert perplexity == pytest.approx(
        math.exp(-sum(ll for ll, _ in expected) / len(expected)), rel=1e-3
    )
