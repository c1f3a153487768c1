"""Bytes per tensor class before and after compression, and what the weights take
in GPU memory once the engine loads them.

Classes: a Llama's attention, mlp, embeddings (embed_tokens and lm_head), other
(norms, KV scales); an MoE model's (deepseek_v3, kimi_k2, glm4_moe) attention
(MLA's or GQA's projections, KV scales), routed_experts, shared_experts, router
(`mlp.gate`: weight and score-correction bias), dense_mlp (the first
first_k_dense_replace layers' MLPs), embeddings, norms (every RMSNorm weight,
MLA's q_a/kv_a layernorms and GLM's q/k norms included) and other (nothing in
these checkpoints; kept so that the classes always sum to the total).

`moe_parameters` gives an MoE model's total parameters and the active ones per
token: all but the routed experts, plus top-k routed experts in each MoE layer
(embeddings and head counted as active: every token reads its rows and runs the
head).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from gpuagent import sizing
from gpuagent.integrity.safetensors_header import parse_header_bytes
from gpuagent.protocol import TensorClassSize

TENSOR_CLASSES = ("attention", "mlp", "embeddings", "other")
# The classes sizing reports for a MoE config, and "other" so they always sum to
# the total.
MOE_TENSOR_CLASSES = (*sizing.TENSOR_CLASSES, "other")


def tensor_classes(moe: bool = False) -> tuple[str, ...]:
    return MOE_TENSOR_CLASSES if moe else TENSOR_CLASSES


def tensor_class(name: str, moe: bool = False) -> str:
    """Class of a checkpoint tensor by its name (an MoE model's classes when
    `moe`)."""
    if moe:
        return _moe_class(name)
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"
    return "other"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def size_report(
    model, tensors: Mapping[str, torch.Tensor], source_files: Mapping[str, bytes]
) -> tuple[list[TensorClassSize], int, int, int]:
    """(per-class sizes, total before, total after, expected GPU weight bytes).

    "before" is the source checkpoint's tensors as stored; "bf16" the same tensors
    at 2 bytes each. The GPU estimate is the engine's resident weights: the stored
    tensors (the kernels read the packed codes as stored) and, for a tied head, no
    second copy."""
    before = {c: 0 for c in TENSOR_CLASSES}
    bf16 = {c: 0 for c in TENSOR_CLASSES}
    for name, data in source_files.items():
        if not name.endswith(".safetensors"):
            continue
        # the header says it all (inspection already checked it against the data)
        for entry in parse_header_bytes(data).tensors.values():
            before[tensor_class(entry.name)] += entry.end - entry.begin
            bf16[tensor_class(entry.name)] += math.prod(entry.shape) * 2
    after = {c: 0 for c in TENSOR_CLASSES}
    for key, t in tensors.items():
        after[tensor_class(key)] += _nbytes(t)
    sizes = [
        TensorClassSize(
            tensor_class=c,
            bytes_before=before[c],
            bytes_after=after[c],
            bytes_bf16=bf16[c],
        )
        for c in TENSOR_CLASSES
    ]
    total_after = sum(after.values())
    return sizes, sum(before.values()), total_after, total_after


def _moe_class(name: str) -> str:
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else name
    if module.endswith("norm"):
        return "norms"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"
    return "other"


def moe_parameters(src, config) -> tuple[int, int]:
    """(total, active per token) parameters of an MoE source (`src`: an opened
    `integrity.streamed_load.StreamedModel`, `config`: its `arch.MoEConfig`),
    counted from the checkpoint's headers, multi-token-prediction layers left out
    (module docstring)."""
    from gpuagent.engine.arch import extra_checkpoint_layer

    total = routed = 0
    for header in src.headers.values():
        for entry in header.tensors.values():
            if extra_checkpoint_layer(entry.name, config) or entry.name.endswith(
                "_scale_inv"  # a block-fp8 source's scales: not parameters
            ):
                continue
            count = math.prod(entry.shape)
            total += count
            if _moe_class(entry.name) == "routed_experts":
                routed += count
    # every routed expert has the same size: routed / experts is one expert
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    experts = moe_layers * config.n_routed_experts
    per_expert = routed // experts if experts else 0
    return total, total - routed + moe_layers * config.num_experts_per_tok * per_expert
