"""A release `Recipe` (gpuagent.protocol) as the weight scheme `compress` applies.

One recipe, one scheme: `weights` names the format (w8a16 = int8, w4a16-gN =
int4-gN, fp8), `method` how values are rounded (round-to-nearest, GPTQ, or
sign-gradient rounding: gpuagent.compress.signround),
`symmetric` whether int4 groups carry a zero point, `observer` how int scales are
chosen (absmax, or the least-error shrink: gpuagent.compress.quantize), `awq`
whether activation-aware input-channel scales are folded in first
(gpuagent.compress.awq), `quantize_lm_head` whether an untied head is quantized too,
and for MoE models `quantize_shared_experts` / `quantize_dense_layers` whether the
shared experts and the first_k_dense_replace layers' MLPs are, and (gptq)
`min_expert_tokens` the calibration tokens below which a routed expert is rounded
to nearest (gpuagent.compress.moe), and `head` the output head's own format
("int8": gpuagent.compress.head; the protocol refuses it for dense and fp8 weights
and beside quantize_lm_head).
Anything else in a recipe is refused by name.

Group size for layers whose input width is not a multiple of the recipe's group
(SmolLM2's hidden size 576 is not a multiple of 128): the largest of 128, 64, 32 that
divides the width and is at most the recipe's group (576 -> 64). Only those sizes:
the Triton int4 kernel tiles K by the group, and vLLM's int4 kernels (Marlin,
Machete) take groups of 32, 64 and 128 (or per channel), not 16. A width none of
them divides is refused, naming the layer width and the per-channel w8a16 format
as the way out, never written in a group vLLM would not load. The size each
projection got is recorded in the config groups (one group per size) and in
`CompressResult`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gpuagent.protocol import DEFAULT_MIN_EXPERT_TOKENS, Recipe

# Weight format name -> (kind, bits): kind is "int" or "float" (fp8 e4m3).
_FORMATS = {
    "int8": ("int", 8),
    "w8a16": ("int", 8),
    "fp8": ("float", 8),
}
DENSE_FORMATS = ("bf16", "fp16")
# Smallest int4 group written: vLLM's int4 kernels take 32, 64, 128 (or channel).
MIN_GROUP_SIZE = 32


class RecipeError(ValueError):
    """A recipe `compress` cannot apply; the message names the option."""


@dataclass(frozen=True)
class WeightScheme:
    """How each quantized Linear is stored."""

    kind: str  # "int" or "float"
    bits: int  # 4 or 8
    group_size: int | None  # int4: requested group; None: one scale per row
    symmetric: bool
    method: str  # "rtn", "gptq" or "signround"
    act_order: bool
    observer: str  # "minmax" or "mse" (gpuagent.compress.quantize)
    awq: bool
    quantize_lm_head: bool
    quantize_shared_experts: bool = True
    quantize_dense_layers: bool = True
    min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS
    head: str | None = None  # the head's own format (gpuagent.compress.head)

    @property
    def name(self) -> str:
        if self.kind == "float":
            return "fp8"
        if self.bits == 8:
            return "w8a16"
        return f"w4a16-g{self.group_size}" + ("" if self.symmetric else "-asym")

    @property
    def compression_format(self) -> str:
        """compressed-tensors `format`: int codes packed in int32, fp8 stored as is."""
        return "float-quantized" if self.kind == "float" else "pack-quantized"

    def group_size_for(self, in_features: int) -> int | None:
        """The group this layer gets (module docstring); None for per-channel."""
        if self.group_size is None:
            return None
        group = self.group_size
        while group >= MIN_GROUP_SIZE and in_features % group:
            group //= 2
        if group < MIN_GROUP_SIZE:
            raise RecipeError(
                f"in_features={in_features} is not a multiple of any int4 group size "
                f"vLLM's kernels take ({MIN_GROUP_SIZE} to {self.group_size}, powers "
                f"of two); use w8a16 (per channel) for this model"
            )
        return group


def parse_recipe(recipe: Recipe | dict[str, Any]) -> Recipe:
    """A `Recipe` from a dict, unknown options named in the error."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, dict):
        raise RecipeError(f"recipe must be a mapping, got {type(recipe).__name__}")
    unknown = sorted(set(recipe) - set(Recipe.model_fields))
    if unknown:
        raise RecipeError(
            f"unknown recipe option(s) {unknown}; known: {sorted(Recipe.model_fields)}"
        )
    try:
        return Recipe.model_validate(recipe)
    except ValidationError as exc:
        raise RecipeError(f"invalid recipe: {exc}") from exc


def weight_scheme(recipe: Recipe | dict[str, Any]) -> WeightScheme | None:
    """The scheme of a recipe; None for a dense (bf16/fp16) recipe, which `compress`
    does not apply. Raises RecipeError for options that don't fit the format."""
    recipe = parse_recipe(recipe)
    fmt = recipe.weights
    if fmt in DENSE_FORMATS:
        if (
            recipe.awq
            or recipe.method != "rtn"
            or recipe.act_order
            or recipe.observer != "minmax"
            or not recipe.quantize_shared_experts
            or not recipe.quantize_dense_layers
            or recipe.min_expert_tokens != DEFAULT_MIN_EXPERT_TOKENS
        ):
            raise RecipeError(
                f"weights {fmt!r} are not quantized: method, act_order, observer, "
                "awq, quantize_shared_experts, quantize_dense_layers and "
                "min_expert_tokens do not apply"
            )
        return None
    if fmt.startswith(("int4-g", "w4a16-g")):
        kind, bits, group = "int", 4, int(fmt.rsplit("-g", 1)[1])
    else:
        (kind, bits), group = _FORMATS[fmt], None
    if not recipe.symmetric and bits != 4:
        raise RecipeError(f"symmetric=false is only offered for int4, not {fmt!r}")
    if recipe.act_order and recipe.method != "gptq":
        raise RecipeError("act_order=true needs method 'gptq'")
    if (
        recipe.min_expert_tokens != DEFAULT_MIN_EXPERT_TOKENS
        and recipe.method != "gptq"
    ):
        raise RecipeError(
            f"min_expert_tokens={recipe.min_expert_tokens} needs method 'gptq' (only "
            "GPTQ calibrates each routed expert on its tokens)"
        )
    if recipe.method == "signround" and (kind != "int" or not recipe.symmetric):
        raise RecipeError(
            f"method 'signround' takes symmetric int formats only, not {fmt!r}"
            + ("" if recipe.symmetric else " with symmetric=false")
        )
    if recipe.observer != "minmax" and kind == "float":
        raise RecipeError(
            f"observer {recipe.observer!r} is for int formats; fp8 scales are the "
            "row's absmax / 448"
        )
    return WeightScheme(
        kind=kind,
        bits=bits,
        group_size=group,
        symmetric=recipe.symmetric,
        method=recipe.method,
        act_order=recipe.act_order,
        observer=recipe.observer,
        awq=recipe.awq,
        quantize_lm_head=recipe.quantize_lm_head,
        quantize_shared_experts=recipe.quantize_shared_experts,
        quantize_dense_layers=recipe.quantize_dense_layers,
        min_expert_tokens=recipe.min_expert_tokens,
        head=recipe.head,
    )
