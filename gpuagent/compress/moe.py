"""Quantizing one DeepSeek-V3 / Kimi K2 / GLM-4.5 decoder layer
(`engine.arch.MoEBlock`): which Linears are quantized, in which order, and GPTQ
per routed expert on the calibration tokens the router sends to it.

What is quantized (the rest is written in bf16 and listed in `ignore`, as
llm-compressor writes these models: `lm_head`, `re:.*mlp\\.gate$`):

- attention: GLM's q/k/v/o (their biases stay dense beside the codes); MLA's
  q_a_proj, q_b_proj (or q_proj without a q LoRA), kv_a_proj_with_mqa and o_proj.
  MLA's kv_b_proj is kept in bf16 by rule: the absorbed decode needs W_UK and W_UV
  themselves (folded into the query and the output), so the engine
  (`engine.mla.MLAAttention._kv_b`) and vLLM dequantize it once at load and hold it
  dense; quantized it would save disk only, and add its rounding error to every
  key and value. The layernorms inside MLA (q_a_layernorm, kv_a_layernorm) are
  norms, never touched;
- the router (`mlp.gate`: weight in bf16, e_score_correction_bias in float32 as
  published, since a rounded bias can change the top-k) is never quantized;
- every routed expert's gate/up/down; the shared experts and the dense MLPs of the
  first `first_k_dense_replace` layers when the recipe says so
  (`quantize_shared_experts`, `quantize_dense_layers`, default both).

GPTQ goes through the layer in the order it runs (true sequential, as the dense
path): q/kv down-projections, q_b, o_proj, then the MLP's gate/up, then down. The
attention groups run the attention alone (`run_attention`: their inputs don't
depend on the MLP, whose routed experts are most of a layer's forward), each
forward stopped once the group's input is taken. Once
the attention is quantized the MLP's inputs are fixed: they are taken once
(`mlp_inputs`) and the MLP groups run the MLP alone on them. Each such forward
runs the block's own router and its grouping of tokens per expert
(`engine.moe.Experts`: sorted by expert, one slice each, no loop over tokens), so
a hook on expert E's gate_proj (down_proj) sees exactly the rows routed to E: its
Hessian is accumulated from those tokens only. An expert that received fewer than
the recipe's `min_expert_tokens` falls back to round-to-nearest (its Hessian
would be nearly singular) and is reported as (layer, expert, tokens seen).
Hessians are float64 [K, K] per expert: the experts of a group are calibrated in
passes holding at most `hessian_budget_bytes` of them (DeepSeek-V3's hidden
7168: 411 MB each, 5 experts a pass under the default 2 GiB), each pass the MLP
alone over its inputs. The experts of a pass whose weights have the same shapes
(the routed experts, and a shared expert as wide as one) are solved by one
batched GPTQ (`gptq.quantize_gptq_batch`: one Cholesky and one column loop for
all of them, each expert's codes those it gets alone) in chunks of at most the
same budget of stacked Hessians, each Hessian moved from its accumulator into
the stack.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpuagent.compress.gptq import HessianAccumulator, quantize_gptq_batch
from gpuagent.compress.quantize import QuantizedWeight, quantize_rtn
from gpuagent.compress.recipes import WeightScheme
from gpuagent.protocol import ExpertFallback

# float64 Hessians held at once while calibrating one group of experts
DEFAULT_HESSIAN_BUDGET = 2 << 30
ROUTER_IGNORE = r"re:.*mlp\.gate$"


@dataclass(frozen=True)
class InputSet:
    """Projections sharing one input: the module whose input is hooked, the
    projections (names within the layer) quantized on that input's Hessian, and
    the routed expert they belong to (None: not a routed expert)."""

    hook: str
    projections: tuple[str, ...]
    expert: int | None = None


def is_moe_layer(layer: torch.nn.Module) -> bool:
    return hasattr(layer.mlp, "experts")


def layer_groups(layer: torch.nn.Module, scheme: WeightScheme) -> list[list[InputSet]]:
    """The layer's quantized projections as groups of input sets, in the order
    GPTQ takes them (module docstring); a group's sets are calibrated in one pass."""
    attn, mlp = layer.self_attn, layer.mlp
    groups: list[list[InputSet]] = []
    if hasattr(attn, "kv_a_proj_with_mqa"):  # MLA
        q = "self_attn.q_a_proj" if hasattr(attn, "q_a_proj") else "self_attn.q_proj"
        groups.append([InputSet(q, (q, "self_attn.kv_a_proj_with_mqa"))])
        if hasattr(attn, "q_b_proj"):
            groups.append([InputSet("self_attn.q_b_proj", ("self_attn.q_b_proj",))])
    else:
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        groups.append([InputSet(qkv[0], qkv)])
    groups.append([InputSet("self_attn.o_proj", ("self_attn.o_proj",))])
    if not is_moe_layer(layer):
        if scheme.quantize_dense_layers:
            groups.append([InputSet("mlp.gate_proj", ("mlp.gate_proj", "mlp.up_proj"))])
            groups.append([InputSet("mlp.down_proj", ("mlp.down_proj",))])
        return groups
    gate_up = [
        InputSet(f"mlp.experts.{e}.gate_proj", _proj(f"mlp.experts.{e}", "gate_up"), e)
        for e in range(len(mlp.experts))
    ]
    down = [
        InputSet(f"mlp.experts.{e}.down_proj", _proj(f"mlp.experts.{e}", "down"), e)
        for e in range(len(mlp.experts))
    ]
    if mlp.shared_experts is not None and scheme.quantize_shared_experts:
        gate_up.append(
            InputSet(
                "mlp.shared_experts.gate_proj", _proj("mlp.shared_experts", "gate_up")
            )
        )
        down.append(
            InputSet(
                "mlp.shared_experts.down_proj", _proj("mlp.shared_experts", "down")
            )
        )
    return groups + [gate_up, down]


def _proj(prefix: str, which: str) -> tuple[str, ...]:
    if which == "down":
        return (f"{prefix}.down_proj",)
    return (f"{prefix}.gate_proj", f"{prefix}.up_proj")


def dense_linears(layer: torch.nn.Module, scheme: WeightScheme) -> list[str]:
    """The layer's Linears (names within it) this recipe leaves in bf16, the
    router aside (it is not a Linear): what `ignore` must name."""
    quantized = {
        p for g in layer_groups(layer, scheme) for s in g for p in s.projections
    }
    return [
        name
        for name, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear) and name not in quantized
    ]


# MLP input rows per forward when the MLP runs alone
MLP_ROWS = 4096


def _attended(layer, hidden, cos, sin):
    # the residual after the attention, batch by batch as `run_layer` splits it
    # (so each batch's values are bit for bit those of the whole layer's forward)
    for batch in hidden.split(8):
        attn = layer.self_attn.forward_dense(layer.input_layernorm(batch), cos, sin)
        yield batch + attn


class _Stop(Exception):
    """Raised by `run_attention`'s hook once `stop_at`'s inputs are taken."""


def _stop(_module, _args) -> None:
    raise _Stop


def run_attention(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    stop_at: str | None = None,
) -> None:
    """The layer's attention alone over the calibration states [B, T, hidden]
    (outputs dropped): what the attention projections' hooks need, without the
    MLP (every routed expert) the whole layer's forward would run too. With
    `stop_at` (a module of the layer) each batch's forward stops as soon as that
    module's inputs have gone to the hooks registered on it before this call
    (q_a_proj's: the input norm only, not the attention)."""
    stop = None if stop_at is None else layer.get_submodule(stop_at)
    hook = None if stop is None else stop.register_forward_pre_hook(_stop)
    try:
        with torch.no_grad():
            for batch in hidden.split(8):  # as `run_layer` splits it
                try:
                    layer.self_attn.forward_dense(
                        layer.input_layernorm(batch), cos, sin
                    )
                except _Stop:
                    pass
    finally:
        if hook is not None:
            hook.remove()


def mlp_inputs(
    layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """The layer's MLP inputs [B * T, hidden] (post-attention norm of the
    residual) over the calibration states [B, T, hidden], the MLP not run."""
    with torch.no_grad():
        seen = [
            layer.post_attention_layernorm(x)
            for x in _attended(layer, hidden, cos, sin)
        ]
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])


def run_mlp(layer: torch.nn.Module, inputs: torch.Tensor) -> None:
    """The layer's MLP alone over its inputs [N, hidden] (outputs dropped)."""
    with torch.no_grad():
        for rows in inputs.split(MLP_ROWS):
            layer.mlp(rows)


def input_hessians(
    layer: torch.nn.Module, sets: list[InputSet], run: Callable[[], object]
) -> dict[str, HessianAccumulator]:
    """The input Hessian of each set's hooked module from the rows it receives
    while `run()` runs (a routed expert: only the tokens the router sends it;
    `num_rows` counts them)."""
    accs = {
        s.hook: HessianAccumulator(layer.get_submodule(s.hook).in_features)
        for s in sets
    }
    hooks = [
        layer.get_submodule(h).register_forward_pre_hook(
            lambda _m, args, add=acc.add: add(args[0])
        )
        for h, acc in accs.items()
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return accs


def _passes(layer: torch.nn.Module, group: list[InputSet], budget: int):
    # the group split so that one pass holds at most `budget` bytes of Hessians
    chunk, held = [], 0
    for s in group:
        k = layer.get_submodule(s.hook).in_features
        size = k * k * 8
        if chunk and held + size > budget:
            yield chunk
            chunk, held = [], 0
        chunk.append(s)
        held += size
    if chunk:
        yield chunk


def quantize_moe_layer(
    index: int,
    layer: torch.nn.Module,
    scheme: WeightScheme,
    quantized: dict[str, QuantizedWeight],
    calibration: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    hessian_budget_bytes: int = DEFAULT_HESSIAN_BUDGET,
    fallbacks: list[ExpertFallback] | None = None,
) -> None:
    """Quantize layer `index` (module docstring): RTN, or GPTQ when `calibration`
    (hidden [B, T, hidden], cos, sin) is given, each group's Hessians from the
    outputs of the groups before it already quantized. Weights are replaced by
    their dequantized values; codes go to `quantized` under HF module names;
    routed experts rounded to nearest for lack of tokens are appended to
    `fallbacks`."""
    fell_back: set[int] = set()
    inputs = None  # the MLP's inputs, once the attention is quantized
    for group in layer_groups(layer, scheme):
        passes = [group]
        if calibration is not None:
            passes = list(_passes(layer, group, hessian_budget_bytes))
        for sets in passes:
            accs = {}
            if calibration is not None and sets[0].hook.startswith("mlp."):
                if inputs is None:
                    inputs = mlp_inputs(layer, *calibration)
                run = functools.partial(run_mlp, layer, inputs)
                accs = input_hessians(layer, sets, run)
            elif calibration is not None:
                # one set (one input) per attention group: stop once it's taken
                stop_at = sets[0].hook if len(sets) == 1 else None
                run = functools.partial(run_attention, layer, *calibration, stop_at)
                accs = input_hessians(layer, sets, run)
            solved = {}  # projection -> QuantizedWeight
            gptq = []  # the sets GPTQ solves, batched below
            for s in sets:
                acc = accs.get(s.hook)
                rtn = acc is None or s.expert in fell_back
                if acc is not None and s.expert is not None and not rtn:
                    if acc.num_rows < scheme.min_expert_tokens:
                        fell_back.add(s.expert)
                        if fallbacks is not None:
                            fallbacks.append(
                                ExpertFallback(
                                    layer=index, expert=s.expert, tokens=acc.num_rows
                                )
                            )
                        rtn = True
                if not rtn:
                    gptq.append(s)
                    continue
                for p in s.projections:
                    solved[p] = quantize_rtn(layer.get_submodule(p).weight, scheme)
            for batch in _batches(layer, gptq, hessian_budget_bytes):
                solved |= _solve_batch(layer, batch, accs, scheme)
            del accs
            for s in sets:  # in the layer's order, whatever the batches were
                for p in s.projections:
                    qw = solved.pop(p)
                    with torch.no_grad():
                        layer.get_submodule(p).weight.copy_(qw.dequantize())
                    quantized[f"model.layers.{index}.{p}"] = qw


def _batches(layer: torch.nn.Module, sets: list[InputSet], budget: int):
    # the sets whose projections have the same weight shapes (a layer's routed
    # experts, and shared experts of the same width), in chunks whose stacked
    # Hessians take at most `budget` bytes (at least one set a chunk)
    alike: dict[tuple, list[InputSet]] = {}
    for s in sets:
        shapes = tuple(layer.get_submodule(p).weight.shape for p in s.projections)
        alike.setdefault(shapes, []).append(s)
    for same in alike.values():
        yield from _passes(layer, same, budget)


def _solve_batch(
    layer: torch.nn.Module,
    batch: list[InputSet],
    accs: dict[str, HessianAccumulator],
    scheme: WeightScheme,
) -> dict[str, QuantizedWeight]:
    # GPTQ of the batch's sets at once (`quantize_gptq_batch`); each set's
    # Hessian moves from `accs` into the stack (the pass holds it only once)
    k = layer.get_submodule(batch[0].hook).in_features
    hessians = torch.empty(len(batch), k, k, dtype=torch.float64)  # [E, K, K]
    for x, s in enumerate(batch):
        hessians[x] = accs.pop(s.hook).hessian
    weights = [
        torch.stack([layer.get_submodule(s.projections[j]).weight for s in batch])
        for j in range(len(batch[0].projections))
    ]  # per projection: [E, N, K]
    results = quantize_gptq_batch(weights, hessians, scheme)
    return {
        s.projections[j]: qw
        for j, per_set in enumerate(results)
        for s, qw in zip(batch, per_set, strict=True)
    }
