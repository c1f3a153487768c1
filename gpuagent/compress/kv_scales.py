"""Static fp8 KV-cache scales written into the compressed checkpoint.

The scales are the engine's fp8 (static) layout (`gpuagent.engine.kv_calibration`):
absmax / 448 of K and V as the model writes them into its cache before any rotation
(vLLM's k_scale/v_scale convention, so the checkpoint is portable; the engine serves
a checkpoint's scales with an unrotated fp8 cache, gpuagent.engine.kv_calibration).
They are stored as `model.layers.N.self_attn.k_scale` / `v_scale`, float32, in one
of two layouts (compressed-tensors `kv_cache_scheme` strategies):

- "tensor" (the default): one scale per layer, shape [1], the largest of the
  per-head scales. Every vLLM attention backend reads it.
- "attn_head": one scale per kv head, [kv_heads, 1, 1]. Finer, but vLLM reads it
  only with FlashAttention 3/4 (Hopper and newer); an environment whose backend
  takes it says so (`BackendSpec.kv_scale_strategy`).

The strategy chosen is written in config.json's `kv_cache_scheme` and reported in
`CompressResult.kv_scale_strategy`.
"""

from __future__ import annotations

import torch

from gpuagent.engine.kv_calibration import static_kv_scales
from gpuagent.protocol import KV_SCALE_STRATEGIES

DEFAULT_KV_SCALE_STRATEGY = "tensor"
# Shape of one layer's k_scale / v_scale per strategy (-1: the kv heads).
_SHAPES = {"tensor": (1,), "attn_head": (-1, 1, 1)}


def check_strategy(strategy: str) -> str:
    """`strategy`, or ValueError naming the ones written."""
    if strategy not in KV_SCALE_STRATEGIES:
        raise ValueError(
            f"unknown KV scale strategy {strategy!r}; known: "
            + ", ".join(KV_SCALE_STRATEGIES)
        )
    return strategy


def kv_cache_scheme(strategy: str = DEFAULT_KV_SCALE_STRATEGY) -> dict:
    """config.json `quantization_config.kv_cache_scheme` for the scales written
    (compressed-tensors QuantizationArgs)."""
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": check_strategy(strategy),
        "dynamic": False,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def kv_scale_tensors(
    model, sequences, strategy: str = DEFAULT_KV_SCALE_STRATEGY
) -> dict[str, torch.Tensor]:
    """k_scale / v_scale of every layer in `strategy`'s layout, calibrated on
    `sequences` (token ids) with the model as it now is (its weights already
    quantized)."""
    shape = _SHAPES[check_strategy(strategy)]
    tensors = {}
    for i, (k, v) in enumerate(static_kv_scales(model, sequences, rotated=False)):
        prefix = f"model.layers.{i}.self_attn"
        for name, per_head in (("k_scale", k), ("v_scale", v)):
            scale = per_head.float().reshape(-1)
            if strategy == "tensor":
                scale = scale.max()  # absmax over all heads = the largest head's
            tensors[f"{prefix}.{name}"] = scale.reshape(shape).contiguous()
    return tensors
