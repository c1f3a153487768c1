"""Side-by-side benchmark of the kernels: `python -m kernels.bench [--quick]
[--matmul-only]`.

For each op and dtype it prints the time, the effective bandwidth (bytes the op must
move / time) and the speed ratio to the bf16 path measured in the same run. On CUDA
it times the Triton kernels with `triton.testing.do_bench` at the issue's target
shapes (decode: batch 32 at 32k context; int4 matmul 4096x14336 at batch 1..16 vs
bf16 `torch.matmul`) and prints % of HBM bandwidth (H200: 4.8 TB/s). On the CPU it
times the torch reference path at small shapes and prints the same table, the
weight-only matmuls also through torch's CPU kernels (prepacked weights).

On CUDA only (`--mla-only` for these rows alone), MLA decode at DeepSeek-V3's
published dimensions (kv_lora_rank 512, RoPE 64, 128 heads, batch 32) at a few
context lengths, per latent cache dtype: the torch path ("mla_torch", the gathered
float32 reference) and the Triton kernel ("mla_decode"); their ratio column is the
torch path's time / this time (mla_torch's own row reads 1.00).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels import (
    int4_cpu,
    kv_quant,
    matmul_tuning,
    mla_attention,
    paged_attention,
    weight_matmul,
)
from kernels._triton import HAS_TRITON, triton

HBM_BYTES_PER_S = 4.8e12  # H200
KV_DTYPES = ("bf16", "fp8-per-token", "int8", "int4")
# Attention rows: (label, cache dtype, full-precision window); int4+w16 is int4 as
# the engine serves it, with each sequence's newest 16 tokens in bf16.
ATTENTION_CACHES = tuple((d, d, 0) for d in KV_DTYPES) + (("int4+w16", "int4", 16),)
# The MLA latent cache's serving dtypes (gpuagent.engine.mla; int4 is refused there)
MLA_KV_DTYPES = ("bf16", "int8", "fp8-per-token", "fp8")
# DeepSeek-V3 (and Kimi K2): kv_lora_rank, qk_rope_head_dim, attention heads, and
# the score scale (qk_nope_head_dim 128 + rope 64)^-1/2 (YaRN's mscale^2 left out:
# a constant factor, the same work)
DEEPSEEK_V3_MLA = (512, 64, 128)
DEEPSEEK_V3_SOFTMAX_SCALE = (128 + 64) ** -0.5


def time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Milliseconds per call: do_bench on CUDA; on the CPU the fastest of `reps`
    perf_counter runs (the least disturbed by other processes on shared cores)."""
    if device == "cuda" and HAS_TRITON:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


class Table:
    """Prints rows as they are measured; ratio is bf16 time / this time."""

    def __init__(self, device: str):
        self.device = device
        cols = f"{'op':<14} {'dtype':<10} {'shape':<30} {'ms':>9} {'GB/s':>9}"
        if device == "cuda":
            cols += f" {'%HBM':>6}"
        print(cols + f" {'x vs bf16':>9}")

    def row(self, op, dtype, shape, ms, nbytes, bf16_ms) -> None:
        gbps = nbytes / (ms * 1e-3) / 1e9
        line = f"{op:<14} {dtype:<10} {shape:<30} {ms:>9.3f} {gbps:>9.1f}"
        if self.device == "cuda":
            line += f" {100 * gbps * 1e9 / HBM_BYTES_PER_S:>6.1f}"
        print(line + f" {bf16_ms / ms:>9.2f}", flush=True)


def fill_random(cache: kv_quant.PagedKVCache) -> None:
    """Random codes straight into the storage (speed does not depend on values)."""
    for store, scale in (
        (cache.key, cache.key_scale),
        (cache.value, cache.value_scale),
    ):
        if store.numel() == 0:  # an MLA cache's value: width 0
            continue
        flat = store.view(-1, store.shape[-1])
        for rows in torch.split(flat, 1 << 20):  # bounded temporaries
            if cache.dtype in ("bf16", "fp16"):
                rows.normal_()
            elif cache.stores_fp8:
                rows.copy_(torch.randn(rows.shape, device=rows.device))
            elif cache.dtype == "int8":
                rows.copy_(torch.randint_like(rows, -127, 128))
            else:
                rows.copy_(torch.randint_like(rows, 0, 256))
        if scale is not None:
            scale.fill_(0.01)


def shuffled_block_tables(
    batch: int, tokens: int, block_size: int, device: str
) -> tuple[int, torch.Tensor]:
    """Pool size and block tables [batch, blocks per seq] int32 for `tokens` per
    sequence, the physical blocks shuffled across sequences."""
    blocks_per_seq = triton.cdiv(tokens, block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int64)
    return num_blocks, tables.view(batch, blocks_per_seq).to(torch.int32)


def attention_cache(dtype, window, num_blocks, block_size, shape, batch, device):
    """A randomly filled cache for an attention row, with one window row per
    sequence when `window`, and the window_rows argument (or None)."""
    _, num_kv_heads, head_dim, _ = shape
    cache = kv_quant.allocate_kv_cache(
        dtype,
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        device=device,
        window=window,
        num_windows=batch if window else 0,
    )
    fill_random(cache)
    if not window:
        return cache, None
    cache.window_key.normal_()
    cache.window_value.normal_()
    return cache, torch.arange(batch, dtype=torch.int32, device=device)


def bench_write_kv(table: Table, device: str, num_tokens: int, reps: int) -> None:
    num_kv_heads, head_dim, block_size = 8, 128, 16
    num_blocks = triton.cdiv(num_tokens, block_size)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    key, value = key.bfloat16(), torch.randn_like(key).bfloat16()
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    bf16_ms = None
    for dtype in KV_DTYPES:
        cache = kv_quant.allocate_kv_cache(
            dtype, num_blocks, block_size, num_kv_heads, head_dim, device=device
        )
        ms = time_ms(
            lambda c=cache: kv_quant.write_kv(c, key, value, slots), device, reps
        )
        bf16_ms = bf16_ms or ms
        written = num_tokens * kv_quant.kv_bytes_per_token(
            dtype, num_kv_heads, head_dim
        )
        nbytes = 2 * key.numel() * key.element_size() + written + slots.numel() * 8
        shape = f"T={num_tokens} Hkv={num_kv_heads} D={head_dim}"
        table.row("write_kv", dtype, shape, ms, nbytes, bf16_ms)


def bench_decode(table, device, batch, context, shape, reps) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    num_blocks, tables = shuffled_block_tables(batch, context, block_size, device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, device=device).bfloat16()
    bf16_ms = None
    for label, dtype, window in ATTENTION_CACHES:
        cache, rows = attention_cache(
            dtype, window, num_blocks, block_size, shape, batch, device
        )

        def run(c=cache, rows=rows):
            paged_attention.paged_decode_attention(
                query, c, tables, lens, head_dim**-0.5, rows
            )

        ms = time_ms(run, device, reps)
        bf16_ms = bf16_ms or ms
        kv = (
            batch * context * kv_quant.kv_bytes_per_token(dtype, num_kv_heads, head_dim)
        )
        kv += batch * kv_quant.kv_window_bytes(num_kv_heads, head_dim, window)
        nbytes = kv + 2 * query.numel() * query.element_size()
        desc = f"B={batch} ctx={context} H={num_heads}/{num_kv_heads} D={head_dim}"
        table.row("decode_attn", label, desc, ms, nbytes, bf16_ms)
        del cache
        if device == "cuda":
            torch.cuda.empty_cache()


def bench_prefill(table, device, batch, new_tokens, shape, reps) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    num_blocks, tables = shuffled_block_tables(batch, new_tokens, block_size, device)
    lens = torch.full((batch,), new_tokens, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32) * new_tokens
    query = torch.randn(batch * new_tokens, num_heads, head_dim, device=device)
    query = query.bfloat16()
    # the chunks' own K/V, which a prefill with a window reads in full precision
    new_kv = torch.randn(batch * new_tokens, num_kv_heads, head_dim, device=device)
    new_kv = new_kv.bfloat16()
    bf16_ms = None
    for label, dtype, window in ATTENTION_CACHES:
        cache, rows = attention_cache(
            dtype, window, num_blocks, block_size, shape, batch, device
        )
        chunk_kv = (new_kv, new_kv) if window else (None, None)

        def run(c=cache, rows=rows, chunk_kv=chunk_kv):
            paged_attention.paged_prefill_attention(
                query, c, tables, qsl, lens, head_dim**-0.5, rows, *chunk_kv
            )

        ms = time_ms(run, device, reps)
        bf16_ms = bf16_ms or ms
        kv = lens.sum().item() * kv_quant.kv_bytes_per_token(
            dtype, num_kv_heads, head_dim
        )
        kv += batch * kv_quant.kv_window_bytes(num_kv_heads, head_dim, window)
        nbytes = kv + 2 * query.numel() * query.element_size()
        desc = f"B={batch} new={new_tokens} H={num_heads}/{num_kv_heads} D={head_dim}"
        table.row("prefill_attn", label, desc, ms, nbytes, bf16_ms)


def mla_latent_cache(dtype, num_blocks, block_size, rank, rope, device):
    """A randomly filled MLA latent cache laid out as `gpuagent.engine.mla`'s
    allocate_mla_cache lays it out: key [num_blocks, block_size, 1, rank + rope],
    a value of width 0; fp8-per-token a float16 scale per token and part
    [num_blocks, block_size, 2], int8 and fp8 the latent's static float32 scale
    [1] and the (int8) RoPE key's float16 scale per token [num_blocks,
    block_size]."""
    storage = {
        "bf16": torch.bfloat16,
        "int8": torch.int8,
        "fp8-per-token": torch.float8_e4m3fn,
        "fp8": torch.float8_e4m3fn,
    }[dtype]
    shape = (num_blocks, block_size, 1, rank + rope)
    key = torch.empty(shape, dtype=storage, device=device)
    scale = rope_scale = None
    if dtype == "fp8-per-token":
        scale = torch.empty(shape[:2] + (2,), dtype=kv_quant.SCALE_DTYPE, device=device)
    elif dtype in ("int8", "fp8"):
        scale = torch.empty(1, dtype=torch.float32, device=device)
        rope_scale = torch.full(
            shape[:2], 0.01, dtype=kv_quant.SCALE_DTYPE, device=device
        )
    cache = kv_quant.PagedKVCache(
        dtype=dtype,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=1,
        head_dim=rank + rope,
        key=key,
        value=key.new_empty(shape[:3] + (0,)),
        key_scale=scale,
        value_scale=None,
        rope_scale=rope_scale,
    )
    fill_random(cache)
    return cache


def bench_mla_decode(
    table, device, batch, context, reps, dims=DEEPSEEK_V3_MLA, kernel_impl="auto"
) -> None:
    """MLA decode per latent dtype: the torch path, then the kernel (ratio: torch
    time / time). `kernel_impl` "triton" runs the kernel interpreted on a CPU."""
    rank, rope, num_heads = dims
    block_size = 16
    num_blocks, tables = shuffled_block_tables(batch, context, block_size, device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q_lat = torch.randn(batch, num_heads, rank, device=device).bfloat16()
    q_pe = torch.randn(batch, num_heads, rope, device=device).bfloat16()
    for dtype in MLA_KV_DTYPES:
        cache = mla_latent_cache(dtype, num_blocks, block_size, rank, rope, device)

        def run(impl, c=cache):
            mla_attention.mla_decode_attention(
                q_lat, q_pe, c, tables, lens, DEEPSEEK_V3_SOFTMAX_SCALE, impl=impl
            )

        torch_ms = time_ms(lambda: run("reference"), device, reps)
        ms = time_ms(lambda: run(kernel_impl), device, reps)
        per_token = (rank + rope) * cache.key.element_size()
        if cache.key_scale is not None and not cache.static_scales:
            per_token += 2 * kv_quant.SCALE_DTYPE.itemsize
        if cache.rope_scale is not None:  # int8's / fp8's int8 RoPE key
            per_token += kv_quant.SCALE_DTYPE.itemsize
        queries = (q_lat.numel() + q_pe.numel()) * q_lat.element_size()
        nbytes = batch * context * per_token + queries + q_lat.numel() * 2
        desc = f"B={batch} ctx={context} H={num_heads} R={rank}+{rope}"
        table.row("mla_torch", dtype, desc, torch_ms, nbytes, torch_ms)
        table.row("mla_decode", dtype, desc, ms, nbytes, torch_ms)
        del cache
        if device == "cuda":
            torch.cuda.empty_cache()


def bench_matmul(table, device, n, k, batches, reps) -> None:
    """bf16 torch.matmul, then each weight-only op as the public op runs it: Triton
    on CUDA, with the launch config tuned for this shape first (each pick and the
    heuristic's time printed); on a CPU the torch reference ("ref") and torch's CPU
    kernels over a weight prepacked once ("cpu"; rows left out where they don't
    apply), and at decode batches a float32 model's path: dense float32 ("fp32")
    and `kernels.int4_cpu`'s fused kernel ("int4 f32")."""
    w = (torch.randn(n, k, device=device) * 0.02).bfloat16()
    packed, scale4 = weight_matmul.quantize_weight_int4(w)
    q8, scale8 = weight_matmul.quantize_weight_int8(w)
    on_cpu = device == "cpu"
    cpu8 = weight_matmul.prepack_int8_cpu(q8, scale8) if on_cpu else None
    cpu4 = weight_matmul.prepack_int4_cpu(packed, scale4, 128) if on_cpu else None
    ref = " ref" if on_cpu else ""
    if not on_cpu:  # the tiles this GPU does best with, as the engine tunes at load
        tuned = [b for b in batches if b <= weight_matmul.TUNED_MAX_M]
        for bits, group in ((8, None), (4, 128)):
            for r in matmul_tuning.tune(bits, n, k, group, tuned, device=device):
                print(
                    f"# tuned int{bits} M<={r.batch} N={n} K={k}: {r.config} "
                    f"{r.ms:.4f} ms (heuristic {r.heuristic_ms:.4f} ms, "
                    f"{r.candidates} candidates)",
                    flush=True,
                )
    w32, scale32 = (w.float(), scale4.float()) if on_cpu else (None, None)
    bytes8 = q8.numel() + n * 2
    bytes4 = packed.numel() * 4 + scale4.numel() * 2
    for m in batches:
        x = torch.randn(m, k, device=device).bfloat16()
        act_bytes = (m * k + m * n) * 2
        bf16_ms = time_ms(lambda x=x: torch.matmul(x, w.t()), device, reps)
        desc = f"M={m} N={n} K={k}"
        table.row("matmul", "bf16", desc, bf16_ms, w.numel() * 2 + act_bytes, bf16_ms)
        ms = time_ms(
            lambda x=x: weight_matmul.weight_int8_matmul(x, q8, scale8), device, reps
        )
        table.row("matmul", "int8" + ref, desc, ms, bytes8 + act_bytes, bf16_ms)
        if cpu8 is not None:
            ms = time_ms(
                lambda x=x: weight_matmul.weight_int8_matmul(
                    x, q8, scale8, cpu_weight=cpu8
                ),
                device,
                reps,
            )
            table.row("matmul", "int8 cpu", desc, ms, bytes8 + act_bytes, bf16_ms)
        ms = time_ms(
            lambda x=x: weight_matmul.weight_int4_matmul(x, packed, scale4),
            device,
            reps,
        )
        table.row("matmul", "int4" + ref, desc, ms, bytes4 + act_bytes, bf16_ms)
        if cpu4 is not None:
            ms = time_ms(
                lambda x=x: weight_matmul.weight_int4_matmul(
                    x, packed, scale4, cpu_weight=cpu4
                ),
                device,
                reps,
            )
            table.row("matmul", "int4 cpu", desc, ms, bytes4 + act_bytes, bf16_ms)
        if on_cpu and int4_cpu.AVAILABLE and m <= int4_cpu.MAX_ROWS:
            # a float32 model's decode: dense float32 vs the fused int4 kernel
            x32 = x.float()
            act32 = 2 * act_bytes
            ms = time_ms(lambda x32=x32: torch.matmul(x32, w32.t()), device, reps)
            table.row("matmul", "fp32", desc, ms, w.numel() * 4 + act32, bf16_ms)
            ms = time_ms(
                lambda x32=x32: weight_matmul.weight_int4_matmul(x32, packed, scale32),
                device,
                reps,
            )
            table.row("matmul", "int4 f32", desc, ms, bytes4 + act32, bf16_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller shapes")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--matmul-only", action="store_true", help="only the weight-only matmul rows"
    )
    parser.add_argument(
        "--mla-only", action="store_true", help="only the MLA decode rows (CUDA)"
    )
    args = parser.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    on_gpu = device == "cuda"
    path = "triton kernels" if on_gpu else "torch reference and CPU kernels (CPU)"
    name = torch.cuda.get_device_name() if on_gpu else "cpu"
    print(f"# kernels.bench on {name}: {path}; ratio = bf16 time / time")
    if args.mla_only and not on_gpu:
        print("# the MLA decode rows run on CUDA only")
        return
    table = Table(device)
    reps = 5 if not args.quick else 2
    if on_gpu:
        mla_contexts = [4096] if args.quick else [1024, 4096, 16384]
        if args.mla_only:
            print("# mla rows: ratio = torch path time / kernel time")
            for context in mla_contexts:
                bench_mla_decode(table, device, 32, context, reps)
            return
        batches = [1, 16] if args.quick else [1, 2, 4, 8, 16, 64, 256]
        bench_matmul(table, device, 14336, 4096, batches, reps)
        bench_matmul(table, device, 4096, 14336, batches, reps)
        if args.matmul_only:
            return
        bench_write_kv(table, device, 16384, reps)
        contexts = [4096] if args.quick else [4096, 32768]
        for context in contexts:
            bench_decode(table, device, 32, context, (32, 8, 128, 16), reps)
        bench_decode(table, device, 32, 4096, (16, 4, 64, 32), reps)  # demo-like
        bench_prefill(table, device, 4, 2048, (32, 8, 128, 16), reps)
        print("# mla rows: ratio = torch path time / kernel time")
        for context in mla_contexts:
            bench_mla_decode(table, device, 32, context, reps)
    else:
        batches = [1, 16] if args.quick else [1, 4, 16]
        bench_matmul(table, device, 1024, 2048, batches, reps)
        if args.matmul_only:
            return
        bench_write_kv(table, device, 512 if args.quick else 2048, reps)
        context = 512 if args.quick else 2048
        bench_decode(table, device, 4, context, (8, 2, 64, 16), reps)
        bench_prefill(
            table, device, 2, 128 if args.quick else 256, (8, 2, 64, 16), reps
        )


if __name__ == "__main__":
    main()
