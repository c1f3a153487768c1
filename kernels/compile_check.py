"""Compile the Triton kernels for a GPU target without a GPU: `python -m
kernels.compile_check [kv_quant|paged_attention|mla_attention|weight_matmul ...]`.

The interpreter (TRITON_INTERPRET=1) runs kernels as Python and accepts constructs
the real compiler rejects; this lowers each kernel, at the configurations the
launchers use, through Triton's real pipeline to sm_90 PTX/cubin (ptxas ships with
triton), so a CPU-only machine still catches kernels that would not build on an
H100/H200. Must run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import os
import sys

# Argument types per kernel (pointer element types as Triton spells them).
_WRITE_SIG = {
    "key_ptr": "*bf16",
    "value_ptr": "*bf16",
    "slot_ptr": "*i64",
    "key_cache_ptr": None,  # per dtype
    "value_cache_ptr": None,
    "key_scale_ptr": "*fp16",
    "value_scale_ptr": "*fp16",
    "window_slot_ptr": "*i64",
    "key_window_ptr": "*bf16",
    "value_window_ptr": "*bf16",
    "stride_kt": "i32",
    "stride_kh": "i32",
    "stride_vt": "i32",
    "stride_vh": "i32",
    "num_kv_heads": "i32",
}
_DECODE_SIG = {
    "q_ptr": "*bf16",
    "k_cache_ptr": None,
    "v_cache_ptr": None,
    "k_scale_ptr": "*fp16",
    "v_scale_ptr": "*fp16",
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "window_rows_ptr": "*i32",
    "k_window_ptr": "*bf16",
    "v_window_ptr": "*bf16",
    "part_out_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "out_ptr": "*bf16",
    "softmax_scale": "fp32",
    "num_kv_heads": "i32",
    "stride_bt": "i32",
    "num_parts": "i32",
}
# int4c's mean-term arguments (the int4 decode kernel's and the prefill kernel's),
# after the output pointer
_CENTERED_SIG = {
    "q_model_ptr": "*fp32",
    "key_mean_ptr": "*fp32",
    "inv_freq_ptr": "*fp32",
}
_DECODE_INT4_SIG = {}
for _name, _type in _DECODE_SIG.items():
    _DECODE_INT4_SIG[_name] = _type
    if _name == "out_ptr":
        _DECODE_INT4_SIG.update(_CENTERED_SIG)
_PREFILL_SIG = {
    "q_ptr": "*bf16",
    "k_cache_ptr": None,
    "v_cache_ptr": None,
    "k_scale_ptr": "*fp16",
    "v_scale_ptr": "*fp16",
    "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "window_rows_ptr": "*i32",
    "k_window_ptr": "*bf16",
    "v_window_ptr": "*bf16",
    "k_new_ptr": "*bf16",
    "v_new_ptr": "*bf16",
    "stride_knt": "i32",
    "stride_knh": "i32",
    "stride_vnt": "i32",
    "stride_vnh": "i32",
    "tile_seq_ptr": "*i32",
    "tile_start_ptr": "*i32",
    "out_ptr": "*bf16",
    **_CENTERED_SIG,
    "softmax_scale": "fp32",
    "num_kv_heads": "i32",
    "stride_bt": "i32",
}
_REDUCE_SIG = {
    "part_out_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "out_ptr": "*bf16",
    "num_parts": "i32",
}
_MLA_DECODE_SIG = {
    "q_lat_ptr": "*bf16",
    "q_pe_ptr": "*bf16",
    "cache_ptr": None,  # per dtype
    "scale_ptr": "*fp16",
    "rope_scale_ptr": "*fp16",
    "block_tables_ptr": "*i32",
    "context_lens_ptr": "*i32",
    "part_out_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
    "out_ptr": "*bf16",
    "softmax_scale": "fp32",
    "num_heads": "i32",
    "stride_bt": "i32",
    "num_parts": "i32",
}
_MATMUL_SIG = {
    "x_ptr": "*bf16",
    "w_ptr": None,
    "scale_ptr": "*bf16",
    "part_ptr": "*fp32",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_xm": "i32",
    "stride_wn": "i32",
}
_STORAGE = {0: "*bf16", 1: "*u8", 2: "*i8", 3: "*u8", 4: "*u8"}
# Full-precision window length of the WINDOW > 0 variants (quantized codes only).
_WINDOW = 64


def _configs(module: str):
    """(name, kernel, signature, constexprs, num_warps) to compile for `module`."""
    from kernels import kv_quant, mla_attention, paged_attention, weight_matmul

    if module == "kv_quant":
        for code, qmax in ((0, 1.0), (1, 448.0), (2, 127.0), (3, 7.5)):
            sig = dict(_WRITE_SIG, key_cache_ptr=_STORAGE[code])
            sig["value_cache_ptr"] = _STORAGE[code]
            consts = {
                "HEAD_DIM": 128,
                "STORED_DIM": 64 if code == 3 else 128,
                "KV_DTYPE": code,
                "QMAX": qmax,
                "CACHE_BF16": code == 0,
            }
            for window in (0, _WINDOW) if code else (0,):
                consts = dict(consts, WINDOW=window, STATIC_SCALES=False)
                name = f"write_kv[{code},W{window}]"
                yield name, kv_quant._write_kv_kernel, sig, consts, 1
        # fp8: one float32 scale per head, read, never written
        sig = dict(_WRITE_SIG, key_cache_ptr=_STORAGE[1], value_cache_ptr=_STORAGE[1])
        sig.update(key_scale_ptr="*fp32", value_scale_ptr="*fp32")
        consts = dict(consts, KV_DTYPE=1, QMAX=448.0, STATIC_SCALES=True)
        yield "write_kv[fp8]", kv_quant._write_kv_kernel, sig, consts, 1
        # fp32 storage: code 0 without the bf16 rounding, a plain float32 store.
        sig = dict(_WRITE_SIG, key_cache_ptr="*fp32", value_cache_ptr="*fp32")
        consts = {"HEAD_DIM": 128, "STORED_DIM": 128, "KV_DTYPE": 0, "QMAX": 1.0}
        consts["CACHE_BF16"] = False
        consts["WINDOW"] = 0
        consts["STATIC_SCALES"] = False
        yield "write_kv[fp32]", kv_quant._write_kv_kernel, sig, consts, 1
    elif module == "paged_attention":
        # (KV_DTYPE code, GQA group, head_dim, block_size); code 4 = int4c, the
        # int4 decode kernel with CENTERED (bf16 RoPE rounding at D128, fp32 at D64)
        shapes = ((0, 1, 128, 16), (2, 4, 128, 16), (1, 8, 64, 32), (3, 4, 128, 16),
                  (3, 8, 64, 32), (4, 4, 128, 16), (4, 8, 64, 32))  # fmt: skip
        for code, group, head_dim, block_size in shapes:
            kernel = paged_attention._paged_decode_kernel
            sig = _DECODE_SIG
            if code >= 3:
                kernel = paged_attention._paged_decode_int4_kernel
                sig = _DECODE_INT4_SIG
            sig = dict(sig, k_cache_ptr=_STORAGE[code], v_cache_ptr=_STORAGE[code])
            consts = {
                "GROUP": group,
                "GROUP_PAD": 16,
                "HEAD_DIM": head_dim,
                "BLOCK_SIZE": block_size,
                "BLOCK_N": paged_attention.DECODE_BLOCK_N,
                "PARTITION_SIZE": paged_attention.PARTITION_SIZE,
            }
            if code < 3:
                consts["KV_DTYPE"] = code
                consts["DOT_PRECISION"] = "tf32"
                consts["STATIC_SCALES"] = False
            else:
                consts["CENTERED"] = code == 4
                consts["ROPE_DTYPE"] = 1 if code == 4 and head_dim == 128 else 0
            # Both epilogues, spread over the shapes to keep the check short.
            single = group in (1, 8)
            consts["SINGLE_PART"] = single
            windows = (_WINDOW,) if code == 4 else (0, _WINDOW) if code else (0,)
            for window in windows:
                consts = dict(consts, WINDOW=window)
                name = f"decode[{code},G{group},D{head_dim},single={single},W{window}]"
                yield name, kernel, sig, consts, 4
        prefills = ((0, 1, 64), (2, 4, 128), (1, 8, 64), (3, 4, 128), (4, 4, 128),
                    (4, 2, 64))  # fmt: skip
        for code, group, head_dim in prefills:
            sig = dict(_PREFILL_SIG, k_cache_ptr=_STORAGE[code])
            sig["v_cache_ptr"] = _STORAGE[code]
            consts = {
                "GROUP": group,
                "HEAD_DIM": head_dim,
                "BLOCK_SIZE": 16,
                "BLOCK_M": paged_attention.PREFILL_BLOCK_M,
                "BLOCK_N": paged_attention.PREFILL_BLOCK_N,
                "KV_DTYPE": code,
                "DOT_PRECISION": "tf32",
                "STATIC_SCALES": False,
                "ROPE_DTYPE": (1 if head_dim == 128 else 2) if code == 4 else 0,
            }
            warps = 4 if head_dim <= 64 else 8
            kernel = paged_attention._paged_prefill_kernel
            windows = (_WINDOW,) if code == 4 else (0, _WINDOW) if code else (0,)
            for window in windows:
                consts = dict(consts, WINDOW=window)
                name = f"prefill[{code},G{group},D{head_dim},W{window}]"
                yield name, kernel, sig, consts, warps
        # fp32 KV: float32 storage read by the code-0 path, full-precision dots.
        fp32 = {"k_cache_ptr": "*fp32", "v_cache_ptr": "*fp32"}
        consts = {
            "GROUP": 4,
            "GROUP_PAD": 16,
            "HEAD_DIM": 64,
            "BLOCK_SIZE": 16,
            "BLOCK_N": paged_attention.DECODE_BLOCK_N,
            "PARTITION_SIZE": paged_attention.PARTITION_SIZE,
            "KV_DTYPE": 0,
            "DOT_PRECISION": "ieee",
            "SINGLE_PART": False,
            "WINDOW": 0,
            "STATIC_SCALES": False,
        }
        kernel = paged_attention._paged_decode_kernel
        yield "decode[fp32,G4,D64]", kernel, dict(_DECODE_SIG, **fp32), consts, 4
        consts = {
            "GROUP": 4,
            "HEAD_DIM": 64,
            "BLOCK_SIZE": 16,
            "BLOCK_M": paged_attention.PREFILL_BLOCK_M,
            "BLOCK_N": paged_attention.PREFILL_BLOCK_N,
            "KV_DTYPE": 0,
            "DOT_PRECISION": "ieee",
            "WINDOW": 0,
            "STATIC_SCALES": False,
            "ROPE_DTYPE": 0,
        }
        kernel = paged_attention._paged_prefill_kernel
        yield "prefill[fp32,G4,D64]", kernel, dict(_PREFILL_SIG, **fp32), consts, 4
        # fp8: fp8 storage, one float32 scale per kv head, with its window
        static = {"k_cache_ptr": _STORAGE[1], "v_cache_ptr": _STORAGE[1]}
        static.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        consts = dict(consts, KV_DTYPE=1, DOT_PRECISION="tf32", WINDOW=_WINDOW)
        consts["STATIC_SCALES"] = True
        sig = dict(_PREFILL_SIG, **static)
        yield "prefill[fp8,G4,D64,W]", kernel, sig, consts, 4
        consts = {
            "GROUP": 3,
            "GROUP_PAD": 16,
            "HEAD_DIM": 64,
            "BLOCK_SIZE": 16,
            "BLOCK_N": paged_attention.DECODE_BLOCK_N,
            "PARTITION_SIZE": paged_attention.PARTITION_SIZE,
            "KV_DTYPE": 1,
            "DOT_PRECISION": "tf32",
            "SINGLE_PART": True,
            "WINDOW": _WINDOW,
            "STATIC_SCALES": True,
        }
        kernel = paged_attention._paged_decode_kernel
        sig = dict(_DECODE_SIG, **static)
        yield "decode[fp8,G3,D64,W]", kernel, sig, consts, 4
        consts = {"HEAD_DIM": 128, "PARTS_BLOCK": 32}
        yield (
            "reduce",
            paged_attention._paged_decode_reduce_kernel,
            _REDUCE_SIG,
            consts,
            4,
        )
    elif module == "mla_attention":
        # (KV_DTYPE code, SCALES, RANK, ROPE, single partition): DeepSeek-V3's
        # 512 + 64 in every storage, the demo model's 64 + 16, a padded 48 + 8.
        # int8 and fp8 (SCALES 2): a static latent scale, the int8 RoPE key's
        # per token; fp8-per-token (SCALES 1) a scale per token and part.
        shapes = ((0, 0, 512, 64, False), (2, 2, 512, 64, True),
                  (1, 1, 512, 64, False), (1, 2, 512, 64, True),
                  (0, 0, 64, 16, True), (2, 2, 48, 8, False))  # fmt: skip
        for code, scales, rank, rope, single in shapes:
            sig = dict(_MLA_DECODE_SIG, cache_ptr=_STORAGE[code])
            if scales == 2:
                sig["scale_ptr"] = "*fp32"
            rank_pad = mla_attention._pad(rank)
            consts = {
                "RANK": rank,
                "ROPE": rope,
                "RANK_PAD": rank_pad,
                "ROPE_PAD": mla_attention._pad(rope),
                "HEAD_BLOCK": mla_attention.MLA_HEAD_BLOCK,
                "BLOCK_SIZE": 16,
                "BLOCK_N": mla_attention.MLA_BLOCK_N,
                "PARTITION_SIZE": mla_attention.PARTITION_SIZE,
                "KV_DTYPE": code,
                "SCALES": scales,
                "DOT_PRECISION": "tf32",
                "SINGLE_PART": single,
            }
            name = f"mla_decode[{code},S{scales},R{rank}+{rope},single={single}]"
            warps = mla_attention.num_warps(rank_pad)
            yield name, mla_attention._mla_decode_kernel, sig, consts, warps
        # fp32 latent: float32 storage, full-precision dots
        sig = dict(_MLA_DECODE_SIG, cache_ptr="*fp32", q_lat_ptr="*fp32")
        sig.update(q_pe_ptr="*fp32", out_ptr="*fp32")
        consts = dict(consts, KV_DTYPE=0, SCALES=0, DOT_PRECISION="ieee")
        name = "mla_decode[fp32,R48+8]"
        yield name, mla_attention._mla_decode_kernel, sig, consts, 4
    elif module == "weight_matmul":
        for m in (1, 64, 256):
            config = weight_matmul._tile_config(m)
            warps = config.num_warps
            tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
            tiles["BLOCK_K"] = config.block_k
            tiles["DOT_FP32"] = False
            sig8 = dict(_MATMUL_SIG, w_ptr="*i8", k_per_split="i32")
            yield f"int8[M{m}]", weight_matmul._int8_matmul_kernel, sig8, tiles, warps
            sig4 = dict(_MATMUL_SIG, w_ptr="*i32", stride_sn="i32", k_per_split="i32")
            consts = dict(tiles, GROUP_SIZE=128)
            yield f"int4[M{m}]", weight_matmul._int4_matmul_kernel, sig4, consts, warps
            if m == 1:  # no split: the kernel stores the bf16 output itself
                sig4 = dict(sig4, part_ptr="*bf16")
                kernel = weight_matmul._int4_matmul_kernel
                yield "int4[M1,direct]", kernel, sig4, consts, warps
        # the gemv kernel (a tuning candidate at decode), split and direct
        sig4 = dict(_MATMUL_SIG, w_ptr="*i32", stride_sn="i32", k_per_split="i32")
        for block_m, part in ((1, "*fp32"), (4, "*bf16")):
            consts = {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 128}
            consts.update(DOT_FP32=False, GROUP_SIZE=128)
            kernel = weight_matmul._int4_gemv_kernel
            yield f"int4_gemv[M{block_m}]", kernel, dict(sig4, part_ptr=part), consts, 4
        sig = {"part_ptr": "*fp32", "out_ptr": "*bf16", "numel": "i32"}
        consts = {"SPLIT_K": 4, "BLOCK": 1024}
        yield "sum_splits", weight_matmul._sum_splits_kernel, sig, consts, 4
    else:
        raise ValueError(f"unknown kernels module {module!r}")


def compile_module(module: str, arch: int = 90) -> list[str]:
    """Compile every configuration of `module` for sm_<arch>; return the failures."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    failures = []
    for name, kernel, sig, consts, num_warps in _configs(module):
        signature = dict(sig, **{k: "constexpr" for k in consts})
        src = ASTSource(fn=kernel, signature=signature, constexprs=consts)
        try:
            triton.compile(src, target=target, options={"num_warps": num_warps})
        except Exception as exc:  # report every kernel, not just the first
            failures.append(f"{module}.{name}: {type(exc).__name__}: {exc}")
    return failures


def main(argv: list[str] | None = None) -> int:
    modules = (argv if argv is not None else sys.argv[1:]) or [
        "kv_quant",
        "paged_attention",
        "mla_attention",
        "weight_matmul",
    ]
    failures = [f for module in modules for f in compile_module(module)]
    for line in failures:
        print("FAIL", line)
    print(f"compiled {', '.join(modules)} for sm_90: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
