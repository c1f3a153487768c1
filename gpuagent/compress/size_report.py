"""Bytes per tensor class (attention, mlp, embeddings, other) before and after
compression, and what the weights take in GPU memory once the engine loads them."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from gpuagent.integrity.safetensors_header import parse_header_bytes
from gpuagent.protocol import TensorClassSize

TENSOR_CLASSES = ("attention", "mlp", "embeddings", "other")


def tensor_class(name: str) -> str:
    """Class of a checkpoint tensor by its name."""
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
