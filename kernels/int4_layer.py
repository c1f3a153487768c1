"""A Llama decoder layer's decode step on a CPU in one call (`_int4_layer.c`, built
into the int4 extension beside `kernels.int4_cpu`'s matmul): what
`gpuagent.engine.model.Transformer.forward` runs for each layer of a float32 model
whose projections are all int4 with the CPU kernel prepared (q/k/v and gate/up
fused, `gpuagent.engine.weights`), at a decode step of at most `MAX_ROWS`
sequences over a bf16 paged KV cache.

The torch layer is about sixty small ops a decode step (norms, RoPE, the cache
write, the gather and SDPA of the attention, the residual adds), each a few
microseconds of dispatch and allocation around microseconds of work; at batch 1
on SmolLM2 they cost as much as the int4 matmuls. Here the layer is one call: the
same matmul row loops (`int4_cpu`), RMSNorm, RoPE, the K/V write rounded to bf16 as
torch rounds it, the attention over the block tables, SiLU and the residual adds,
on one thread with the GIL released. It agrees with the torch layer within float32
rounding (sums ordered differently); the tests hold it to the torch path's greedy
tokens and logits.

Optional as the matmul is: where the extension isn't built, `AVAILABLE` is False
and the torch layer runs.
"""

from __future__ import annotations

import torch

from kernels import int4_cpu
from kernels.cpu_matmul import as_array

AVAILABLE = int4_cpu.AVAILABLE and hasattr(int4_cpu._int4_cpu, "layer_new")
MAX_ROWS = int4_cpu.MAX_ROWS
# the attention's builds this CPU runs, best first (`decode(..., attention=)`)
ATTENTION_PATHS: tuple[str, ...] = (
    int4_cpu._int4_cpu.layer_attention_paths() if AVAILABLE else ()
)
# the KV cache layouts the step writes and reads (`kernels.kv_quant`)
CACHE_DTYPES = ("bf16",)


def _spec(weight: int4_cpu.PreparedInt4) -> tuple:
    return (
        weight.packed,
        weight.scale,
        weight.zero_scale,
        weight.n,
        weight.k,
        weight.group_size,
    )


class Int4DecodeLayer:
    """One decoder layer as the extension holds it: its two RMSNorm weights and eps,
    its four int4 weights (`int4_cpu.PreparedInt4`: q/k/v fused, o_proj, gate/up
    fused, down_proj) and head counts, checked once (ValueError naming the part
    whose shape disagrees). The norms' weights are viewed, not copied: float32
    and contiguous, as the model holds them."""

    def __init__(
        self,
        input_norm: torch.Tensor,
        post_attention_norm: torch.Tensor,
        eps: float,
        weights: tuple[int4_cpu.PreparedInt4, ...],  # qkv, o_proj, gate_up, down
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        for name, norm in (
            ("input", input_norm),
            ("post_attention", post_attention_norm),
        ):
            if norm.dtype != torch.float32 or norm.device.type != "cpu":
                raise ValueError(f"{name} norm weight must be float32 on a CPU")
        self.weights = weights
        self._norms = (input_norm.detach(), post_attention_norm.detach())
        self.handle = int4_cpu._int4_cpu.layer_new(
            as_array(self._norms[0]),
            as_array(self._norms[1]),
            eps,
            *(_spec(w) for w in weights),
            num_heads,
            num_kv_heads,
            head_dim,
        )

    @property
    def int8_activations(self) -> int:
        """The weights whose activations are rounded to int8 (`PreparedInt4.
        int8_activations`), as bits: 1 qkv, 2 o_proj, 4 gate_up, 8 down_proj."""
        return sum(1 << i for i, w in enumerate(self.weights) if w.int8_activations)


class DecodeStep:
    """What every layer of one decode step shares, as the extension's arrays:
    cos and signed sin [M, D] float32 (`model.rope_cos_sin`), each row's cache slot
    [M] int64, block table [M, max_blocks] int32 and context length [M] int32
    (counting its new token)."""

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> None:
        self.rows = slot_mapping.shape[0]
        self.cos = as_array(cos.reshape(self.rows, -1).float())
        self.sin = as_array(sin.reshape(self.rows, -1).float())
        self.slots = as_array(slot_mapping.to(torch.int64))
        self.tables = as_array(block_tables.to(torch.int32))
        self.context_lens = as_array(context_lens.to(torch.int32))


def decode(
    layer: Int4DecodeLayer,
    x: torch.Tensor,  # [M, hidden] float32, contiguous; updated in place
    step: DecodeStep,
    key: torch.Tensor,  # [num_blocks, block_size, KVH, D] bfloat16, as kv_quant
    value: torch.Tensor,
    softmax_scale: float,
    attention: str | None = None,
) -> None:
    """One decode step of `layer` for the step's M rows: x becomes the layer's
    output, each row's K/V is written to its slot (-1: none). `attention` names
    one of ATTENTION_PATHS (None: the best that takes the shape; the tests run
    each). ValueError, with nothing written, for arrays of the wrong size or an
    index outside the cache."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("x must be contiguous float32 [M, hidden]")
    if key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16:
        raise ValueError("the cache must be bfloat16 (kv dtype bf16)")
    int4_cpu._int4_cpu.layer_decode(
        layer.handle,
        x.numpy(),
        step.cos,
        step.sin,
        key.view(torch.int16).numpy(),
        value.view(torch.int16).numpy(),
        step.slots,
        step.tables,
        step.context_lens,
        step.rows,
        key.shape[1],
        softmax_scale,
        layer.int8_activations,
        attention,
    )
