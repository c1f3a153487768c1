"""Triton kernels with torch references for the serving engine.

Every public op runs its Triton kernel when its tensors are on CUDA and the torch
reference otherwise (the weight-only matmuls: torch's CPU kernels when given a
weight prepacked for them); `impl="triton" | "reference"` forces one (tests run the
Triton kernels on CPU tensors under TRITON_INTERPRET=1). Importing works without a
GPU.
"""

from kernels.kv_quant import (
    CENTERED_DTYPES,
    KV_CACHE_DTYPES,
    ROTATED_DTYPES,
    STATIC_SCALE_DTYPES,
    PagedKVCache,
    allocate_kv_cache,
    dequantize_kv,
    gather_kv,
    hadamard,
    kv_bytes_per_token,
    kv_static_bytes,
    kv_window_bytes,
    kv_writer_version,
    quantize_kv,
    set_static_scales,
    write_kv,
    write_window,
)
from kernels.mla_attention import mla_decode_attention
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kernels.weight_matmul import (
    CpuPackedWeight,
    dequantize_weight_int4,
    pack_int4,
    prepack_int4_cpu,
    prepack_int8_cpu,
    quantize_weight_int4,
    quantize_weight_int8,
    unpack_int4,
    weight_int4_matmul,
    weight_int8_matmul,
)

__all__ = [
    "CENTERED_DTYPES",
    "CpuPackedWeight",
    "KV_CACHE_DTYPES",
    "ROTATED_DTYPES",
    "STATIC_SCALE_DTYPES",
    "PagedKVCache",
    "allocate_kv_cache",
    "dequantize_kv",
    "dequantize_weight_int4",
    "gather_kv",
    "hadamard",
    "kv_bytes_per_token",
    "kv_static_bytes",
    "kv_window_bytes",
    "kv_writer_version",
    "mla_decode_attention",
    "pack_int4",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepack_int4_cpu",
    "prepack_int8_cpu",
    "quantize_kv",
    "set_static_scales",
    "quantize_weight_int4",
    "quantize_weight_int8",
    "unpack_int4",
    "weight_int4_matmul",
    "weight_int8_matmul",
    "write_kv",
    "write_window",
]
