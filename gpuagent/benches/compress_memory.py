"""Benchmark of compression at scale, one run, the two paths side by side:
`python -m gpuagent.benches.compress_memory [--sizes 0.5,1,2] [--recipe JSON]`.

For synthetic Llama-shaped float32 models of each size (GiB; `write_synthetic_llama`:
random weights, many layers, the demo model's tokenizer), each compressed in a
fresh child process by the in-memory path and the layer-by-layer path
(`gpuagent.compress.pipeline`): peak resident memory over the child's baseline
(its RSS after the imports, before `compress`; the peak is reset there,
`reset_peak_rss`) as a fraction of the model's bytes,
and the model's bytes per second of compression, and whether the two outputs hold
the same tensors. Target: the layer-by-layer path at <= 0.35x at 2 GiB, flat (not
growing) as the model grows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from gpuagent.benches import DEMO_MODEL_DIR
from gpuagent.compress.shard_writer import ShardWriter

TARGET_AT_2GIB = 0.35
DEFAULT_SIZES_GIB = (0.5, 1.0, 2.0)
DEFAULT_RECIPE = {"weights": "w8a16", "kv_cache_dtype": "bf16"}
# Shapes of the synthetic model's layers (a ~1B-parameter Llama's, narrower).
SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
}


def layer_params(shape: dict) -> int:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return h * q * 2 + h * kv * 2 + 3 * h * i + 2 * h


def write_synthetic_llama(
    folder: Path,
    size_bytes: int,
    *,
    shape: dict | None = None,
    seed: int = 0,
    shard_bytes: int = 256 << 20,
) -> int:
    """A float32 Llama folder of about `size_bytes` (untied head, random weights,
    as many layers as fit, at least 2) written layer by layer into shards with an
    index, so that writing it never holds the model; returns the layer count."""
    shape = dict(SHAPE if shape is None else shape)
    h, v = shape["hidden_size"], shape["vocab_size"]
    fixed = (2 * v * h + h) * 4
    layers = max(2, round((size_bytes - fixed) / (layer_params(shape) * 4)))
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    config |= shape | {"num_hidden_layers": layers, "tie_word_embeddings": False}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    g = torch.Generator().manual_seed(seed)
    writer = ShardWriter(folder, shard_bytes)

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g) * dims[-1] ** -0.5

    writer.add({"model.embed_tokens.weight": rand(v, h)})
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    inter = shape["intermediate_size"]
    for i in range(layers):
        p = f"model.layers.{i}."
        writer.add(
            {
                p + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                p + "self_attn.q_proj.weight": rand(q, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, q),
                p + "post_attention_layernorm.weight": torch.ones(h),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
            }
        )
    writer.add({"model.norm.weight": torch.ones(h), "lm_head.weight": rand(v, h)})
    writer.finish()
    return layers


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def measure(
    source: Path,
    recipe: dict,
    out: Path,
    sequential: bool,
    cap_bytes: int | None = None,
    **options,
) -> dict:
    """Compress in a fresh child (`--child`): its peak RSS over its baseline and
    the seconds `compress` took; `options` go to `compress`. With `cap_bytes`, the
    child's address space is capped (RLIMIT_AS) at its size after the imports plus
    `cap_bytes` (one malloc arena, 256 KiB thread stacks: glibc's per-thread
    reservations don't eat the cap), and a MemoryError comes back as
    {"memory_error": why}."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"} if cap_bytes else None
    child = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuagent.benches.compress_memory",
            "--child",
            json.dumps(
                {
                    "source": str(source),
                    "recipe": recipe,
                    "out": str(out),
                    "sequential": sequential,
                    "options": options,
                    "cap_bytes": cap_bytes,
                }
            ),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if child.returncode != 0:
        raise RuntimeError(f"compress child failed:\n{child.stderr[-4000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def _child(args: dict) -> None:
    import time

    from gpuagent.compress import compress

    torch.set_num_threads(1)  # the project's shared CPUs; both paths alike
    if args.get("cap_bytes"):
        import resource
        import threading

        # A thread's stack is reserved whole (8 MiB by default) and counts against
        # RLIMIT_AS: the file readers' threads would take the cap, not the data.
        threading.stack_size(256 << 10)
        limit = _status_bytes("VmSize") + args["cap_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    baseline = reset_peak_rss()
    started = time.monotonic()
    try:
        compress(
            args["source"],
            args["recipe"],
            args["out"],
            sequential=args["sequential"],
            **args.get("options", {}),
        )
    except MemoryError as exc:
        print(json.dumps({"memory_error": str(exc) or "MemoryError"}))
        return
    seconds = time.monotonic() - started
    print(json.dumps({"peak_over_baseline": peak_rss() - baseline, "seconds": seconds}))


def reset_peak_rss() -> int:
    """Reset this process's peak RSS (VmHWM) to its current RSS, which it returns:
    the peak read after is the peak since (Linux: /proc/self/clear_refs, "5")."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak RSS (VmHWM) in bytes."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two output folders hold the same tensors, byte for byte, and the
    same config."""
    from safetensors import safe_open

    def read(folder: Path) -> dict[str, bytes]:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open has no iterator
                    t = st.get_tensor(name).contiguous()
                    out[name] = (
                        (str(t.dtype), tuple(t.shape)),
                        bytes(t.reshape(-1).view(torch.uint8).numpy()),
                    )
        return out

    config = (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    return config and read(a) == read(b)


def run(sizes_gib, recipe: dict, shape: dict | None = None) -> Iterator[dict]:
    """One row per size, as each is measured."""
    with tempfile.TemporaryDirectory(prefix="compress-memory-") as tmp:
        tmp = Path(tmp)
        for gib in sizes_gib:
            source = tmp / f"source-{gib}"
            layers = write_synthetic_llama(source, int(gib * 2**30), shape=shape)
            size = model_bytes(source)
            row = {"size_gib": gib, "layers": layers, "model_bytes": size}
            for label, sequential in (("in_memory", False), ("layerwise", True)):
                m = measure(source, recipe, tmp / f"{label}-{gib}", sequential)
                row[label] = {
                    "peak_fraction": m["peak_over_baseline"] / size,
                    "peak_bytes": m["peak_over_baseline"],
                    "gb_per_s": size / m["seconds"] / 1e9,
                }
            row["same_tensors"] = same_tensors(
                tmp / f"in_memory-{gib}", tmp / f"layerwise-{gib}"
            )
            for label in ("in_memory", "layerwise", f"source-{gib}"):
                path = tmp / (label if label.startswith("source") else f"{label}-{gib}")
                shutil.rmtree(path)
            yield row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES_GIB)),
        help="model sizes in GiB, comma-separated (small ones for a quick run)",
    )
    parser.add_argument("--recipe", default=json.dumps(DEFAULT_RECIPE))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return
    sizes = [float(s) for s in args.sizes.split(",")]
    recipe = json.loads(args.recipe)
    print(f"recipe {json.dumps(recipe)}; peak RSS over baseline / model bytes")
    print(
        f"{'model':>9} {'layers':>6} | {'in-memory':>9} {'GB/s':>6} | "
        f"{'layerwise':>9} {'GB/s':>6} | same tensors"
    )
    for row in run(sizes, recipe):
        old, new = row["in_memory"], row["layerwise"]
        print(
            f"{row['size_gib']:>5} GiB {row['layers']:>6} | "
            f"{old['peak_fraction']:>8.2f}x {old['gb_per_s']:>6.3f} | "
            f"{new['peak_fraction']:>8.2f}x {new['gb_per_s']:>6.3f} | "
            f"{row['same_tensors']}",
            flush=True,
        )
    largest = max(sizes)
    print(
        f"target: layerwise <= {TARGET_AT_2GIB}x at 2 GiB "
        f"(largest measured: {largest} GiB)"
    )


if __name__ == "__main__":
    main()
