"""CPU candidates for an int8 output head, side by side:
`python -m gpuagent.benches.head_kernels [--n N --k K] [--rows 1 16] [--threads 1 2]`.

At SmolLM2-135M's head shape (49152 x 576) by default, a random weight: ms per call
of the float32 head (oneDNN-packed, as the engine runs it), the bf16 copy
(`Bf16Head`), and three int8 forms: torch's `_weight_int8pack_mm` (per-channel
int8 weight, bf16 activations: the only dtype it runs fast), `torch._int_mm` with
the activations rounded to int8 per row at each call (a dynamic-int8 dot like
llama.cpp's q8 one, per-channel weight), and `kernels.int8_cpu` (group-32 int8
weight as Q8_0, float32 activations: what `quantize_head="int8"` runs). Rounds
alternate between them; best of `--rounds` each. Only `kernels.int8_cpu` keeps the
activations in float32 and Q8_0's groups: on SmolLM2 per-row int8 activations cost
mean KLD ~8e-3 (the final norm's output has channels 25x its RMS), and
per-channel weights ~1e-3, against 0 for group-32 weights (its head is Q8_0).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from gpuagent.engine.model import packed_linear, prepack_weight
from kernels import int8_cpu


def candidates(w: torch.Tensor, rows: int) -> dict:
    """name -> a zero-argument call of that head on `rows` float32 rows."""
    k = w.shape[1]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    packed = prepack_weight(w)
    wb = w.bfloat16()
    packed_b = prepack_weight(wb)
    scale_pc = w.abs().amax(1) / 127
    codes_pc = torch.round(w / scale_pc[:, None]).to(torch.int8)
    scale_pc_b = scale_pc.bfloat16()
    codes32, scale32 = int8_cpu.quantize_int8(w, 32)

    def dynamic_int8():
        sx = x.abs().amax(1, keepdim=True) / 127
        xq = torch.round(x / sx).to(torch.int8)
        return torch._int_mm(xq, codes_pc.t()).float() * sx * scale_pc

    def bf16():
        xb = x.bfloat16()
        y = packed_linear(xb, packed_b) if packed_b is not None else xb @ wb.t()
        return y.float()

    return {
        "float32 (oneDNN packed)": (
            (lambda: packed_linear(x, packed))
            if packed is not None
            else (lambda: x @ w.t())
        ),
        "bf16 copy": bf16,
        "int8 per-channel, bf16 x (_weight_int8pack_mm)": lambda: (
            torch.ops.aten._weight_int8pack_mm(x.bfloat16(), codes_pc, scale_pc_b)
        ),
        "int8 per-channel, int8 x per row (_int_mm)": dynamic_int8,
        "int8 group-32, float32 x (kernels.int8_cpu)": (
            (lambda: int8_cpu.int8_matmul(x, codes32, scale32))
            if int8_cpu.applies(x, 32)
            else (lambda: int8_cpu.int8_matmul_blocked(x, codes32, scale32))
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=49152)
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    w = torch.randn(args.n, args.k, generator=torch.Generator().manual_seed(0)) * 0.05
    print(f"head {args.n} x {args.k}; ms per call, best of {args.rounds} rounds")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            calls = candidates(w, rows)
            best = dict.fromkeys(calls, math.inf)
            for round_ in range(args.rounds + 1):  # the first round warms up
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    if round_:
                        best[name] = min(best[name], time.perf_counter() - start)
            base = best["float32 (oneDNN packed)"]
            for name, seconds in best.items():
                print(
                    f"threads {threads} rows {rows:>2}  {name:<48} "
                    f"{seconds * 1e3:8.2f} ms  {base / seconds:5.2f}x float32"
                )


if __name__ == "__main__":
    main()
