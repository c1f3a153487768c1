"""Benchmark of weight compression, one run, side-by-side ratios:
`python -m gpuagent.benches.compress [--quick] [--model-dir DIR]`.

- size: the linear layers' bytes after compression vs the same tensors in bf16
  (targets: w8a16 <= 0.52, w4a16 <= 0.28), and the whole folder;
- quality: each recipe's folder against the source folder, both scored in-process
  by `gpuagent.evaluate` (full distributions, the english / code / korean slices):
  mean KLD and same-top-1 per slice against the bars (w8a16: <= 0.002 and
  >= 97.5%; 4-bit: <= 0.03 and >= 92%), RTN, GPTQ, AWQ scales and sign-gradient
  rounding side by side.
  The reference is the source run in float32 (the bf16 model's values, without
  bf16 arithmetic's noise); the candidate runs as the engine runs it in the same
  arithmetic (on a CPU in float32: `kernels.weight_matmul`'s torch reference), so
  the two differ by the weight format alone. Printed as information: the parent
  itself run in bf16 against the same reference (what bf16 arithmetic alone costs
  this model), and with --bf16-arithmetic each candidate run in bf16 too (on a CPU
  torch's weight-only kernels, bf16 activations, as a GPU serves it);
- decode: one request's greedy tokens/s in the engine for the parent and the first
  folder of each format, all in float32 on this device, rounds interleaved, and the
  int4 folder again with `kernels.int4_cpu` off (the torch reference) where that
  kernel applies (information: what a float32 model costs to decode per format);
- matmul: the weight-only kernels vs bf16 torch.matmul on a 4096x14336 layer at
  batch 1..16 (`kernels.bench.bench_matmul`; on a CPU the torch reference, the
  fused int4 kernel at up to 8 rows (what the engine runs for a float32 model), and
  torch's CPU kernels over prepacked weights, what it runs for a bf16 one; the
  ratios are not targets);
- lossless: the exponent coding vs zipnn on both models' bf16 weights (the demo
  model and --model-dir; gpuagent.benches.lossless).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.benches import engine as engine_bench
from gpuagent.benches import lossless as lossless_bench
from gpuagent.compress.pipeline import compress
from gpuagent.engine.engine import LLMEngine
from gpuagent.engine.loader import load_model
from gpuagent.evaluate.evalsets import TEXT_SLICES
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.regression import Settings, evaluate_quality
from gpuagent.protocol import CompressResult, QualityReport
from kernels import int4_cpu

DEFAULT_MODEL_DIR = Path("var/models/smollm2-135m")
SIZE_TARGETS = {"w8a16": 0.52, "w4a16": 0.28}
# Lossless: size within 2% of zipnn's or better, decompression at least as fast.
LOSSLESS_MAX_SIZE_VS_ZIPNN = 1.02
LOSSLESS_MIN_SPEED_VS_ZIPNN = 1.0
QUALITY_BARS = {"w8a16": (0.002, 0.975), "fp8": (0.03, 0.92), "w4a16": (0.03, 0.92)}
# (label, recipe): the recipes, RTN and GPTQ, then the 4-bit variants worth
# measuring on a parent that is already a 4-bit grid (group 32, asymmetric).
RECIPES = (
    ("w8a16 rtn", {"weights": "w8a16"}),
    ("w8a16 gptq", {"weights": "w8a16", "method": "gptq"}),
    ("w8a16 awq rtn", {"weights": "w8a16", "awq": True}),
    ("w8a16 awq gptq", {"weights": "w8a16", "method": "gptq", "awq": True}),
    (
        "w8a16 awq gptq act-order",
        {"weights": "w8a16", "method": "gptq", "awq": True, "act_order": True},
    ),
    (
        "w8a16 awq gptq act-order mse",
        {
            "weights": "w8a16",
            "method": "gptq",
            "awq": True,
            "act_order": True,
            "observer": "mse",
        },
    ),
    ("fp8 rtn", {"weights": "fp8"}),
    ("fp8 gptq", {"weights": "fp8", "method": "gptq"}),
    ("fp8 awq gptq", {"weights": "fp8", "method": "gptq", "awq": True}),
    ("w4a16-g128 rtn", {"weights": "w4a16-g128"}),
    ("w4a16-g128 gptq", {"weights": "w4a16-g128", "method": "gptq"}),
    (
        "w4a16-g128 awq gptq",
        {"weights": "w4a16-g128", "method": "gptq", "awq": True},
    ),
    (
        "w4a16-g128 gptq act-order",
        {"weights": "w4a16-g128", "method": "gptq", "act_order": True},
    ),
    (
        "w4a16-g128 gptq act-order mse",
        {
            "weights": "w4a16-g128",
            "method": "gptq",
            "act_order": True,
            "observer": "mse",
        },
    ),
    (
        "w4a16-g128 awq gptq act-order mse",
        {
            "weights": "w4a16-g128",
            "method": "gptq",
            "awq": True,
            "act_order": True,
            "observer": "mse",
        },
    ),
    ("w4a16-g128 signround", {"weights": "w4a16-g128", "method": "signround"}),
    ("w4a16-g32 asym rtn", {"weights": "w4a16-g32", "symmetric": False}),
    (
        "w4a16-g32 asym gptq",
        {"weights": "w4a16-g32", "method": "gptq", "symmetric": False},
    ),
)
QUICK_RECIPES = (
    "w8a16 rtn",
    "w8a16 gptq",
    "w8a16 awq gptq",
    "w4a16-g128 rtn",
    "w4a16-g128 gptq",
)


@dataclass
class Row:
    """One printed line: what, measured value, target, pass? (None: information)."""

    name: str
    value: str
    target: str
    ok: bool | None

    def render(self) -> str:
        result = "info" if self.ok is None else ("PASS" if self.ok else "FAIL")
        return f"{self.name:<66} {self.value:>14}  {self.target:>10}  {result}"


def _family(label: str) -> str:
    return label.split()[0].split("-g")[0]  # "w4a16-g128 rtn" -> "w4a16"


def size_rows(label: str, result: CompressResult) -> list[Row]:
    """Linear layers vs bf16, embeddings, the folder, the GPU estimate."""
    sizes = {s.tensor_class: s for s in result.sizes}
    linear_after = sizes["attention"].bytes_after + sizes["mlp"].bytes_after
    linear_bf16 = sizes["attention"].bytes_bf16 + sizes["mlp"].bytes_bf16
    ratio = linear_after / linear_bf16
    target = SIZE_TARGETS.get(_family(label))
    total_bf16 = sum(s.bytes_bf16 for s in result.sizes)
    return [
        Row(
            f"{label}: linear layers bytes vs bf16",
            f"{ratio:.3f}",
            f"<= {target}" if target else "",
            ratio <= target if target else None,
        ),
        Row(
            f"{label}: whole checkpoint vs bf16 (MB after)",
            f"{result.total_bytes_after / total_bf16:.3f} "
            f"({result.total_bytes_after / 1e6:.1f})",
            "",
            None,
        ),
        Row(
            f"{label}: expected GPU weight memory (MB)",
            f"{result.expected_gpu_weight_bytes / 1e6:.1f}",
            "",
            None,
        ),
    ]


def quality_rows(
    label: str,
    candidate_dir: Path,
    reference: EngineModel,
    settings: Settings,
    bf16_arithmetic: bool = False,
) -> list[Row]:
    """Mean KLD and same-top-1 per slice of the candidate, as the engine runs it
    in the reference's dtype (float32 on a CPU), vs the reference, against the
    bars; with `bf16_arithmetic` also (as information) the candidate run in bf16,
    on a CPU through torch's weight-only kernels (compare with the parent's own
    bf16-arithmetic rows)."""
    candidate = EngineModel(candidate_dir, "bf16", max_tokens=1024)
    report = evaluate_quality(candidate, reference, settings)
    rows = slice_rows(label, report, QUALITY_BARS[_family(label)])
    if bf16_arithmetic:
        served = EngineModel(
            candidate_dir, "bf16", max_tokens=1024, dtype=torch.bfloat16
        )
        rows += slice_rows(
            f"{label} (in bf16 arithmetic)",
            evaluate_quality(served, reference, settings),
            None,
        )
    return rows


def slice_rows(
    label: str, report: QualityReport, bars: tuple[float, float] | None
) -> list[Row]:
    """Mean KLD and same-top-1 of each slice of `report`, against `bars` (max KLD,
    min top-1) or as information (None)."""
    rows = []
    for s in report.slices:
        rows.append(
            Row(
                f"{label}: {s.name} mean KLD ({s.num_tokens} tokens)",
                f"{s.mean_kld:.6f}",
                f"<= {bars[0]}" if bars else "",
                s.mean_kld <= bars[0] if bars else None,
            )
        )
        rows.append(
            Row(
                f"{label}: {s.name} same top-1",
                f"{100 * s.same_top1:.2f}%",
                f">= {100 * bars[1]:.1f}%" if bars else "",
                s.same_top1 >= bars[1] if bars else None,
            )
        )
    return rows


def bf16_floor_rows(model_dir: Path, reference: EngineModel, settings) -> list[Row]:
    """The uncompressed parent vs the reference (float32 on this CPU), as
    information: its weights rounded to bf16 and run in float32 (the bf16
    checkpoint itself), then run in bf16 (weights and activations, as a GPU serves
    the bf16 model): what bf16 storage and bf16 arithmetic each cost this model,
    the scale the bars sit on."""
    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    weights = EngineModel(model_dir, "bf16", max_tokens=1024, model=model)
    arithmetic = EngineModel(model_dir, "bf16", max_tokens=1024, dtype=torch.bfloat16)
    return [
        row
        for label, side in (
            ("parent's weights in bf16", weights),
            ("parent in bf16 arithmetic", arithmetic),
        )
        for row in slice_rows(label, evaluate_quality(side, reference, settings), None)
    ]


def decode_rows(
    model_dir: Path, folders: dict[str, Path], max_tokens: int, repeats: int
) -> list[Row]:
    """Greedy tokens/s of one request (`max_tokens`, prompt included) for the
    parent and each of `folders` (label -> compressed folder), float32 on this
    device, best of `repeats` interleaved rounds, and how much longer each takes
    than the parent; an int4 folder also with `kernels.int4_cpu` switched off (the
    torch reference) where that kernel applies."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt = engine_bench.THROUGHPUT_PROMPTS[:1]
    runs: list[tuple[str, LLMEngine, bool]] = []
    for label, folder in {"parent": model_dir, **folders}.items():
        engine = LLMEngine.from_model_dir(
            folder, device=device, max_num_seqs=1, kv_memory_bytes=64 << 20
        )
        runs.append((label, engine, True))
        if device == "cpu" and int4_cpu.AVAILABLE and _family(label) == "w4a16":
            runs.append((f"{label}, torch reference", engine, False))
    best = {label: float("inf") for label, _, _ in runs}
    available = int4_cpu.AVAILABLE
    try:
        for round_ in range(repeats + 1):  # the first round warms up
            for label, engine, fused in runs:
                int4_cpu.AVAILABLE = available and fused
                seconds, _ = engine_bench.time_engine(
                    engine, prompt, max_tokens, concurrent=True
                )
                if round_:
                    best[label] = min(best[label], seconds)
    finally:
        int4_cpu.AVAILABLE = available
    return [
        Row(
            f"decode, float32 on {device}: {label}",
            f"{max_tokens / seconds:.1f} {seconds / best['parent']:.2f}x",
            "",
            None,
        )
        for label, seconds in best.items()
    ]


def matmul_rows(quick: bool) -> None:
    """The weight-only kernels vs bf16 torch.matmul on 4096x14336, printed by
    `kernels.bench` (its own table: ms, GB/s, x vs bf16)."""
    from kernels import bench as kernels_bench

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = (1, 16) if quick else (1, 2, 4, 8, 16)
    reps = 2 if device == "cpu" else 20
    path = "Triton" if device == "cuda" else "reference, and torch's CPU kernels"
    print(f"\nmatmul on {device} ({path})")
    table = kernels_bench.Table(device)
    kernels_bench.bench_matmul(table, device, 14336, 4096, batches, reps)


def lossless_table(model_dir: Path, quick: bool) -> tuple[str, bool]:
    """The lossless exponent coding vs zipnn on the demo model's and `model_dir`'s
    bf16 weights (gpuagent.benches.lossless), and whether both models met
    both targets."""
    threads = lossless_bench.default_threads()
    model_dirs = [DEMO_MODEL_DIR]
    if model_dir.resolve() != DEMO_MODEL_DIR:
        model_dirs.append(model_dir)
    rows = lossless_bench.lossless_rows(
        model_dirs,
        threads=threads,
        repeats=1 if quick else 3,
        min_seconds=0.0 if quick else lossless_bench.DEFAULT_MIN_SECONDS,
    )
    ok = all(
        r.size_vs_zipnn <= LOSSLESS_MAX_SIZE_VS_ZIPNN
        and r.decompress_speed_vs_zipnn >= LOSSLESS_MIN_SPEED_VS_ZIPNN
        for r in rows
    )
    return lossless_bench.format_rows(rows, threads), ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuagent.benches.compress",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--quick", action="store_true", help="fewer recipes, items")
    parser.add_argument(
        "--recipes", nargs="*", help="labels to run (default: all, or the quick set)"
    )
    parser.add_argument("--max-items", type=int, default=None, help="per slice")
    parser.add_argument("--no-matmul", action="store_true")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument(
        "--bf16-arithmetic",
        action="store_true",
        help="also score each candidate run in bf16 (on a CPU torch's weight-only "
        "kernels), beside the parent run in bf16",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))

    wanted = args.recipes  # "--recipes" alone: none (the matmul rows only)
    if wanted is None:
        wanted = QUICK_RECIPES if args.quick else [r[0] for r in RECIPES]
    unknown = sorted(set(wanted) - {r[0] for r in RECIPES})
    if unknown:
        parser.error(f"unknown recipes {unknown}; known: {[r[0] for r in RECIPES]}")
    max_items = args.max_items or (3 if args.quick else None)
    settings = Settings(slices=TEXT_SLICES, max_items=max_items, continuation_tokens=8)
    reference = EngineModel(args.model_dir, "bf16", max_tokens=1024) if wanted else None
    print(
        f"model {args.model_dir}; quality vs the source folder run in float32, per "
        f"slice {max_items or 'all'} passages/prompts"
    )
    failed = False
    if reference is not None:
        for row in bf16_floor_rows(args.model_dir, reference, settings):
            print(row.render(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders: dict[str, Path] = {}  # the first folder of each format
        for label, options in RECIPES:
            if label not in wanted:
                continue
            recipe = {"kv_cache_dtype": "bf16", **options}
            start = time.monotonic()
            result = compress(
                args.model_dir, recipe, Path(tmp) / label.replace(" ", "_")
            )
            print(
                f"\n{label}: compressed in {time.monotonic() - start:.0f} s, "
                f"group sizes {result.group_sizes or 'per channel'}",
                flush=True,
            )
            rows = size_rows(label, result) + quality_rows(
                label,
                Path(result.out_dir),
                reference,
                settings,
                args.bf16_arithmetic,
            )
            for row in rows:
                print(row.render(), flush=True)
                failed |= row.ok is False
            if not any(_family(f) == _family(label) for f in folders):
                folders[label] = Path(result.out_dir)
        if folders and not args.no_decode:
            print("\ndecode: tokens/s of one greedy request, its time vs the parent's")
            for row in decode_rows(args.model_dir, folders, 32, 1 if args.quick else 3):
                print(row.render(), flush=True)
    table, lossless_ok = lossless_table(args.model_dir, args.quick)
    print(f"\n{table}\nlossless targets: {'PASS' if lossless_ok else 'FAIL'}")
    failed |= not lossless_ok
    if not args.no_matmul:
        matmul_rows(args.quick)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
