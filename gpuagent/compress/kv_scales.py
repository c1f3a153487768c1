"""Static fp8 KV-cache scales written into the compressed checkpoint.

The scales are the engine's fp8 (static) layout (`gpuagent.engine.kv_calibration`):
per layer and per kv head, absmax / 448 of K and V as the model writes them into
its cache before any rotation (vLLM's k_scale/v_scale convention, so the checkpoint
is portable; the engine serves a checkpoint's scales with an unrotated fp8 cache,
gpuagent.engine.kv_calibration). They are stored as
`model.layers.N.self_attn.k_scale` / `v_scale`, float32 [kv_heads, 1, 1], with
`kv_cache_scheme` strategy "attn_head" (compressed-tensors' per-head KV scheme).
"""

from __future__ import annotations

import torch

from gpuagent.engine.kv_calibration import static_kv_scales

KV_SCALE_SHAPE_SUFFIX = (1, 1)


def kv_cache_scheme() -> dict:
    """config.json `quantization_config.kv_cache_scheme` for the scales written."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "attn_head",
        "dynamic": False,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def kv_scale_tensors(model, sequences) -> dict[str, torch.Tensor]:
    """k_scale / v_scale of every layer, calibrated on `sequences` (token ids) with
    the model as it now is (its weights already quantized)."""
    tensors = {}
    for i, (k, v) in enumerate(static_kv_scales(model, sequences, rotated=False)):
        prefix = f"model.layers.{i}.self_attn"
        tensors[f"{prefix}.k_scale"] = k.float().reshape(-1, *KV_SCALE_SHAPE_SUFFIX)
        tensors[f"{prefix}.v_scale"] = v.float().reshape(-1, *KV_SCALE_SHAPE_SUFFIX)
    return tensors
