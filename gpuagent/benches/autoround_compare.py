"""Our w4a16 recipes vs Intel's AutoRound on the same model, format and calibration
tokens, one run: `python -m gpuagent.benches.autoround_compare [--groups 128 64]`.

AutoRound (the `auto-round` package) runs in its own virtualenv (`--venv`,
default var/autoround-venv, git-ignored; `--setup` creates it from PyPI: CPU torch
and auto-round, never a dependency of the project or its tests) as a subprocess
(gpuagent.benches.autoround_runner) on the project's calibration sequences
(gpuagent.compress.calibration, written to a JSON file of token ids, so both
sides tune on the same tokens), symmetric (its default), the same group sizes per
layer as our recipes (SmolLM2's 576-wide inputs get 64 under g128), `--steps`
sign-gradient steps per block on both sides (AutoRound's `iters`, our signround's
steps), saved in the auto_gptq layout and converted to our compressed-tensors
layout (gpuagent.benches.gptq_convert). Then every folder, AutoRound's first, is
scored by gpuagent.evaluate against the parent (float32, in-process, the same
positions): mean KLD per slice and overall, same top-1, linear bytes vs bf16, and
the compression wall time (ours: `compress` end to end; AutoRound's: model load
to saved folder inside the subprocess, its interpreter start and the conversion
left out). Same torch thread count on both sides.

The verdict per group size and format: our best recipe's overall mean KLD <=
AutoRound's of the same format (symmetric; asymmetric with `--autoround-asym`),
its compression time no worse and its linear layers <= 0.28 of bf16 (the exit
status counts all three); our asymmetric rows without an AutoRound asymmetric row
are printed as information.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpuagent.benches.gptq_convert import convert
from gpuagent.compress import signround
from gpuagent.compress.calibration import (
    DEFAULT_NUM_SEQUENCES,
    DEFAULT_SEQUENCE_TOKENS,
    calibration_sequences,
)
from gpuagent.compress.pipeline import compress
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.regression import Settings, evaluate_quality
from gpuagent.protocol import QualityReport

DEFAULT_MODEL_DIR = Path("var/models/smollm2-135m")
DEFAULT_VENV = Path("var/autoround-venv")
AUTOROUND_PACKAGES = ("torch==2.13.0", "auto-round==0.16.1")
RUNNER = Path(__file__).with_name("autoround_runner.py")
SIZE_TARGET = 0.28
# (label, recipe options, group sizes it runs at: None = every --groups)
OURS = (
    ("signround", {"method": "signround"}),
    ("gptq act-order mse", {"method": "gptq", "act_order": True, "observer": "mse"}),
    (
        "awq gptq act-order mse",
        {"method": "gptq", "awq": True, "act_order": True, "observer": "mse"},
    ),
    ("gptq asym", {"method": "gptq", "symmetric": False}),
)


@dataclass
class Result:
    label: str
    group: int
    symmetric: bool
    linear_ratio: float
    seconds: float
    report: QualityReport

    def overall(self):
        return next(s for s in self.report.slices if s.name == "overall")


def setup_venv(venv: Path) -> None:
    """Create `venv` with AutoRound's packages from PyPI (CPU torch)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *AUTOROUND_PACKAGES], check=True)


def linear_ratio(folder: Path) -> float:
    """The quantized projections' bytes (codes, scales, zero points, shapes) vs
    the same weights in bf16."""
    tensors = load_file(folder / "model.safetensors")
    after = bf16 = 0
    for name, shape in tensors.items():
        if name.endswith(".weight_shape"):
            module = name.removesuffix(".weight_shape")
            n, k = shape.tolist()
            bf16 += 2 * n * k
            after += sum(
                t.numel() * t.element_size()
                for key, t in tensors.items()
                if key.rsplit(".", 1)[0] == module
            )
    return after / bf16


def run_autoround(
    python: Path,
    model_dir: Path,
    calibration: Path,
    group: int,
    steps: int,
    threads: int,
    workdir: Path,
    symmetric: bool = True,
) -> tuple[Path, float]:
    """AutoRound's folder in our layout and its compression seconds. Raises
    RuntimeError with the subprocess's last output when it fails."""
    kind = "sym" if symmetric else "asym"
    out = workdir / f"autoround-g{group}-{kind}-gptq"
    cmd = [
        str(python),
        str(RUNNER),
        "--model-dir",
        str(model_dir),
        "--calibration",
        str(calibration),
        "--out",
        str(out),
        "--group-size",
        str(group),
        "--iters",
        str(steps),
        "--threads",
        str(threads),
        *([] if symmetric else ["--asym"]),
    ]
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"AutoRound failed (exit {proc.returncode}):\n{tail}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = [p for p in out.iterdir() if (p / "config.json").exists()]
    saved = saved[0] if saved else out
    folder = workdir / f"autoround-g{group}-{kind}"
    convert(saved, folder, symmetric=symmetric, tokenizer_dir=model_dir)
    overrides: dict[int, int] = {}
    for layer in info["layer_config"].values():
        overrides[layer["group_size"]] = overrides.get(layer["group_size"], 0) + 1
    print(
        f"AutoRound {info['auto_round']} (torch {info['torch']}): group {group}, "
        f"overridden per layer: {overrides or 'none'} (Linears: count)",
        flush=True,
    )
    return folder, float(info["seconds"])


def run_ours(
    model_dir: Path, options: dict, group: int, size: tuple[int, int], steps: int, out
) -> tuple[Path, float]:
    """Our folder and its compression seconds (`compress` end to end), signround
    at `steps` steps per layer."""
    recipe = {"weights": f"w4a16-g{group}", "kv_cache_dtype": "bf16", **options}
    start = time.monotonic()
    result = compress(
        model_dir, recipe, out, calibration_size=size, signround_steps=steps
    )
    return Path(result.out_dir), time.monotonic() - start


def render(results: list[Result]) -> str:
    slices = [s.name for s in results[0].report.slices if s.name != "overall"]
    head = (
        f"{'recipe':<28} {'group':>5} {'linear/bf16':>11} {'KLD overall':>12} "
        + " ".join(f"{'KLD ' + n:>16}" for n in slices)
        + f" {'top-1':>7} {'compress s':>10}"
    )
    lines = [head]
    for r in results:
        by = {s.name: s for s in r.report.slices}
        lines.append(
            f"{r.label:<28} {r.group:>5} {r.linear_ratio:>11.3f} "
            f"{r.overall().mean_kld:>12.5f} "
            + " ".join(f"{by[n].mean_kld:>16.5f}" for n in slices)
            + f" {100 * r.overall().same_top1:>6.2f}% {r.seconds:>10.0f}"
        )
    return "\n".join(lines)


def verdict(results: list[Result]) -> tuple[str, bool]:
    """Per group and format (symmetric, and asymmetric where AutoRound ran it):
    AutoRound's row vs our best (lowest overall KLD) row of the same format. Our
    asymmetric rows without an AutoRound asymmetric row are information."""
    lines, ok = [], True
    for group in sorted({r.group for r in results}, reverse=True):
        for symmetric in (True, False):
            rows = [r for r in results if r.group == group and r.symmetric == symmetric]
            peers = [r for r in rows if r.label.startswith("AutoRound")]
            ours = [r for r in rows if not r.label.startswith("AutoRound")]
            if not ours:
                continue
            best = min(ours, key=lambda r: r.overall().mean_kld)
            kind = "sym" if symmetric else "asym"
            if not peers:
                lines.append(
                    f"g{group} {kind}: ours best '{best.label}' KLD "
                    f"{best.overall().mean_kld:.5f} in {best.seconds:.0f} s (no "
                    "AutoRound row of this format: information)"
                )
                continue
            peer = peers[0]
            kld_ok = best.overall().mean_kld <= peer.overall().mean_kld
            time_ok = best.seconds <= peer.seconds
            size_ok = best.linear_ratio <= SIZE_TARGET
            ok &= kld_ok and time_ok and size_ok
            lines.append(
                f"g{group} {kind}: ours best '{best.label}' KLD "
                f"{best.overall().mean_kld:.5f} vs AutoRound "
                f"{peer.overall().mean_kld:.5f} "
                f"({best.overall().mean_kld / peer.overall().mean_kld:.2f}x) "
                f"{'PASS' if kld_ok else 'FAIL'}; time {best.seconds:.0f} s vs "
                f"{peer.seconds:.0f} s ({best.seconds / peer.seconds:.2f}x) "
                f"{'PASS' if time_ok else 'FAIL'}; linear {best.linear_ratio:.3f} "
                f"<= {SIZE_TARGET} {'PASS' if size_ok else 'FAIL'}"
            )
    return "\n".join(lines), ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuagent.benches.autoround_compare",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument(
        "--setup", action="store_true", help="create --venv from PyPI first"
    )
    parser.add_argument("--groups", type=int, nargs="+", default=[128])
    parser.add_argument("--steps", type=int, default=signround.DEFAULT_STEPS)
    parser.add_argument("--sequences", type=int, default=DEFAULT_NUM_SEQUENCES)
    parser.add_argument("--tokens", type=int, default=DEFAULT_SEQUENCE_TOKENS)
    parser.add_argument("--max-items", type=int, default=None, help="per slice")
    parser.add_argument(
        "--recipes", nargs="+", default=None, help=f"ours: {[o[0] for o in OURS]}"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--autoround-asym",
        action="store_true",
        help="also run AutoRound asymmetric (the peer of our asymmetric recipes)",
    )
    args = parser.parse_args(argv)
    ours = [o for o in OURS if args.recipes is None or o[0] in args.recipes]
    unknown = set(args.recipes or ()) - {o[0] for o in OURS}
    if unknown:
        parser.error(
            f"unknown recipes {sorted(unknown)}; known: {[o[0] for o in OURS]}"
        )
    if args.setup and not args.venv.exists():
        setup_venv(args.venv)
    python = args.venv / "bin" / "python"
    if not python.exists():
        parser.error(f"{python} not found: create it with --setup")
    torch.set_num_threads(args.threads)
    settings = Settings(max_items=args.max_items)  # every slice
    size = (args.sequences, args.tokens)
    print(
        f"model {args.model_dir}; {args.sequences} calibration sequences x "
        f"{args.tokens} tokens, {args.steps} sign-gradient steps per block (both "
        f"sides), {args.threads} threads; quality vs the parent in float32 over "
        f"{', '.join(settings.slices)}, {args.max_items or 'all'} items per slice",
        flush=True,
    )
    reference = EngineModel(args.model_dir, "bf16", max_tokens=1024)
    results: list[Result] = []

    def score(label, group, symmetric, folder: Path, seconds: float) -> None:
        candidate = EngineModel(folder, "bf16", max_tokens=1024)
        report = evaluate_quality(candidate, reference, settings)
        ratio = linear_ratio(folder)
        results.append(Result(label, group, symmetric, ratio, seconds, report))
        print(render(results[-1:]).splitlines()[-1], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        calibration = workdir / "calibration.json"
        tokenizer = load_tokenizer(args.model_dir)
        calibration.write_text(json.dumps(calibration_sequences(tokenizer, *size)))
        for group in args.groups:
            for symmetric in (True, False) if args.autoround_asym else (True,):
                folder, seconds = run_autoround(
                    python,
                    args.model_dir,
                    calibration,
                    group,
                    args.steps,
                    args.threads,
                    workdir,
                    symmetric,
                )
                kind = "sym" if symmetric else "asym"
                score(f"AutoRound ({kind})", group, symmetric, folder, seconds)
            for label, options in ours:
                out = workdir / f"ours-g{group}-{label.replace(' ', '_')}"
                folder, seconds = run_ours(
                    args.model_dir, options, group, size, args.steps, out
                )
                score(label, group, options.get("symmetric", True), folder, seconds)
    print("\n" + render(results))
    text, ok = verdict(results)
    print("\n" + text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
