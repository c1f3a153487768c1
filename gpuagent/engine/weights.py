"""Quantized weights in the engine: a compressed-tensors checkpoint's Linear layers
run through `kernels.weight_matmul`: Triton on a GPU; on a CPU, in the model's own
arithmetic, as every other layer there runs:

- a float32 model (the CPU default) runs in the torch reference's arithmetic:
  exact codes and scales, float32 accumulation, as the bf16 parent runs in float32
  beside it, so the two differ by the weight format alone (and the result is the
  same on every CPU, up to float32 summation order); int4 at decode (a few rows)
  through the compiled `kernels.int4_cpu`, which reads the packed weight instead of
  dequantizing all of it per call;
- a bf16 model runs torch's weight-only kernels (bf16 activations, float32
  accumulation, bf16 output: the "a16" of w8a16 / w4a16, as a GPU serves it), over a
  copy laid out once by `to_model`, or the reference where those don't apply.

`split_quantized(checkpoint, quantization_config)` takes the quantized tensors out
of a checkpoint (leaving the dense ones for the state dict) as one `QuantLinear`
per module; `install(model, layers)` puts them in place of the model's
`nn.Linear`s. Formats (see `gpuagent.compress.checkpoint`):

- pack-quantized, 8 bits, per channel: unpacked once to int8 [N, K] ->
  `weight_int8_matmul`;
- pack-quantized, 8 bits, groups, symmetric, lm_head only (the recipe option
  head="int8", `gpuagent.compress.head`): unpacked once to int8 [N, K], the float32
  scales as stored -> `Int8Head`, the kernel `quantize_head("int8")` runs;
- pack-quantized, 4 bits, groups: the packed int32 words as stored ->
  `weight_int4_matmul`; with a zero point (asymmetric), W = (q - zp) s, passed as
  zp * s per group;
- float-quantized (fp8 e4m3, per channel): no CPU has an fp8 GEMM, so on a CPU
  `to_model` dequantizes the weight once, to the model's dtype, into the same
  matrix the per-call dequantization makes (packed for oneDNN as the parent's
  weights are): the parent's speed at the parent's memory (dequantizing per call
  made decode 6.5x slower than the parent). Elsewhere (and with
  `use_cpu_kernels(enabled=False)`) it is dequantized per call and multiplied by
  torch.

Anything else in a `quantization_config` is refused by name (ModelLoadError).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from gpuagent.engine.model import Transformer, packed_linear, prepack_weight
from kernels import int4_cpu, int4_layer, int8_cpu, matmul_tuning, weight_matmul
from kernels.weight_matmul import (
    CpuPackedWeight,
    prepack_int4_cpu,
    prepack_int8_cpu,
    quantize_weight_int4,
    unpack_int32,
    weight_int4_matmul,
    weight_int8_matmul,
)

SUPPORTED_FORMATS = ("pack-quantized", "float-quantized")
HEAD_MODULE = "lm_head"
QUANTIZED_DTYPES = (torch.int32, torch.int64, torch.float8_e4m3fn)
_SUFFIXES = (
    ".weight_packed",
    ".weight_scale",
    ".weight_shape",
    ".weight_zero_point",
)
_CONFIG_KEYS = {
    "quant_method",
    "format",
    "quantization_status",
    "config_groups",
    "ignore",
    "kv_cache_scheme",
    "global_compression_ratio",
    "sparsity_config",
    "version",
    "transform_config",
}


class QuantizedWeightError(ValueError):
    """The quantized part of a checkpoint can't be loaded; the message says why."""


class QuantLinear(nn.Module):
    """y = x W^T with W held quantized (module docstring)."""

    def __init__(
        self,
        kind: str,
        out_features: int,
        in_features: int,
        tensors: dict[str, Tensor],
        group_size: int | None,
    ) -> None:
        super().__init__()
        self.kind = kind  # "int8", "int4", "fp8"
        self.out_features, self.in_features = out_features, in_features
        self.group_size = group_size
        for name, t in tensors.items():
            self.register_buffer(name, t)
        # the weight laid out for torch's CPU kernels (`prepack_cpu`); not a buffer:
        # its layout is this CPU's, never saved
        self.cpu_weight: CpuPackedWeight | None = None
        # fp8 on a CPU: the weight dequantized once [N, K] and its oneDNN packing
        # (`dequantize_cpu`); not buffers either
        self.dense_weight: Tensor | None = None
        self.packed_weight: Tensor | None = None
        # int4 in a float32 model on a CPU: the arrays `kernels.int4_cpu` reads,
        # made once (`prepare_int4_cpu`)
        self.int4_cpu: int4_cpu.PreparedInt4 | None = None
        # the replaced Linear's bias (GLM-4.5's q/k/v), a dense parameter of the
        # state dict as the checkpoint stores it beside the codes; None: no bias
        self.register_parameter("bias", None)

    def prepack_cpu(self) -> bool:
        """Lay the weight out once for torch's CPU weight-only kernels; False where
        they don't apply (fp8, or shapes and group sizes they don't take: see
        `kernels.weight_matmul`), and the torch reference runs instead."""
        if self.kind == "int8":
            self.cpu_weight = prepack_int8_cpu(self.codes, self.scale)
        elif self.kind == "int4":
            self.cpu_weight = prepack_int4_cpu(
                self.packed, self.scale, self.group_size, self._zero_scale()
            )
        return self.cpu_weight is not None

    def dequantize_cpu(self, dtype: torch.dtype) -> bool:
        """fp8 on a CPU: hold the weight dequantized to `dtype` (exactly the
        matrix `forward` would make per call), packed for oneDNN where that
        applies (`model.prepack_weight`); False (nothing held) otherwise."""
        self.dense_weight = self.packed_weight = None
        if self.kind != "fp8" or self.codes.device.type != "cpu":
            return False
        self.dense_weight = self.codes.to(dtype) * self.scale.to(dtype)  # [N, K]
        self.packed_weight = prepack_weight(self.dense_weight)
        return True

    def prepare_int4_cpu(self) -> bool:
        """int4 on a CPU: make `kernels.int4_cpu`'s arrays once (float32 models
        run it at decode); False where the kernel isn't built or the group size
        isn't one it takes."""
        self.int4_cpu = None
        if (
            self.kind == "int4"
            and self.packed.device.type == "cpu"
            and int4_cpu.AVAILABLE
            and self.group_size % 16 == 0
            and 16 <= self.group_size <= 1024
        ):
            self.int4_cpu = int4_cpu.PreparedInt4(
                self.packed, self.scale, self.group_size, self._zero_scale()
            )
        return self.int4_cpu is not None

    def runs_int4_cpu(self, x: Tensor) -> bool:
        """Whether `forward(x)` takes the prepared int4 kernel: float32 rows, at
        most `int4_cpu.MAX_ROWS` of them, no bf16 kernel laid out instead."""
        return (
            self.int4_cpu is not None
            and self.cpu_weight is None
            and int4_cpu.AVAILABLE  # the benches switch it off for the reference
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.numel() <= int4_cpu.MAX_ROWS * self.in_features
        )

    def _zero_scale(self) -> Tensor | None:
        return getattr(self, "zero_scale", None)  # [N, K/g] zp * s, asymmetric only

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [M, K]
        if self.runs_int4_cpu(x):  # decode: the same kernel, no per-call setup
            y = int4_cpu.int4_matmul_prepared(x2.contiguous(), self.int4_cpu)
            y = y.reshape(*shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.kind == "int8":
            y = weight_int8_matmul(
                x2, self.codes, self.scale.to(x.dtype), cpu_weight=self.cpu_weight
            )
        elif self.kind == "int4":
            y = weight_int4_matmul(
                x2.contiguous(),
                self.packed,
                self.scale.to(x.dtype),
                self.group_size,
                weight_zero_scale=self._zero_scale(),
                cpu_weight=self.cpu_weight,
            )
        elif self.dense_weight is not None and x.dtype == self.dense_weight.dtype:
            if self.packed_weight is not None:
                y = packed_linear(x2, self.packed_weight)
            else:
                y = x2 @ self.dense_weight.t()
        else:
            w = self.codes.to(x.dtype) * self.scale.to(x.dtype)  # [N, K]
            y = x2 @ w.t()
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def is_quantized(hf_config: dict[str, Any]) -> bool:
    """Whether config.json declares a quantized checkpoint."""
    return "quantization_config" in hf_config


def check_quantization_config(qc: Any) -> None:
    """Refuse a `quantization_config` this engine doesn't run, naming what."""
    if not isinstance(qc, dict):
        raise QuantizedWeightError("quantization_config is not a JSON object")
    unknown = sorted(set(qc) - _CONFIG_KEYS)
    if unknown:
        raise QuantizedWeightError(f"quantization_config has unknown keys {unknown}")
    if qc.get("quant_method") != "compressed-tensors":
        raise QuantizedWeightError(
            f"quant_method {qc.get('quant_method')!r} is not supported "
            "(only 'compressed-tensors')"
        )
    if qc.get("quantization_status") != "compressed":
        raise QuantizedWeightError("only quantization_status 'compressed' is loaded")
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in SUPPORTED_FORMATS:
            raise QuantizedWeightError(f"{name}: format {fmt!r} is not supported")
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantizedWeightError(
                f"{name}: activation quantization is not supported (weight-only)"
            )
        w = group.get("weights") or {}
        if w.get("dynamic"):
            raise QuantizedWeightError(f"{name}: dynamic weights are not supported")


def _group_for(module: str, qc: dict[str, Any]) -> dict[str, Any]:
    # the config group whose targets match the module name (Linear matches all)
    for group in qc["config_groups"].values():
        for target in group.get("targets", []):
            if target == "Linear" or target == module:
                return group
            if target.startswith("re:") and re.match(target[3:], module):
                return group
    raise QuantizedWeightError(f"{module} is quantized but no config group targets it")


def split_quantized(
    checkpoint: dict[str, Tensor], qc: dict[str, Any]
) -> tuple[dict[str, Tensor], dict[str, QuantLinear | Int8Head]]:
    """(dense tensors, HF module name -> QuantLinear) of a compressed checkpoint;
    an lm_head in int8 groups is an `Int8Head` instead. k_scale / v_scale are left
    among the dense tensors (the caller takes them)."""
    check_quantization_config(qc)
    dense: dict[str, Tensor] = {}
    parts: dict[str, dict[str, Tensor]] = {}
    for name, t in checkpoint.items():
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None and t.dtype == torch.float8_e4m3fn:
            suffix = ".weight"
        if suffix is None:
            dense[name] = t
            continue
        module = name.removesuffix(suffix)
        parts.setdefault(module, {})[suffix[1:]] = t
    layers = {m: _quant_linear(m, p, _group_for(m, qc)) for m, p in parts.items()}
    return dense, layers


def _quant_linear(
    module: str, p: dict[str, Tensor], group: dict
) -> QuantLinear | Int8Head:
    args = group.get("weights") or {}
    bits, kind = args.get("num_bits"), args.get("type")
    group_size = args.get("group_size") if args.get("strategy") == "group" else None
    if "weight_scale" not in p:
        raise QuantizedWeightError(f"{module} lacks weight_scale")
    scale = p["weight_scale"]
    if kind == "float":
        if bits != 8 or "weight" not in p:
            raise QuantizedWeightError(f"{module}: only fp8 e4m3 weights are loaded")
        n, k = p["weight"].shape
        return QuantLinear("fp8", n, k, {"codes": p["weight"], "scale": scale}, None)
    if kind != "int" or bits not in (4, 8) or "weight_packed" not in p:
        raise QuantizedWeightError(
            f"{module}: {bits}-bit {kind} weights are not supported (int4/int8 "
            "pack-quantized, fp8)"
        )
    n, k = (int(v) for v in p["weight_shape"].tolist())
    if bits == 8:
        if module == HEAD_MODULE and group_size is not None:
            return _int8_head(module, p, args, n, k, group_size)
        if group_size is not None or not args.get("symmetric", True):
            raise QuantizedWeightError(
                f"{module}: int8 must be per-channel symmetric (int8 in groups is "
                f"loaded for {HEAD_MODULE} only, into the int8 head kernel)"
            )
        codes = unpack_int32(p["weight_packed"], 8, k)
        return QuantLinear("int8", n, k, {"codes": codes, "scale": scale[:, 0]}, None)
    if group_size is None:
        raise QuantizedWeightError(f"{module}: int4 needs a group strategy")
    tensors = {"packed": p["weight_packed"].contiguous(), "scale": scale.contiguous()}
    if not args.get("symmetric", True):
        zp = unpack_int32(p["weight_zero_point"].t().contiguous(), 4, n).t()  # [N, G]
        tensors["zero_scale"] = zp.float() * scale.float()
    return QuantLinear("int4", n, k, tensors, group_size)


def _int8_head(
    module: str, p: dict[str, Tensor], args: dict, n: int, k: int, group_size: int
) -> Int8Head:
    # a head in int8 groups (the recipe option head="int8": gpuagent.compress.head)
    # runs the int8 head kernel on its stored codes and float32 scales as they are
    if not args.get("symmetric", True) or "weight_zero_point" in p:
        raise QuantizedWeightError(f"{module}: an int8 head must be symmetric")
    if group_size < 8 or group_size % 8 or k % group_size:
        raise QuantizedWeightError(
            f"{module}: int8 group size {group_size} must be a multiple of 8 "
            f"dividing {k}"
        )
    scale = p["weight_scale"]
    if tuple(scale.shape) != (n, k // group_size):
        raise QuantizedWeightError(
            f"{module}: weight_scale {tuple(scale.shape)}, expected "
            f"{(n, k // group_size)}"
        )
    codes = unpack_int32(p["weight_packed"], 8, k)
    return Int8Head(codes.contiguous(), scale.float().contiguous(), group_size)


def install(model: nn.Module, layers: dict[str, QuantLinear | Int8Head]) -> None:
    """Replace the model's Linear modules by their QuantLinear (HF names)."""
    for hf, layer in layers.items():
        name = hf.removeprefix("model.")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not isinstance(getattr(parent, child, None), nn.Linear):
            raise QuantizedWeightError(f"{hf} is not a Linear of this model")
        old = getattr(parent, child)
        if (old.out_features, old.in_features) != (
            layer.out_features,
            layer.in_features,
        ):
            raise QuantizedWeightError(
                f"{hf}: quantized shape {(layer.out_features, layer.in_features)} "
                f"vs config {(old.out_features, old.in_features)}"
            )
        if old.bias is not None:  # filled from the checkpoint's `.bias` tensor
            layer.bias = nn.Parameter(old.bias.detach(), requires_grad=False)
        setattr(parent, child, layer)


def to_model(
    layer: QuantLinear | Int8Head, dtype: torch.dtype, device: str
) -> QuantLinear | Int8Head:
    """The layer on `device`, its scales in the model's dtype (codes as stored); on
    a CPU in bf16 also laid out once for torch's weight-only kernels
    (`prepack_cpu`), which take bf16 activations only (module docstring). An
    `Int8Head` keeps its float32 scales (its kernel's layout) in any model."""
    if isinstance(layer, Int8Head):
        return layer.to(device)
    for name, buf in list(layer.named_buffers()):
        if buf.dtype in (torch.float32, torch.bfloat16, torch.float16):
            buf = buf.to(dtype)
        setattr(layer, name, buf.to(device))
    layer.cpu_weight = None
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        layer.prepack_cpu()
    layer.dequantize_cpu(dtype)  # fp8 on a CPU (module docstring)
    layer.prepare_int4_cpu()
    return layer


class Int8ActivationsError(ValueError):
    """The engine option int8_activations asked of a model it does not apply to."""


def use_int8_activations(model: nn.Module) -> int:
    """Run every int4 layer's decode kernel (`kernels.int4_cpu`, fused groups
    included) with its activations rounded to int8 per block of 32 columns, as
    llama.cpp's Q8_1 (`int4_cpu` module docstring): an engine option, off by
    default, that trades logits quality (`python -m gpuagent.benches.llamacpp`
    prints it) for decode speed. Returns how many weights it switched; refuses
    (Int8ActivationsError, naming why) a model it does not apply to: not float32 on
    a CPU, no int4 layer with the kernel prepared, or a group size that is not a
    multiple of 32."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise Int8ActivationsError(
            "int8 activations apply to a float32 model on a CPU (the int4 CPU "
            f"decode kernel), not a {param.dtype} model on {param.device}"
        )
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    layers += _fused_groups(model)
    prepared = [m.int4_cpu for m in layers if m.int4_cpu is not None]
    if not prepared:
        raise Int8ActivationsError(
            "int8 activations apply to int4 weights (w4a16) run by kernels.int4_cpu; "
            "this model has none"
            + ("" if int4_cpu.AVAILABLE else " (the int4 CPU extension is not built)")
        )
    refused = sorted({p.group_size for p in prepared if not p.takes_int8_activations})
    if refused:
        raise Int8ActivationsError(
            f"int8 activations need int4 groups that are a multiple of "
            f"{int4_cpu.Q8_BLOCK} columns; this model has group sizes {refused}"
        )
    for p in prepared:
        p.int8_activations = True
    return len(prepared)


FUSED_INT4 = {
    "self_attn": ("qkv_int4", ("q_proj", "k_proj", "v_proj")),
    "mlp": ("gate_up_int4", ("gate_proj", "up_proj")),
}


def fuse_projections(model: nn.Module) -> int:
    """Fuse each layer's int4 q/k/v and gate/up (`fuse_int4`) where they can,
    kept on the attention and MLP modules outside their submodules and state dict
    (`model.Attention.qkv_int4`, `model.FeedForward.gate_up_int4`): the
    checkpoint's layout is unchanged. Returns how many groups were fused."""
    fused = 0
    for layer in getattr(model, "layers", ()):
        for part, (attr, names) in FUSED_INT4.items():
            parent = getattr(layer, part)
            members = [getattr(parent, name, None) for name in names]
            if None in members:
                continue  # another block's shape: MLA attention, an MoE block
            group = fuse_int4(members)
            parent.__dict__[attr] = group  # not a submodule (docstring)
            fused += group is not None
    return fused


def int4_decode_layers(model: nn.Module) -> list[int4_layer.Int4DecodeLayer] | None:
    """Each decoder layer of a float32 Llama model on a CPU as one
    `kernels.int4_layer` call, where every layer's projections run the int4 CPU
    kernel (q/k/v and gate/up fused by `fuse_projections`, o_proj and down_proj
    prepared, no bias); None where any layer doesn't (another block shape, other
    weights, a kernel not built): the torch layers run, as always off decode.
    `model.Transformer.forward` takes them at decode steps they apply to."""
    if not isinstance(model, Transformer) or not int4_layer.AVAILABLE:
        return None  # MoE and MLA models are other classes
    made = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (
            attn.__dict__.get("qkv_int4"),
            getattr(attn, "o_proj", None),
            mlp.__dict__.get("gate_up_int4"),
            getattr(mlp, "down_proj", None),
        )
        if not all(
            isinstance(p, QuantLinear) and p.int4_cpu is not None and p.bias is None
            for p in parts
        ):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(n.dtype != torch.float32 or n.device.type != "cpu" for n in norms):
            return None
        made.append(
            int4_layer.Int4DecodeLayer(
                *norms,
                layer.input_layernorm.eps,
                tuple(p.int4_cpu for p in parts),
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
            )
        )
    return made


def _fused_groups(model: nn.Module) -> list[QuantLinear]:
    return [
        group
        for module in model.modules()
        for attr in ("qkv_int4", "gate_up_int4")
        if (group := module.__dict__.get(attr)) is not None
    ]


def fuse_int4(layers: list[QuantLinear]) -> QuantLinear | None:
    """One int4 layer computing `layers` side by side (q/k/v, gate/up: same input),
    their rows stacked, for the decode kernel of `kernels.int4_cpu`: one call
    instead of several, each output row the same sum as before. The layers then
    view the fused tensors (no second copy). None where they can't fuse: not all
    int4 on a CPU with the kernel prepared, or group sizes, widths or zero points
    that differ."""
    first = layers[0]
    if not all(
        isinstance(m, QuantLinear)
        and m.bias is None
        and m.int4_cpu is not None
        and m.group_size == first.group_size
        and m.in_features == first.in_features
        and (m._zero_scale() is None) == (first._zero_scale() is None)
        for m in layers
    ):
        return None
    names = ["packed", "scale"] + (
        ["zero_scale"] if first._zero_scale() is not None else []
    )
    tensors = {name: torch.cat([getattr(m, name) for m in layers]) for name in names}
    n = sum(m.out_features for m in layers)
    fused = QuantLinear("int4", n, first.in_features, tensors, first.group_size)
    start = 0
    for m in layers:
        rows = slice(start, start + m.out_features)
        for name in names:
            setattr(m, name, getattr(fused, name)[rows])
        m.prepare_int4_cpu()
        start += m.out_features
    fused.prepare_int4_cpu()
    return fused


def tune_kernels(layers: Iterable[QuantLinear], dtype: torch.dtype) -> int:
    """On CUDA, time the Triton launch configs of each int8 / int4 layer shape not
    tuned yet in this process at decode batch sizes and keep the fastest
    (`kernels.matmul_tuning`), so decode runs the tiles this GPU does best with.
    Returns how many shapes were tuned."""
    shapes = {
        (8 if layer.kind == "int8" else 4, layer.out_features, layer.in_features,
         layer.group_size, str(layer.scale.device))
        for layer in layers
        if isinstance(layer, QuantLinear)
        and layer.kind in ("int8", "int4") and layer.scale.is_cuda
    }  # fmt: skip
    tuned = 0
    for bits, n, k, group_size, device in sorted(shapes, key=str):
        if (bits, 1, n, k, group_size) not in weight_matmul.TUNED_CONFIGS:
            matmul_tuning.tune(bits, n, k, group_size, dtype=dtype, device=device)
            tuned += 1
    return tuned


def use_cpu_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Run `model`'s quantized layers through torch's CPU kernels (laid out here,
    as `to_model` does at load in bf16) or, with `enabled=False`, through the torch
    reference of `kernels.weight_matmul` (parity checks). The kernels round
    activations to bf16, so in a float32 model they are a mixed arithmetic the
    engine never runs by itself. fp8 layers likewise hold their weight dequantized
    once (`to_model` does at load) or, disabled, dequantize it per call. Returns
    how many int8/int4 layers run the CPU kernels."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers + _fused_groups(model):
        layer.cpu_weight = layer.dense_weight = layer.packed_weight = None
        if enabled and layer.scale.device.type == "cpu":
            layer.prepack_cpu()
            layer.dequantize_cpu(layer.scale.dtype)
    return sum(layer.cpu_weight is not None for layer in layers)


HEAD_FORMATS = ("int8", "int4", "bf16")
# the group of each quantized head format by default: int8 as llama.cpp's Q8_0
HEAD_GROUP_SIZES = {"int8": 32, "int4": 64}


class Int8Head(nn.Module):
    """y = x W^T with W held as group-wise symmetric int8 (`kernels.int8_cpu`'s
    layout: codes [N, K] int8, scales [N, K / group] float32; at group 32 the
    Q8_0 of a GGUF), activations left in their dtype. On a CPU up to
    `int8_cpu.MAX_ROWS` rows (decode) run the fused kernel on float32 x; more rows
    (prefill's all-logits, quality evals), other devices, or a checkout without the
    extension run `int8_matmul_blocked` (W dequantized a block of rows at a time).

    Made from a float weight (`quantize`, the engine's `quantize_head`) or from the
    codes and scales a checkpoint stores (`split_quantized`: a release compressed
    with the recipe option head="int8")."""

    def __init__(self, codes: Tensor, scale: Tensor, group_size: int) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)

    @classmethod
    def quantize(cls, weight: Tensor, group_size: int) -> Int8Head:
        """The head of float `weight` [N, K] (`int8_cpu.quantize_int8`)."""
        codes, scale = int8_cpu.quantize_int8(weight, group_size)
        return cls(codes.to(weight.device), scale.to(weight.device), group_size)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xf = x2.float() if x2.shape[0] <= int8_cpu.MAX_ROWS else x2
        if int8_cpu.applies(xf, self.group_size):
            y = int8_cpu.int8_matmul(xf, self.codes, self.scale).to(x.dtype)
        else:
            y = int8_cpu.int8_matmul_blocked(x2, self.codes, self.scale)
        return y.reshape(*shape[:-1], self.out_features)


class Bf16Head(nn.Module):
    """y = x W^T with W held in bfloat16 (packed for oneDNN where it has bf16
    kernels), x rounded to bfloat16, float32 accumulation, float32 out."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16))
        self.packed_weight = prepack_weight(self.weight_bf16)

    def forward(self, x: Tensor) -> Tensor:
        xb = x.to(torch.bfloat16)
        if self.packed_weight is not None:
            return packed_linear(xb, self.packed_weight).to(x.dtype)
        return torch.nn.functional.linear(xb, self.weight_bf16).to(x.dtype)


def quantize_head(
    model: nn.Module, fmt: str, group_size: int | None = None
) -> nn.Module:
    """Replace `model.lm_head` by its own lower-precision copy (a tied head's
    embedding stays as it is, so the input embeddings are unchanged):

    - "int8": groups of `group_size` (default 32) inputs, symmetric
      round-to-nearest, float activations (`Int8Head`): the precision of the
      output head in llama.cpp's GGUFs (Q8_0; SmolLM2's Q4_1 GGUF stores its tied
      head so, and the project's SmolLM2 was converted from it, so on that model
      this copy is exact);
    - "int4": groups of `group_size` inputs, symmetric round-to-nearest
      (`kernels.weight_matmul.quantize_weight_int4`), run as every int4 layer is
      (`kernels.int4_cpu` at decode in a float32 model on a CPU);
    - "bf16": the weight in bfloat16, activations rounded to bfloat16 (`Bf16Head`).

    An engine option: it trades logits quality (the
    engine bench prints its KLD and top-1 against the model's own head) for
    decode speed, the head being the largest matmul of a small model
    (SmolLM2-135M's 49152 x 576, a fifth of its weights; on the 2-core AVX-512 dev
    machine, 1 thread: float32 3.8 ms, bf16 2.0 ms, int4-g64 1.0 ms a token).
    Their cost on SmolLM2 w4a16-g128 (engine bench, eval passages, against the
    checkpoint's head): int8-g32 mean KLD 3.7e-5, same top-1 99.8% (that folder
    keeps the head in bf16; the copy has the GGUF's Q8_0 codes again, its scales
    within 0.05%; on the float32 checkpoint it is exact: KLD 0 up to float32
    rounding, 100%); bf16 5.4e-4, 96.3%; int4-g64
    round-to-nearest 0.27 and 65.7%, too lossy to serve as is. The int8 head
    alone (`python -m gpuagent.benches.head_kernels`, 1 thread, the dev machine
    loaded): 1.9 ms a row against float32's 11.9; at 16 rows 0.74-0.93x the
    float32 GEMM (the same float32 multiply-adds, less well blocked).
    The recipe option head="int8" (`gpuagent.compress.head`) writes the "int8"
    head into the release instead (the same codes as this makes of the release
    without it), which the loader runs as an `Int8Head`, no flag needed.
    Raises ValueError for another format, a head already replaced (also a head the
    checkpoint stores quantized), or a group that doesn't divide the hidden size
    (int4: also a multiple of 16; int8: of 8)."""
    if fmt not in HEAD_FORMATS:
        raise ValueError(f"head format {fmt!r} is not supported; known: {HEAD_FORMATS}")
    head = model.lm_head
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"lm_head is already replaced ({type(head).__name__}: a second "
            "quantize_head, or a checkpoint whose head is stored quantized, e.g. "
            "by the recipe option head)"
        )
    weight = head.weight.detach()
    n, k = weight.shape
    if fmt == "bf16":
        model.lm_head = Bf16Head(weight)
        return model.lm_head
    if group_size is None:
        group_size = HEAD_GROUP_SIZES[fmt]
    if fmt == "int8":
        if group_size < 8 or group_size % 8 or k % group_size:
            raise ValueError(
                f"head group size {group_size} must be a multiple of 8 dividing {k}"
            )
        model.lm_head = Int8Head.quantize(weight, group_size)
        return model.lm_head
    if group_size % 16 or k % group_size:
        raise ValueError(
            f"head group size {group_size} must be a multiple of 16 dividing {k}"
        )
    packed, scale = quantize_weight_int4(weight.float(), group_size)
    layer = QuantLinear("int4", n, k, {"packed": packed, "scale": scale}, group_size)
    model.lm_head = to_model(layer, weight.dtype, str(weight.device))
    return model.lm_head


def quantized_param_names(layers: dict[str, QuantLinear]) -> set[str]:
    """Our parameter names that the quantized layers replace."""
    return {hf.removeprefix("model.") + ".weight" for hf in layers}
