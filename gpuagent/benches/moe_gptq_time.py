"""Seconds of per-expert GPTQ on the shipped tiny MoE model. First table: the
calibration forwards as they were (every attention pass and the MLP-input
capture ran the whole decoder layer, every routed expert included) against as
they are (the attention alone: `gpuagent.compress.moe.run_attention` /
`mlp_inputs`), side by side in one run (now: each attention group's forward
also stops once its input is taken), and whether the two candidates' files are
byte for byte equal:
`python -m gpuagent.benches.moe_gptq_time [--sequences 32 --tokens 256]`.

Second table: the experts' GPTQ one expert at a time (the per-expert loop, as
it was) against batched (`gptq.quantize_gptq_batch`: the experts of a pass with
the same shapes at once), on the demo model (8 routed experts and the shared one
a layer) and on a random tiny DeepSeek-V3 with 64 routed experts
(`moe_gptq.build`), so the scaling shows: the seconds spent solving the MoE
layers' experts (Hessian stacking included), the whole compress, and whether
the two folders are byte for byte equal. `--only forwards|batching` runs one.

Each table's first row is like-for-like (the baseline against itself: 1.00).
Best of `--repeats` runs each, interleaved, so load on the machine hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gpuagent.compress import moe
from gpuagent.compress.calibration import run_layer
from gpuagent.compress.pipeline import compress

MODEL = Path(__file__).resolve().parents[1] / "engine" / "moe_demo_model"
RECIPE = {"weights": "w8a16", "kv_cache_dtype": "int8", "method": "gptq"}


def _whole_layer_attention(layer, hidden, cos, sin, stop_at=None) -> None:
    run_layer(layer, hidden, cos, sin)  # to the end, every expert included


def _whole_layer_mlp_inputs(layer, hidden, cos, sin) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    run_layer(layer, hidden, cos, sin, {"mlp": seen.append})
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])


@contextlib.contextmanager
def whole_layer_forwards():
    saved = moe.run_attention, moe.mlp_inputs
    moe.run_attention, moe.mlp_inputs = _whole_layer_attention, _whole_layer_mlp_inputs
    try:
        yield
    finally:
        moe.run_attention, moe.mlp_inputs = saved


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json" and path.name != "config.json":
            continue  # reports carry timings
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def one_expert_at_a_time():
    """The per-expert loop: every GPTQ batch a single set (expert)."""
    saved = moe._batches
    moe._batches = lambda layer, sets, budget: ([s] for s in sets)
    try:
        yield
    finally:
        moe._batches = saved


@contextlib.contextmanager
def expert_gptq_seconds(spent: list[float]):
    """Appends to `spent` the seconds of each GPTQ solve of experts (routed or
    shared; the attention's and dense MLPs' solves are the same either way)."""
    saved = moe._solve_batch

    def timed(layer, batch, accs, scheme):
        if "experts" not in batch[0].hook:
            return saved(layer, batch, accs, scheme)
        started = time.perf_counter()
        try:
            return saved(layer, batch, accs, scheme)
        finally:
            spent.append(time.perf_counter() - started)

    moe._solve_batch = timed
    try:
        yield
    finally:
        moe._solve_batch = saved


def _run(size, baseline: bool, tmp: Path, tag: str) -> tuple[float, str]:
    out = tmp / tag
    ctx = whole_layer_forwards() if baseline else contextlib.nullcontext()
    with ctx:
        started = time.perf_counter()
        compress(MODEL, RECIPE, out, calibration_size=size)
        seconds = time.perf_counter() - started
    return seconds, _digest(out)


def _run_gptq(model: Path, size, per_expert: bool, out: Path) -> tuple[float, float]:
    # (seconds of the experts' GPTQ, seconds of the whole compress)
    spent: list[float] = []
    ctx = one_expert_at_a_time() if per_expert else contextlib.nullcontext()
    with ctx, expert_gptq_seconds(spent):
        started = time.perf_counter()
        compress(model, RECIPE, out, calibration_size=size)
        seconds = time.perf_counter() - started
    return sum(spent), seconds


def forwards_table(size, repeats: int) -> None:
    best = {"baseline": float("inf"), "again": float("inf"), "now": float("inf")}
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for name in best:
                seconds, digest = _run(size, name != "now", Path(tmp), f"{name}{r}")
                best[name] = min(best[name], seconds)
                digests[name] = digest
    print(f"moe_demo_model, {RECIPE}, calibration {size[0]} x {size[1]} tokens")
    print(f"{'calibration forwards':<36}{'seconds':>10}{'ratio':>8}  same bytes")
    rows = (
        ("whole layer (baseline)", "baseline"),
        ("whole layer (baseline, again)", "again"),
        ("attention alone (now)", "now"),
    )
    for label, name in rows:
        ratio = best[name] / best["baseline"]
        same = digests[name] == digests["baseline"]
        print(f"{label:<36}{best[name]:>10.1f}{ratio:>8.2f}  {same}")


def batching_table(size, repeats: int, experts: int) -> None:
    from gpuagent.benches.moe_gptq import build

    print(f"{RECIPE}, calibration {size[0]} x {size[1]} tokens")
    print(
        f"{'model':<22}{'experts GPTQ':<26}{'GPTQ s':>9}{'ratio':>8}"
        f"{'compress s':>12}{'ratio':>8}  same bytes"
    )
    modes = (
        ("per-expert (baseline)", True),
        ("per-expert (again)", True),
        ("batched (now)", False),
    )
    with tempfile.TemporaryDirectory() as tmp:
        random_model = Path(tmp) / f"random-{experts}"
        build("deepseek_v3", random_model, n_routed_experts=experts)
        models = (
            ("moe_demo_model", MODEL),
            (f"random, {experts} experts", random_model),
        )
        for label, model in models:
            best = {m: (float("inf"), float("inf")) for m, _ in modes}
            digests = {}
            for r in range(repeats):
                for mode, per_expert in modes:
                    out = Path(tmp) / f"{label}-{mode}-{r}"
                    gptq, total = _run_gptq(model, size, per_expert, out)
                    best[mode] = (min(best[mode][0], gptq), min(best[mode][1], total))
                    digests[mode] = _digest(out)
                    shutil.rmtree(out)
            base_gptq, base_total = best[modes[0][0]]
            for mode, _ in modes:
                gptq, total = best[mode]
                same = digests[mode] == digests[modes[0][0]]
                print(
                    f"{label:<22}{mode:<26}{gptq:>9.2f}{gptq / base_gptq:>8.3f}"
                    f"{total:>12.1f}{total / base_total:>8.2f}  {same}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--experts", type=int, default=64, help="random model's")
    parser.add_argument("--only", choices=("forwards", "batching"))
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's own)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    size = (args.sequences, args.tokens)
    if args.only != "batching":
        forwards_table(size, args.repeats)
    if args.only != "forwards":
        batching_table(size, args.repeats, args.experts)


if __name__ == "__main__":
    main()
