"""Engine benchmark: `python -m gpuagent.benches.engine [--quick] [--model-dir DIR]`.

Prints ratios measured side by side in one run, each with its target and PASS/FAIL
where it has one ("info" where it is information only):

- memory: KV bytes/token of each dtype vs bf16, and how many concurrent 2k-token
  sequences the block pool admits in the same byte budget, counted by admitting
  requests through the scheduler (int4's full-precision window rows, one per
  `max_num_seqs` as the engine reserves them, come out of the same budget);
- throughput: aggregate output tokens/s of 16 concurrent requests vs the same 16 one
  after another, and vs `transformers` `generate` on the same model, prompts and
  lengths (batched 16 with left padding; one-at-a-time shown for information);
- KV quality: each KV dtype vs bf16 KV on the shipped eval sets (gpuagent/evaluate:
  English, code and Korean passages, scored in process, teacher-forced through the
  engine's paged cache, exact KL), per slice and overall, with its bytes/token vs
  bf16 (window row and static scales spread over a 2k-token sequence) and its
  target (int8 KLD <= 0.002 and top-1 >= 97.5%, fp8 <= 0.003 / >= 97%, int4
  <= 0.03 / >= 92%; overall judged, slices shown). Below it, for information,
  layouts measured but not served, simulated on the same passages against the same
  bf16 distributions (`kv_alternatives`): KIVI int4 (keys per channel in groups of
  32 tokens, values per token, bf16 residual), with and without the rotation, and
  the served int4 itself (the simulation's check) and at KIVI's bytes;
- attention output: a diagnostic, not a target (issue 12), on every model: its rows
  are information only and issue 3's old bar is printed beside them as text. Each
  layer's post-RoPE q, k and v of the first passage of each slice are captured, K/V
  written into a cache of each dtype with `kernels.write_kv`, and the decode
  attention of sampled positions t (context 0..t) run with
  `kernels.paged_decode_attention`; relative error ||o_q - o_bf16|| / ||o_bf16||,
  mean over layers, worst layer, and every layer;
- with `--long-kv` (and `--model-dir`): fp8, int8 and int4 vs bf16 KV on held-out
  passages of 2k+ tokens from outside the project, scored whole (`kv_long`),
  judged overall and at positions >= 512 (int4 KLD <= 0.01 and top-1 >= 96% at
  <= 0.28 of bf16's bytes counted at the measured length; fp8 and int8 their
  bars above).

The exit status is 0 when every judged row passes (memory, capacity, throughput and
serving ratios, each served dtype's overall KLD and top-1), else 1.

Every dtype runs as the engine serves it by default: int4 and fp8 with their
full-precision windows of the newest tokens (`engine.DEFAULT_KV_WINDOW`), the others
without. With `--model-dir`, the demo model's quality rows follow (`--no-demo`
skips them); `--quality-only` skips memory and throughput; `--quick` scores a small
slice (2 passages per slice, 160 tokens).

Runs on the demo model (gpuagent/engine/demo_model); without it, on a random model of
the same shape, with a loud note (quality numbers then mean little). On a CPU the
kernels' torch references run; on CUDA the Triton kernels.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuagent.benches import DEMO_MODEL_DIR, kv_long
from gpuagent.benches.kv_alternatives import (
    AMORTIZED_SEQ_TOKENS,
    Layout,
    layout_logprobs,
    measured_layouts,
)
from gpuagent.benches.kv_alternatives import amortized_bytes_ratio as cache_bytes_ratio
from gpuagent.engine.cache import kv_bytes_per_token, kv_window_bytes
from gpuagent.engine.engine import (
    DEFAULT_MAX_NUM_SEQS,
    LLMEngine,
    default_kv_window,
    engine_kv_cache,
    prepare_inputs,
)
from gpuagent.engine.kv_calibration import (
    calibration_sequences,
    set_cache_scales,
    static_kv_scales,
)
from gpuagent.engine.sampling import SamplingParams
from gpuagent.engine.scheduler import ScheduledChunk, Scheduler
from gpuagent.engine.scheduler import Sequence as Seq
from gpuagent.evaluate.evalsets import load_text_slices
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.metrics import PositionStats, slice_quality
from gpuagent.evaluate.regression import exact_position_stats
from gpuagent.protocol import SliceQuality
from kernels import STATIC_SCALE_DTYPES

KV_DTYPES = ("bf16", "fp16", "fp8-per-token", "fp8", "int8", "int4")
CAPACITY_SEQ_TOKENS = AMORTIZED_SEQ_TOKENS
# (mean KLD, same top-1) vs bf16 KV that each served layout must reach (issue 12);
# fp8-per-token is measured beside fp8 for comparison, not served by that name
QUALITY_TARGETS = {
    "fp8": (0.003, 0.97),
    "int8": (0.002, 0.975),
    "int4": (0.03, 0.92),
}
# Issue 3's old bar on the attention output error, printed for reference only: since
# issue 12 the attention-output error is a diagnostic, not a target (KLD/top-1 are)
ATTENTION_OLD_BAR = {"fp8": 0.01, "fp8-per-token": 0.01, "int8": 0.01, "int4": 0.05}
# KV bytes/token vs bf16, scales and the window spread over a 2k-token sequence
MEMORY_TARGETS = {"fp8-per-token": 0.52, "fp8": 0.52, "int8": 0.52, "int4": 0.28}
# The byte budget of the capacity test holds this many bf16 sequences; large enough
# that whole-sequence rounding doesn't hide a ratio (int8: 31 vs 16, not 15 vs 8).
CAPACITY_BF16_SEQS = 16

THROUGHPUT_PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "The history of the city begins",
    "In this chapter we describe how",
    "안녕하세요. 오늘은",
    "파일을 열 수 없습니다:",
    "Return the number of",
    "for i in range(10):\n",
    "He looked out of the window and",
    "# Parse the command line\nparser = ",
    "설정을 저장하시겠습니까?",
    "Once upon a time, there was",
    "def __repr__(self):\n        return",
    "The results show that",
    "if __name__ == '__main__':\n",
]


@dataclass
class Row:
    """One printed line: what, measured value, target, pass?"""

    name: str
    value: str
    target: str
    ok: bool | None  # None: information only

    def render(self) -> str:
        result = "info" if self.ok is None else ("PASS" if self.ok else "FAIL")
        return f"{self.name:<56} {self.value:>12}  {self.target:>10}  {result}"


# -------------------------------------------------------------------------- model


def random_demo_shaped_dir(path: Path) -> Path:
    """A random Llama folder shaped like the demo model (when it isn't there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpuagent.engine.tokenizer import save_byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=264,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=256,
        eos_token_id=257,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return path


# ------------------------------------------------------------------------- memory


def served(dtype: str) -> str:
    """A KV dtype's label as served by default: int4+w18 has an 18-token window."""
    window = default_kv_window(dtype)
    return f"{dtype}+w{window}" if window else dtype


def memory_rows(config) -> list[Row]:
    """KV bytes/token of each dtype vs bf16; a layout with a window is judged with
    its window row spread over a 2k-token sequence."""
    bf16 = kv_bytes_per_token(config, "bf16")
    rows = [Row("KV bytes/token, bf16 (all layers, K+V)", f"{bf16}", "", None)]
    for dtype in KV_DTYPES[1:]:
        per_token = kv_bytes_per_token(config, dtype)
        ratio = per_token / bf16
        window = default_kv_window(dtype)
        target = None if window else MEMORY_TARGETS.get(dtype)
        rows.append(
            Row(
                f"KV bytes/token {dtype} / bf16  ({per_token} B)",
                f"{ratio:.4f}",
                f"<= {target}" if target else "",
                ratio <= target if target else None,
            )
        )
        if window:
            target = MEMORY_TARGETS.get(dtype)
            window_bytes = kv_window_bytes(config, window)
            # Served with the window, a sequence also holds a row of it: per
            # token of a 2k-token sequence that adds window_bytes / 2048.
            amortized = per_token + window_bytes / CAPACITY_SEQ_TOKENS
            rows += [
                Row(
                    f"  {dtype} full-precision window, bytes/seq ({window} tokens)",
                    f"{window_bytes}",
                    "",
                    None,
                ),
                Row(
                    f"  {served(dtype)} / bf16, window spread over "
                    f"{CAPACITY_SEQ_TOKENS} tokens",
                    f"{amortized / bf16:.4f}",
                    f"<= {target}" if target else "",
                    amortized / bf16 <= target if target else None,
                ),
            ]
    return rows


def admitted_sequences(config, kv_dtype: str, budget_bytes: int) -> tuple[int, int]:
    """How many 2k-token requests the scheduler admits at once in `budget_bytes` of
    KV cache (the cache is really allocated, window rows included, as the engine
    sizes it by default); returns (admitted, cache bytes)."""
    kv = engine_kv_cache(config, kv_dtype, kv_memory_bytes=budget_bytes)
    assert kv.nbytes <= budget_bytes
    scheduler = Scheduler(
        kv.blocks, max_num_seqs=DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens=10**9
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = [i % 256 for i in range(CAPACITY_SEQ_TOKENS - 1)]  # + 1 generated
    capacity_guess = kv.blocks.capacity_tokens // CAPACITY_SEQ_TOKENS + 2
    for i in range(capacity_guess):
        scheduler.add(Seq(f"cap-{i}", list(prompt), params))
    scheduler.schedule()
    admitted = len(scheduler.running)
    # A count that memory did not set would be no measurement: refuse it (not an
    # assert, which python -O drops).
    if not scheduler.waiting:
        raise RuntimeError(f"{kv_dtype}: offered too few requests to find the limit")
    if admitted >= DEFAULT_MAX_NUM_SEQS:
        raise RuntimeError(f"{kv_dtype}: max_num_seqs, not memory, set the limit")
    return admitted, kv.nbytes


def capacity_rows(config) -> list[Row]:
    """Concurrent 2k-token sequences admitted in one budget, each dtype vs bf16."""
    budget = (
        CAPACITY_BF16_SEQS * CAPACITY_SEQ_TOKENS * kv_bytes_per_token(config, "bf16")
    )
    targets = {"fp8-per-token": 1.9, "fp8": 1.9, "int8": 1.9, "int4": 3.6}
    base, _ = admitted_sequences(config, "bf16", budget)
    rows = [
        Row(
            f"2k-token seqs admitted in {budget / 2**20:.0f} MiB, bf16",
            f"{base}",
            "",
            None,
        )
    ]
    for dtype in KV_DTYPES[1:]:
        admitted, _ = admitted_sequences(config, dtype, budget)
        ratio = admitted / base
        target = targets.get(dtype)
        rows.append(
            Row(
                f"2k-token seqs admitted {served(dtype)} / bf16  ({admitted})",
                f"{ratio:.3f}x",
                f">= {target}x" if target else "",
                ratio >= target if target else None,
            )
        )
    return rows


# --------------------------------------------------------------------- throughput


def time_engine(
    engine: LLMEngine,
    prompts: Sequence[str],
    max_tokens: int,
    concurrent: bool,
    repeats: int = 1,
) -> tuple[float, list[list[int]]]:
    """Best-of-`repeats` seconds to generate `max_tokens` for every prompt, together
    or one by one (best-of because other processes share the CPU)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        if concurrent:
            outs = engine.generate(prompts, params)
        else:
            outs = [engine.generate([p], params)[0] for p in prompts]
        _sync(engine.device)
        best = min(best, time.perf_counter() - start)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return best, [o.token_ids for o in outs]


def time_transformers(
    model_dir: Path,
    prompt_ids: Sequence[list[int]],
    max_tokens: int,
    pad_id: int,
    device: str,
    batched: bool,
    repeats: int = 1,
) -> float:
    """Best-of-`repeats` seconds for `transformers` generate (greedy, exactly
    `max_tokens` new tokens per prompt)."""
    model = _hf_model(model_dir, device)
    # EOS off, as `ignore_eos` on the engine side: every row runs to max_new_tokens
    # with no min-length logits processor or EOS check in transformers' loop.
    kwargs = dict(
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
    )

    def run(batch: Sequence[list[int]]) -> None:
        width = max(len(ids) for ids in batch)
        # Left padding so that every row's last prompt token is at the end.
        ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs
            )
        assert out.shape[1] == width + max_tokens

    run([prompt_ids[0]])  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        if batched:
            run(prompt_ids)
        else:
            for ids in prompt_ids:
                run([ids])
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


_HF_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def _hf_model(model_dir: Path, device: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    key = (str(model_dir), str(device))
    if key not in _HF_MODELS:
        import transformers

        # The folder's generation_config sets max_length; max_new_tokens wins, and
        # transformers says so on every call.
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _HF_MODELS[key] = model.to(device).eval()
    return _HF_MODELS[key]


def _sync(device: str | torch.device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def throughput_engine(model, tokenizer, num_seqs: int) -> LLMEngine:
    """The engine the throughput sections time: bf16 KV, room for `num_seqs`
    sequences of up to 128 tokens at once."""
    return LLMEngine(
        model,
        tokenizer,
        kv_cache_dtype="bf16",
        num_blocks=num_seqs * 8,
        block_size=16,
        max_num_seqs=num_seqs,
    )


def throughput_rows(
    model_dir: Path, model, tokenizer, device: str, max_tokens: int, repeats: int
) -> list[Row]:
    """Aggregate output tok/s: 16 concurrent vs 16 sequential vs transformers."""
    prompts = THROUGHPUT_PROMPTS
    engine = throughput_engine(model, tokenizer, len(prompts))
    total = len(prompts) * max_tokens
    time_engine(engine, prompts[:2], 4, concurrent=True)  # warm-up
    has_transformers = importlib.util.find_spec("transformers") is not None
    prompt_ids = [engine.encode_prompt(p) for p in prompts]
    pad_id = 258 if model.config.vocab_size > 258 else 0
    # The engine's concurrent runs and transformers' batched runs alternate (best of
    # `repeats` each), so that a change in the shared CPU's load hits both alike.
    concurrent_s = hf_batched_s = math.inf
    for _ in range(repeats):
        seconds, concurrent_ids = time_engine(engine, prompts, max_tokens, True)
        concurrent_s = min(concurrent_s, seconds)
        if has_transformers:
            seconds = time_transformers(
                model_dir, prompt_ids, max_tokens, pad_id, device, batched=True
            )
            hf_batched_s = min(hf_batched_s, seconds)
    sequential_s, sequential_ids = time_engine(
        engine, prompts, max_tokens, False, repeats
    )
    same = sum(a == b for a, b in zip(concurrent_ids, sequential_ids, strict=True))
    rows = [
        Row(
            f"engine tok/s, {len(prompts)} concurrent (bf16 KV, {max_tokens} tok)",
            f"{total / concurrent_s:.1f}",
            "",
            None,
        ),
        Row(
            "engine tok/s, same 16 one after another",
            f"{total / sequential_s:.1f}",
            "",
            None,
        ),
        Row(
            "concurrent / sequential tok/s",
            f"{sequential_s / concurrent_s:.2f}x",
            ">= 4x",
            sequential_s / concurrent_s >= 4,
        ),
        Row(
            "greedy tokens identical, concurrent vs sequential",
            f"{same}/{len(prompts)}",
            "",
            None,
        ),
    ]
    if not has_transformers:
        rows.append(Row("transformers generate", "missing", ">= 2x", False))
        return rows
    hf_sequential_s = time_transformers(
        model_dir, prompt_ids, max_tokens, pad_id, device, False, repeats
    )
    rows += [
        Row(
            "transformers generate tok/s, batch 16 (left-padded)",
            f"{total / hf_batched_s:.1f}",
            "",
            None,
        ),
        Row(
            "engine 16 concurrent / transformers batch 16",
            f"{hf_batched_s / concurrent_s:.2f}x",
            ">= 2x",
            hf_batched_s / concurrent_s >= 2,
        ),
        Row(
            "transformers generate tok/s, one request at a time",
            f"{total / hf_sequential_s:.1f}",
            "",
            None,
        ),
        Row(
            "engine 16 concurrent / transformers one at a time",
            f"{hf_sequential_s / concurrent_s:.2f}x",
            ">= 2x",
            hf_sequential_s / concurrent_s >= 2,
        ),
    ]
    return rows


def mixed_lengths(count: int, max_tokens: int) -> list[int]:
    """Output lengths of `count` requests: a quarter, half, three quarters and all
    of `max_tokens`, in turn (mixed, as concurrent serving sees them)."""
    return [max(1, max_tokens * (1 + i % 4) // 4) for i in range(count)]


def serving_rows(
    model_dir: Path, model, tokenizer, device: str, max_tokens: int, repeats: int
) -> list[Row]:
    """Useful output tok/s of the engine vs `transformers` generate on the same
    model, prompts, dtype and threads, runs interleaved (best of `repeats` each):
    one request alone, 16 concurrent ones of equal output lengths (one batch for
    transformers, no padding waste: the engine's batching against a plain batch),
    then 16 with mixed output lengths, which transformers runs as one left-padded
    batch to the longest (its extra tokens are not counted)."""
    prompts = THROUGHPUT_PROMPTS
    lengths = mixed_lengths(len(prompts), max_tokens)
    engine = throughput_engine(model, tokenizer, len(prompts))
    prompt_ids = [engine.encode_prompt(p) for p in prompts]
    pad_id = 258 if model.config.vocab_size > 258 else 0
    time_engine(engine, prompts[:2], 4, concurrent=True)  # warm-up

    def engine_mixed() -> float:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for n in lengths
        ]
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync(device)
        seconds = time.perf_counter() - start
        assert [len(o.token_ids) for o in outs] == lengths
        return seconds

    has_transformers = importlib.util.find_spec("transformers") is not None
    best = dict.fromkeys(("e1", "t1", "eq", "tq", "e16", "t16"), math.inf)
    for _ in range(repeats):
        best["e1"] = min(
            best["e1"], time_engine(engine, prompts[:1], max_tokens, True)[0]
        )
        if has_transformers:
            seconds = time_transformers(
                model_dir, prompt_ids[:1], max_tokens, pad_id, device, batched=True
            )
            best["t1"] = min(best["t1"], seconds)
        # equal lengths: every request `max_tokens`, no padding waste in the batch
        best["eq"] = min(best["eq"], time_engine(engine, prompts, max_tokens, True)[0])
        if has_transformers:
            seconds = time_transformers(
                model_dir, prompt_ids, max_tokens, pad_id, device, batched=True
            )
            best["tq"] = min(best["tq"], seconds)
        best["e16"] = min(best["e16"], engine_mixed())
        if has_transformers:
            seconds = time_transformers(
                model_dir, prompt_ids, max(lengths), pad_id, device, batched=True
            )
            best["t16"] = min(best["t16"], seconds)
    useful = sum(lengths)
    equal = len(prompts) * max_tokens
    rows = [
        Row(
            f"engine tok/s, batch 1 ({max_tokens} tok)",
            f"{max_tokens / best['e1']:.1f}",
            "",
            None,
        ),
        Row(
            f"engine tok/s, {len(prompts)} concurrent, equal lengths {max_tokens}",
            f"{equal / best['eq']:.1f}",
            "",
            None,
        ),
        Row(
            f"engine tok/s, 16 concurrent, mixed lengths {min(lengths)}-{max(lengths)}",
            f"{useful / best['e16']:.1f}",
            "",
            None,
        ),
    ]
    if not has_transformers:
        return rows + [Row("transformers generate", "missing", ">= 2x", False)]
    return rows + [
        Row(
            "transformers tok/s, batch 1",
            f"{max_tokens / best['t1']:.1f}",
            "",
            None,
        ),
        Row(
            "engine / transformers, batch 1",
            f"{best['t1'] / best['e1']:.2f}x",
            "",
            None,
        ),
        Row(
            "transformers tok/s, 16 equal lengths (one batch)",
            f"{equal / best['tq']:.1f}",
            "",
            None,
        ),
        Row(
            "engine / transformers, 16 concurrent equal lengths",
            f"{best['tq'] / best['eq']:.2f}x",
            ">= 1.2x",
            best["tq"] / best["eq"] >= 1.2,
        ),
        Row(
            "transformers tok/s, 16 padded to the longest (useful tokens)",
            f"{useful / best['t16']:.1f}",
            "",
            None,
        ),
        Row(
            "engine / transformers, 16 concurrent mixed lengths",
            f"{best['t16'] / best['e16']:.2f}x",
            ">= 2x",
            best["t16"] / best["e16"] >= 2,
        ),
    ]


def head_rows(
    model_dir: Path, device: str, max_tokens: int, repeats: int, max_len: int = 256
) -> list[Row]:
    """Batch-1 greedy decode ms/step with the checkpoint's output head and with
    each `engine.weights.HEAD_FORMATS` copy (`LLMEngine(quantize_head=...)`), runs
    interleaved (best of `repeats`), and each copy's quality cost: mean KLD and
    same top-1 against the checkpoint's head over the eval slices' first passages
    (teacher-forced, `max_len` tokens each)."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer
    from gpuagent.engine.weights import HEAD_FORMATS

    tokenizer = load_tokenizer(model_dir)
    engines = {
        fmt: LLMEngine(
            load_model(model_dir, device=device),
            tokenizer,
            max_num_seqs=1,
            kv_memory_bytes=64 << 20,
            quantize_head=None if fmt == "checkpoint" else fmt,
        )
        for fmt in ("checkpoint", *HEAD_FORMATS)
    }
    prompt = THROUGHPUT_PROMPTS[:1]
    best = dict.fromkeys(engines, math.inf)
    for round_ in range(repeats + 1):  # the first round warms up
        for fmt, engine in engines.items():
            # (max_tokens) - (1 token) is the decode steps alone, prefill cancelled
            one, _ = time_engine(engine, prompt, 1, concurrent=True)
            full, _ = time_engine(engine, prompt, max_tokens, concurrent=True)
            if round_:
                best[fmt] = min(best[fmt], (full - one) / (max_tokens - 1))
    sequences = quality_sequences(tokenizer, max_len)
    with torch.inference_mode():
        logprobs = {
            fmt: [
                engine.model.forward_dense(torch.tensor([ids], device=device))
                .log_softmax(-1)[0]
                .float()
                .cpu()
                for ids in sequences
            ]
            for fmt, engine in engines.items()
        }
    rows = [
        Row(
            "decode ms/step, batch 1, checkpoint head",
            f"{best['checkpoint'] * 1e3:.2f}",
            "",
            None,
        )
    ]
    reference = torch.cat(logprobs["checkpoint"])
    for fmt in HEAD_FORMATS:
        candidate = torch.cat(logprobs[fmt])
        kld = (reference.exp() * (reference - candidate)).sum(-1).mean().item()
        top1 = (reference.argmax(-1) == candidate.argmax(-1)).float().mean().item()
        rows += [
            Row(
                f"decode ms/step, batch 1, {fmt} head",
                f"{best[fmt] * 1e3:.2f} {best[fmt] / best['checkpoint']:.2f}x",
                "",
                None,
            ),
            Row(f"{fmt} head: mean KLD vs checkpoint head", f"{kld:.2e}", "", None),
            Row(f"{fmt} head: same top-1", f"{top1:.1%}", "", None),
        ]
    return rows


# ------------------------------------------------------------------------ quality


def teacher_forced_logprobs(
    model,
    token_ids: list[int],
    kv_dtype: str,
    chunk_tokens: int = 16,
    static_scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Log-probs [len-1, vocab] of every next token, reading K/V back from a cache of
    `kv_dtype` (fp8: with `static_scales` per layer, from
    `kv_calibration.static_kv_scales`); the sequence is fed `chunk_tokens` at a time
    (chunked prefill), so later tokens attend to earlier ones through the quantized
    cache."""
    device = next(model.parameters()).device
    kv = engine_kv_cache(
        model.config,
        kv_dtype,
        num_blocks=-(-len(token_ids) // 16),
        max_num_seqs=1,
        device=device,
    )
    if kv.kv_caches[0].static_scales:
        if static_scales is None:
            raise ValueError(f"{kv_dtype} needs static_scales")
        set_cache_scales(kv.kv_caches, static_scales)
    seq = Seq("tf", token_ids, SamplingParams(max_tokens=1))
    kv.blocks.ensure_capacity("tf", len(token_ids))
    out = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), chunk_tokens):
            n = min(chunk_tokens, len(token_ids) - start)
            ids, pos, attn = prepare_inputs(
                [ScheduledChunk(seq, start, n)], kv.blocks, device
            )
            logits = model(ids, pos, kv.kv_caches, attn, all_logits=True)  # [n, V]
            out.append(torch.log_softmax(logits.float(), -1))
    return torch.cat(out)[:-1].cpu()  # position i predicts token i + 1


def quality_sequences(tokenizer, max_len: int) -> list[list[int]]:
    """The first passage of each eval slice (English, code, Korean) as token ids,
    encoded as the engine encodes a prompt (BOS first where the tokenizer's rule
    adds it), at most `max_len` tokens each: the texts of the attention diagnostic."""
    return [
        tokenizer.encode_prompt(s.passages[0])[:max_len] for s in load_text_slices()
    ]


def amortized_bytes_ratio(config, dtype: str) -> float:
    """KV bytes/token of `dtype` as served by default vs bf16, its full-precision
    window row and its per-head static scales spread over a 2k-token sequence."""
    return cache_bytes_ratio(config, dtype, default_kv_window(dtype))


@dataclass
class KVQuality:
    """One KV dtype against bf16 KV: per slice and "overall" (the last)."""

    dtype: str
    bytes_ratio: float
    slices: list[SliceQuality]

    @property
    def overall(self) -> SliceQuality:
        return self.slices[-1]


def kv_quality(
    model_dir: Path,
    model,
    kv_dtypes: Sequence[str],
    max_items: int | None,
    passage_tokens: int,
    seed: int = 0,
    simulated: Sequence[Layout] = (),
) -> list[KVQuality]:
    """Each of `kv_dtypes` vs bf16 KV on the shipped eval sets' English, code and
    Korean passages (at most `max_items` per slice, `passage_tokens` each), scored
    by gpuagent.evaluate in process: teacher-forced through the engine's paged
    cache, prefilled in the chunks the server gives a lone prompt, exact KL. Each
    passage's bf16 distributions are computed once for every dtype. The
    `simulated` layouts (`kv_alternatives`, not served) follow the dtypes, scored
    against the same bf16 distributions, named by their layout."""
    rng = np.random.default_rng(seed)
    reference = EngineModel(model_dir, "bf16", max_tokens=passage_tokens, model=model)
    sides = {
        dtype: EngineModel(model_dir, dtype, max_tokens=passage_tokens, model=model)
        for dtype in kv_dtypes
    }
    names = [*kv_dtypes, *(layout.name for layout in simulated)]
    per_slice: dict[str, list[list[PositionStats]]] = {name: [] for name in names}
    slice_names = []
    for eval_slice in load_text_slices():
        slice_names.append(eval_slice.name)
        for stats in per_slice.values():
            stats.append([])
        for passage in eval_slice.passages[:max_items]:
            ids = reference.encode(passage)[:passage_tokens]
            ref_chunks = list(reference.logprobs_chunks(ids))
            for dtype, side in sides.items():
                per_slice[dtype][-1].append(
                    exact_position_stats(ref_chunks, side.logprobs_chunks(ids), ids)
                )
            sizes = [chunk.shape[0] for chunk in ref_chunks]
            for layout in simulated:
                chunks = layout_logprobs(model, ids, layout).split(sizes)
                per_slice[layout.name][-1].append(
                    exact_position_stats(ref_chunks, chunks, ids)
                )
    bytes_ratios = {d: amortized_bytes_ratio(model.config, d) for d in kv_dtypes}
    bytes_ratios |= {lay.name: lay.bytes_ratio(model.config) for lay in simulated}
    results = []
    for name in names:
        slices = [
            slice_quality(slice_name, stats, [], rng)
            for slice_name, stats in zip(slice_names, per_slice[name], strict=True)
        ]
        every = [s for stats in per_slice[name] for s in stats]
        slices.append(slice_quality("overall", every, [], rng))
        results.append(KVQuality(name, bytes_ratios[name], slices))
    return results


def quality_verdict(dtype: str, quality: SliceQuality) -> bool | None:
    """Whether `quality` meets `dtype`'s target (None: the dtype has none)."""
    if dtype not in QUALITY_TARGETS:
        return None
    kld_target, top1_target = QUALITY_TARGETS[dtype]
    return quality.mean_kld <= kld_target and quality.same_top1 >= top1_target


def quality_table(results: Sequence[KVQuality]) -> list[str]:
    """The KV quality table: one line per dtype and slice."""
    lines = [
        f"{'KV dtype':<16} {'slice':<8} {'tokens':>6} {'mean KLD':>10} "
        f"{'top-1':>8} {'bytes/tok':>9}  {'KLD tgt':>8} {'top-1 tgt':>9}  result"
    ]
    for result in results:
        kld_target, top1_target = QUALITY_TARGETS.get(result.dtype, (None, None))
        for quality in result.slices:
            ok = quality_verdict(result.dtype, quality)
            verdict = "-" if ok is None else ("PASS" if ok else "FAIL")
            lines.append(
                f"{served(result.dtype):<16} {quality.name:<8} "
                f"{quality.num_tokens:>6} {quality.mean_kld:>10.6f} "
                f"{100 * quality.same_top1:>7.2f}% {result.bytes_ratio:>9.4f}  "
                f"{'<= ' + str(kld_target) if kld_target else '':>8} "
                f"{f'>= {100 * top1_target:g}%' if top1_target else '':>9}  {verdict}"
            )
    return lines


def quality_rows(results: Sequence[KVQuality]) -> list[Row]:
    """The judged lines: each dtype's overall KLD and top-1 against its target."""
    rows = []
    for result in results:
        overall = result.overall
        kld_target, top1_target = QUALITY_TARGETS.get(result.dtype, (None, None))
        label = f"KV {served(result.dtype)} vs bf16, overall"
        rows += [
            Row(
                f"{label}: mean KLD ({overall.num_tokens} positions)",
                f"{overall.mean_kld:.6f}",
                f"<= {kld_target}" if kld_target is not None else "",
                overall.mean_kld <= kld_target if kld_target is not None else None,
            ),
            Row(
                f"{label}: same top-1",
                f"{100 * overall.same_top1:.2f}%",
                f">= {100 * top1_target:.1f}%" if top1_target is not None else "",
                overall.same_top1 >= top1_target if top1_target is not None else None,
            ),
        ]
    return rows


# ------------------------------------------------------- attention on activations


@dataclass
class LayerActivations:
    """One prompt's real attention inputs at one layer, as the model produced them."""

    query: torch.Tensor  # [n, H, D] post-RoPE queries
    key: torch.Tensor  # [n, KVH, D] post-RoPE keys
    value: torch.Tensor  # [n, KVH, D]
    softmax_scale: float


def capture_attention_inputs(
    model, token_ids: list[int], block_size: int = 16
) -> list[LayerActivations]:
    """Every layer's post-RoPE q, k and v for `token_ids` (one prompt, positions
    0..n-1), from one prefill through the paged path into an fp32 KV cache.

    K and V are read back from the cache with `kernels.gather_kv` (exactly what the
    model wrote). Queries never reach the cache: a hook takes each attention layer's
    input, q and k are projected from it by q_proj/k_proj (the serving path may
    run them fused and prepacked) and RoPE is applied with the
    model's own functions; the same recomputation for k must reproduce the cached
    keys, which checks it.
    """
    import kernels
    from gpuagent.engine.model import (
        AttentionMetadata,
        allocate_kv_caches,
        apply_rope,
        rope_cos_sin,
        rope_inv_freq,
    )

    config = model.config
    device = next(model.parameters()).device
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_caches(config, "fp32", num_blocks, block_size, device)
    attn = AttentionMetadata(
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        decode_only=n == 1,
    )
    inputs: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in enumerate(model.layers):

        def hook(_module, args, i=i) -> None:
            inputs[i] = args[0].detach()  # [n, hidden], normed

        handles.append(layer.self_attn.register_forward_pre_hook(hook))
    positions = torch.arange(n, device=device)
    try:
        with torch.inference_mode():
            model(torch.tensor(token_ids, device=device), positions, caches, attn)
    finally:
        for handle in handles:
            handle.remove()
    cos, sin = rope_cos_sin(rope_inv_freq(config).to(device), positions)  # [n, 1, D]
    heads, kv_heads, dim = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    layers = []
    for i, (layer, cache) in enumerate(zip(model.layers, caches, strict=True)):
        key, value = kernels.gather_kv(cache, attn.block_tables[0], n)  # [n, KVH, D]
        x, proj = inputs[i], layer.self_attn
        with torch.inference_mode():
            q = proj.q_proj(x).unflatten(-1, (heads, dim)).float()
            k = proj.k_proj(x).unflatten(-1, (kv_heads, dim)).float()
        recomputed = apply_rope(k, cos.float(), sin.float())
        assert torch.allclose(recomputed, key, rtol=1e-4, atol=1e-4), (
            f"layer {i}: RoPE recomputed from k_proj != the keys in the cache"
        )
        layers.append(
            LayerActivations(
                apply_rope(q, cos.float(), sin.float()),
                key,
                value,
                layer.self_attn.softmax_scale,
            )
        )
    return layers


def decode_attention_outputs(
    acts: LayerActivations,
    kv_dtype: str,
    query_positions: torch.Tensor,
    block_size: int = 16,
    window: int | None = None,
    static_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotate: bool | None = None,
) -> torch.Tensor:
    """Decode attention [P, H, D] float32 of the query at each of `query_positions`
    over context 0..t, with K/V stored through `kernels.write_kv` into a `kv_dtype`
    cache and read by `kernels.paged_decode_attention` (the serving path). With a
    full-precision window (default: as the engine serves `kv_dtype`) each query is
    its own sequence, with its own window row holding its newest positions. A
    rotated layout gets q, K and V in the Hadamard basis and the output rotated
    back, as the model does (`rotate`: None as served, or forced); a static-scale
    one (fp8) needs this layer's `static_scales` (key_scale [KVH], value_scale
    [KVH])."""
    import kernels

    n, kv_heads, dim = acts.key.shape
    device = acts.key.device
    num_blocks = -(-n // block_size)
    num_queries = len(query_positions)
    if window is None:
        window = default_kv_window(kv_dtype)
    if rotate is None:
        rotate = kv_dtype in kernels.ROTATED_DTYPES
    if rotate:
        rotation = kernels.hadamard(dim, device)
        rotated = LayerActivations(
            acts.query @ rotation,
            acts.key @ rotation,
            acts.value @ rotation,
            acts.softmax_scale,
        )
        out = decode_attention_outputs(
            rotated,
            kv_dtype,
            query_positions,
            block_size,
            window,
            static_scales,
            rotate=False,
        )
        return out @ rotation.T
    cache = kernels.allocate_kv_cache(
        kv_dtype,
        num_blocks,
        block_size,
        kv_heads,
        dim,
        device=device,
        window=window,
        num_windows=num_queries if window else 0,
    )
    cache.rotated = False  # the rotation, if any, is applied above
    if cache.static_scales:
        if static_scales is None:
            raise ValueError(f"{kv_dtype} needs this layer's static_scales")
        kernels.set_static_scales(cache, *(s.to(device) for s in static_scales))
    slots = torch.arange(n, dtype=torch.int64, device=device)
    window_slots = torch.full_like(slots, -1) if window else None
    kernels.write_kv(cache, acts.key, acts.value, slots, window_slots)
    window_rows = None
    if window:
        # Query r's newest positions t+1-window..t go to its row r (blocks skipped).
        offsets = torch.arange(window, device=device)
        pos = query_positions[:, None] + 1 - window + offsets  # [P, window]
        row = torch.arange(num_queries, device=device)[:, None].expand_as(pos)
        keep = pos >= 0
        pos, row = pos[keep], row[keep]
        kernels.write_kv(
            cache,
            acts.key[pos],
            acts.value[pos],
            torch.full_like(pos, -1),
            row * window + pos % window,
        )
        window_rows = torch.arange(num_queries, dtype=torch.int32, device=device)
    # Every query is a decode step of the same sequence: the same block table, and
    # a context that ends at (and includes) the query's own token.
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)
    tables = table[None].expand(num_queries, -1).contiguous()  # [P, blocks]
    context_lens = (query_positions + 1).to(torch.int32)  # [P]
    out = kernels.paged_decode_attention(
        acts.query[query_positions].contiguous(),
        cache,
        tables,
        context_lens,
        acts.softmax_scale,
        window_rows,
    )
    return out.float()


def sampled_positions(n: int, count: int) -> torch.Tensor:
    """Up to `count` distinct positions spread evenly over 0..n-1, both ends in."""
    return torch.linspace(0, n - 1, min(count, n)).round().long().unique()


def attention_relative_errors(
    model,
    sequences: Sequence[list[int]],
    kv_dtypes: Sequence[str],
    positions_per_prompt: int,
    reference_dtype: str = "bf16",
    window: int | None = None,
    static_scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Relative error ||o_q - o_ref|| / ||o_ref|| of decode attention output with
    each KV dtype vs `reference_dtype` KV, on the model's real activations.

    Returns {dtype: [num_layers] float64}; per layer the norms are taken over every
    sampled query of every prompt (all heads), so a layer's error is its output
    error energy over its output energy. Query positions are spread evenly over
    each prompt, first and last included. `window` overrides each dtype's default
    full-precision window. fp8 (static scales) uses `static_scales` per layer
    (`kv_calibration.static_kv_scales`), by default calibrated on `sequences`.
    """
    num_layers = len(model.layers)
    if static_scales is None and any(d in STATIC_SCALE_DTYPES for d in kv_dtypes):
        static_scales = static_kv_scales(model, sequences)
    err_sq = {
        dtype: torch.zeros(num_layers, dtype=torch.float64) for dtype in kv_dtypes
    }
    ref_sq = torch.zeros(num_layers, dtype=torch.float64)
    for token_ids in sequences:
        layers = capture_attention_inputs(model, token_ids)
        n = len(token_ids)
        device = layers[0].key.device
        picks = sampled_positions(n, positions_per_prompt).to(device)
        for i, acts in enumerate(layers):
            ref = decode_attention_outputs(acts, reference_dtype, picks)
            ref_sq[i] += ref.double().pow(2).sum().cpu()
            for dtype in kv_dtypes:
                out = decode_attention_outputs(
                    acts,
                    dtype,
                    picks,
                    window=window,
                    static_scales=static_scales[i] if static_scales else None,
                )
                err_sq[dtype][i] += (out - ref).double().pow(2).sum().cpu()
    return {dtype: (err / ref_sq).sqrt() for dtype, err in err_sq.items()}


def attention_error_rows(
    model,
    tokenizer,
    max_len: int,
    positions_per_prompt: int,
    errors: dict[str, torch.Tensor] | None = None,
) -> list[Row | str]:
    """Attention-output error on real activations, mean and worst layer per dtype:
    information rows on every model (a diagnostic, not a target, since issue 12),
    then issue 3's old bar as a line of text. `errors`:
    `attention_relative_errors` already measured."""
    sequences = quality_sequences(tokenizer, max_len)
    if errors is None:
        errors = attention_relative_errors(
            model, sequences, ("fp32", *KV_DTYPES[1:]), positions_per_prompt
        )
    queries = sum(
        len(sampled_positions(len(s), positions_per_prompt)) for s in sequences
    )
    rows: list[Row | str] = [
        Row(
            f"attn out fp32 vs bf16 KV, mean ({queries} q, {len(sequences)} texts)",
            f"{100 * errors['fp32'].mean().item():.3f}%",
            "",
            None,
        )
    ]
    for dtype in KV_DTYPES[1:]:
        per_layer = errors[dtype]
        worst = int(per_layer.argmax())
        for label, value in (
            ("mean of layers", per_layer.mean().item()),
            (f"worst layer ({worst})", per_layer[worst].item()),
        ):
            rows.append(
                Row(
                    f"attn out {served(dtype)} vs bf16 KV: rel. err, {label}",
                    f"{100 * value:.3f}%",
                    "",
                    None,
                )
            )
    by_bar: dict[float, list[str]] = {}
    for dtype, bar in ATTENTION_OLD_BAR.items():
        by_bar.setdefault(bar, []).append(served(dtype))
    old_bar = ", ".join(f"{'/'.join(d)} <= {100 * b:g}%" for b, d in by_bar.items())
    return rows + [f"issue 3's old bar (for reference, not judged): {old_bar}"]


def attention_layer_table(errors: dict[str, torch.Tensor]) -> list[str]:
    """Attention-output relative error per layer (%), one column per KV dtype."""
    dtypes = [d for d in errors if d != "fp32"]
    lines = ["layer " + " ".join(f"{served(d):>13}" for d in dtypes)]
    for layer in range(len(errors[dtypes[0]])):
        cells = " ".join(f"{100 * errors[d][layer].item():>12.3f}%" for d in dtypes)
        lines.append(f"{layer:>5} {cells}")
    return lines


# --------------------------------------------------------------------------- main


def model_quality_sections(
    model_dir: Path,
    model,
    tokenizer,
    quick: bool,
    title: str = "",
) -> list[tuple[str, Callable[[], list[Row | str]]]]:
    """The quality table and the attention diagnostic of one model, as sections."""
    max_items = 2 if quick else None
    passage_tokens = 160 if quick else 512
    attention_len = 160 if quick else 320
    attention_positions = 24 if quick else 64
    suffix = f" [{title}]" if title else ""

    def quality() -> list[Row | str]:
        dtypes = KV_DTYPES[1:]
        layouts = measured_layouts(model.config, default_kv_window("int4"))
        results = kv_quality(
            model_dir, model, dtypes, max_items, passage_tokens, simulated=layouts
        )
        served_results, simulated = results[: len(dtypes)], results[len(dtypes) :]
        return [
            *quality_table(served_results),
            "measured, not served (information; gpuagent/benches/kv_alternatives.py):",
            "  kivi-gGrR: KIVI int4 simulated; sim-int4+wW: the served int4 simulated",
            "  (w18: the simulation's check against int4+w18 above; the longer window:",
            "  the served int4 at kivi-g32r32's bytes/token)",
            *quality_table(simulated),
            *quality_rows(results),
        ]

    def attention() -> list[Row | str]:
        sequences = quality_sequences(tokenizer, attention_len)
        errors = attention_relative_errors(
            model,
            sequences,
            ("fp32", *KV_DTYPES[1:]),
            attention_positions,
            static_scales=static_kv_scales(model, calibration_sequences(tokenizer)),
        )
        rows = attention_error_rows(
            model, tokenizer, attention_len, attention_positions, errors
        )
        return [*rows, "per layer (diagnostic, not a target):"] + (
            attention_layer_table(errors)
        )

    return [
        (
            "KV quality vs bf16 KV, eval sets (teacher-forced, exact KL, in-process)"
            + suffix,
            quality,
        ),
        (
            "attention output vs bf16 KV (real activations, decode at sampled t)"
            + suffix,
            attention,
        ),
    ]


def long_kv_rows(model_dir: Path, model) -> list[Row | str]:
    """fp8, int8 and int4 vs bf16 KV on the held-out long passages, scored whole
    (`kv_long`): its table, then judged rows, overall and at positions >= 512."""
    stats, lengths = kv_long.score_passages(
        model_dir, model, kv_long.DTYPES, progress=lambda _: None
    )
    results = kv_long.long_quality(model.config, stats, min(lengths))
    rows: list[Row | str] = list(kv_long.table(results))
    for result in results:
        kld, top1, ratio = kv_long.TARGETS[result.name]
        label = f"KV {served(result.name)} held-out"
        for q in (result.get("overall"), result.tail):
            rows += [
                Row(
                    f"{label} {q.name}: mean KLD",
                    f"{q.mean_kld:.6f}",
                    f"<= {kld}",
                    q.mean_kld <= kld,
                ),
                Row(
                    f"{label} {q.name}: same top-1",
                    f"{100 * q.same_top1:.2f}%",
                    f">= {100 * top1:g}%",
                    q.same_top1 >= top1,
                ),
            ]
        rows.append(
            Row(
                f"{label}: bytes/token vs bf16 at {min(lengths)} tokens",
                f"{result.bytes_ratio:.4f}",
                f"<= {ratio}",
                result.bytes_ratio <= ratio,
            )
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns 0 when every target passes, else 1."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.engine")
    parser.add_argument("--quick", action="store_true", help="a small slice (CPU)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--quality-only",
        action="store_true",
        help="only the KV quality table and the attention diagnostic",
    )
    parser.add_argument(
        "--serving-only",
        action="store_true",
        help="only batch-1 and batch-16 tok/s vs transformers generate",
    )
    parser.add_argument(
        "--long-kv",
        action="store_true",
        help="with --model-dir: also fp8/int8/int4 KV on the held-out passages of "
        "2k+ tokens, scored whole (gpuagent.benches.kv_long; slow on a CPU)",
    )
    parser.add_argument(
        "--no-demo",
        action="store_true",
        help="with --model-dir: skip the demo model's quality rows",
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on CPU (1: on a shared CPU, more threads "
        "spin-wait against other processes and run tiny matmuls far slower)",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    tmp = None
    model_dir = args.model_dir or DEMO_MODEL_DIR
    if not (model_dir / "config.json").exists():
        tmp = tempfile.TemporaryDirectory()
        print("!" * 78)
        print(f"!! {model_dir} has no model: benchmarking a RANDOM model of the demo's")
        print("!! shape instead. Memory and throughput ratios hold; quality numbers")
        print("!! of a random model say little about the demo model.")
        print("!" * 78)
        model_dir = random_demo_shaped_dir(Path(tmp.name))
    started = time.perf_counter()
    model = load_model(model_dir, dtype=torch.float32, device=args.device)
    tokenizer = load_tokenizer(model_dir)
    c = model.config
    print(
        f"model {model_dir.name}: {c.num_hidden_layers} layers, hidden "
        f"{c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} KV "
        f"heads, head_dim {c.head_dim}, {model.num_parameters() / 1e6:.2f}M params; "
        f"device {args.device}; torch threads {torch.get_num_threads()}"
    )
    max_tokens = 16 if args.quick else 32
    repeats = 2 if args.quick else 3
    is_demo = model_dir.resolve() == DEMO_MODEL_DIR.resolve()

    serving = (
        "serving vs transformers generate (same process and threads, interleaved)",
        lambda: serving_rows(
            model_dir, model, tokenizer, args.device, max_tokens, repeats
        ),
    )
    head = (
        "output head copies (LLMEngine quantize_head): decode speed, quality cost",
        lambda: head_rows(model_dir, args.device, max_tokens, repeats),
    )
    sections: list[tuple[str, Callable[[], list[Row | str]]]] = []
    if args.serving_only:
        sections += [serving, head]
    elif not args.quality_only:
        sections += [
            ("memory", lambda: memory_rows(c) + capacity_rows(c)),
            (
                "throughput",
                lambda: throughput_rows(
                    model_dir, model, tokenizer, args.device, max_tokens, repeats
                ),
            ),
            serving,
            head,
        ]
    if not args.serving_only:
        sections += model_quality_sections(model_dir, model, tokenizer, args.quick)
    if args.long_kv:
        if is_demo:
            parser.error("--long-kv needs --model-dir (passages of 2k+ tokens)")
        sections.append(
            (
                "KV quality vs bf16 KV, held-out passages of 2k+ tokens, scored whole",
                lambda: long_kv_rows(model_dir, model),
            )
        )
    demo_rows = not (args.serving_only or is_demo or args.no_demo)
    if demo_rows and (DEMO_MODEL_DIR / "config.json").exists():
        demo = load_model(DEMO_MODEL_DIR, dtype=torch.float32, device=args.device)
        sections += model_quality_sections(
            DEMO_MODEL_DIR,
            demo,
            load_tokenizer(DEMO_MODEL_DIR),
            args.quick,
            title="demo model",
        )
    rows: list[Row] = []
    header = f"{'metric':<56} {'value':>12}  {'target':>10}  result"
    for title, build in sections:
        print(f"\n== {title}", flush=True)
        shown_header = False
        for item in build():
            if isinstance(item, str):
                print(item)
                continue
            if not shown_header:
                print(header)
                shown_header = True
            print(item.render())
            rows.append(item)
    judged = [r for r in rows if r.ok is not None]
    passed = sum(r.ok for r in judged)
    print(
        f"\n{passed}/{len(judged)} targets pass; {time.perf_counter() - started:.0f} s"
    )
    if tmp is not None:
        tmp.cleanup()
    return 0 if passed == len(judged) else 1


if __name__ == "__main__":
    raise SystemExit(main())
