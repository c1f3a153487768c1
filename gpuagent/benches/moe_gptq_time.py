"""Seconds of per-expert GPTQ on the shipped tiny MoE model, the calibration
forwards as they were (every attention pass and the MLP-input capture ran the
whole decoder layer, every routed expert included) against as they are (the
attention alone: `gpuagent.compress.moe.run_attention` / `mlp_inputs`), side by
side in one run (now: each attention group's forward also stops once its
input is taken), and whether the two candidates' files are byte for byte equal:
`python -m gpuagent.benches.moe_gptq_time [--sequences 32 --tokens 256]`.

The first row is like-for-like (the whole-layer baseline against itself: 1.00).
Best of `--repeats` runs each, interleaved, so load on the machine hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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


def _run(size, baseline: bool, tmp: Path, tag: str) -> tuple[float, str]:
    out = tmp / tag
    ctx = whole_layer_forwards() if baseline else contextlib.nullcontext()
    with ctx:
        started = time.perf_counter()
        compress(MODEL, RECIPE, out, calibration_size=size)
        seconds = time.perf_counter() - started
    return seconds, _digest(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    size = (args.sequences, args.tokens)
    best = {"baseline": float("inf"), "again": float("inf"), "now": float("inf")}
    digests = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
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


if __name__ == "__main__":
    main()
