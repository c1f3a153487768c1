"""`compress(source_dir, recipe, out_dir)`: a source model folder in, a
compressed-tensors folder out (the candidate the release pipeline evaluates).

The source goes through integrity inspection (a folder holding a pickle, remote
code or a malformed safetensors is refused) and the model is built from exactly
the bytes inspected. Two paths, the same output tensor for tensor:

- layer by layer (`gpuagent.compress.sequential`, the default): tensors read
  and checked one at a time (`integrity.streamed_load`), one decoder layer in
  memory, output shards written as layers finish; memory bounded by a few
  layers, not the model;
- in memory (`sequential=False`, and for sources the layer path does not take:
  an already quantized or a lossless source, which `load_model` decodes as a
  whole): every file read (`read_inspected_files`), the whole model built in
  float32, one `model.safetensors` written. Llama only: MoE models
  (deepseek_v3, kimi_k2, glm4_moe; `gpuagent.compress.moe`) are compressed layer
  by layer, and a source that path refuses is refused with its reason.

The output is written to a temporary folder beside `out_dir` and renamed into
place only when complete: a crash or an error leaves nothing at `out_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpuagent.compress.awq import scale_layer
from gpuagent.compress.calibration import calibration_sequences, run_layer
from gpuagent.compress.checkpoint import (
    DENSE_DTYPE,
    kv_cache_only_config,
    projection_target,
    quantization_config,
    quantized_tensors,
)
from gpuagent.compress.gptq import HessianAccumulator, quantize_gptq
from gpuagent.compress.head import (
    check_head_width,
    head_config_group,
    quantize_head_int8,
)
from gpuagent.compress.kv_scales import (
    DEFAULT_KV_SCALE_STRATEGY,
    check_strategy,
    kv_cache_scheme,
    kv_scale_tensors,
)
from gpuagent.compress.quantize import QuantizedWeight, quantize_rtn
from gpuagent.compress.recipes import (
    RecipeError,
    WeightScheme,
    parse_recipe,
    weight_scheme,
)
from gpuagent.compress.sequential import (
    DEFAULT_SPILL_BYTES,
    SequentialUnsupported,
    check_moe_recipe,
    compress_sequential,
    projection_kind,
)
from gpuagent.compress.signround import DEFAULT_STEPS, tune_layer
from gpuagent.compress.size_report import size_report
from gpuagent.engine.arch import MOE_MODEL_TYPES, MoEConfig
from gpuagent.engine.loader import (
    CONFIG_FILE,
    INDEX_FILE,
    WEIGHTS_FILE,
    ModelLoadError,
    load_model,
)
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.integrity import IntegrityError, read_inspected_files
from gpuagent.integrity.streamed_load import open_inspected
from gpuagent.protocol import CompressResult, Recipe

# progress(done, total, what): called after each layer.
Progress = Callable[[int, int, str], None]
# The projections of a decoder layer by shared input, in the order the layer runs
# them: GPTQ quantizes a group on the inputs the quantized groups before it produce.
_INPUT_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


class CompressError(ValueError):
    """The source or the output path can't be used; the message says why."""


def compress(
    source_dir: str | Path,
    recipe: Recipe | dict[str, Any],
    out_dir: str | Path,
    progress: Progress | None = None,
    *,
    calibration_size: tuple[int, int] | None = None,
    kv_scale_strategy: str = DEFAULT_KV_SCALE_STRATEGY,
    sequential: bool = True,
    max_shard_bytes: int | None = None,
    spill_bytes: int = DEFAULT_SPILL_BYTES,
    signround_steps: int = DEFAULT_STEPS,
) -> CompressResult:
    """Compress `source_dir` under `recipe` into `out_dir` (which must not exist).

    `calibration_size` (sequences, tokens each) overrides the GPTQ / KV calibration
    defaults; `kv_scale_strategy` is the layout of fp8 KV scales ("tensor" or
    "attn_head", gpuagent.compress.kv_scales). `sequential` picks the layer-by-layer
    path (module docstring), whose output shards hold at most `max_shard_bytes`
    (None: one layer in bf16, at least 128 MiB) and
    whose calibration hidden states go to a file over `spill_bytes`. MoE models:
    GPTQ rounds an expert routed fewer than the recipe's `min_expert_tokens`
    calibration tokens to nearest instead (named in the result). `signround_steps`: the
    sign-gradient steps per layer of method "signround" (0: round to nearest on
    its scales). Raises
    RecipeError for recipes that can't be applied, CompressError for a refused
    source or an existing output."""
    started = time.monotonic()
    recipe = parse_recipe(recipe)
    scheme = weight_scheme(recipe)
    try:
        check_strategy(kv_scale_strategy)
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.exists():
        raise CompressError(f"{out_dir} already exists; refusing to overwrite it")
    progress = progress or (lambda done, total, what: None)
    if signround_steps < 0:
        raise RecipeError(f"signround_steps={signround_steps} must be >= 0")
    if sequential:
        try:
            src = open_inspected(source_dir)
        except IntegrityError as exc:
            raise CompressError(
                f"source {source_dir} failed inspection: {exc}"
            ) from exc
        with src:
            try:
                hf_config = json.loads(src.files[CONFIG_FILE].decode("utf-8"))
            except (KeyError, ValueError) as exc:
                raise ModelLoadError(f"{CONFIG_FILE} is not readable: {exc}") from exc
            if not isinstance(hf_config, dict):
                raise ModelLoadError(f"{CONFIG_FILE} is not a JSON object")
            try:
                return compress_sequential(
                    src,
                    source_dir,
                    hf_config,
                    recipe,
                    scheme,
                    out_dir,
                    progress,
                    calibration_size=calibration_size,
                    kv_scale_strategy=kv_scale_strategy,
                    max_shard_bytes=max_shard_bytes,
                    spill_bytes=spill_bytes,
                    signround_steps=signround_steps,
                    started=started,
                )
            except SequentialUnsupported as exc:
                if hf_config.get("model_type") in MOE_MODEL_TYPES:
                    raise CompressError(
                        f"{hf_config['model_type']} sources are compressed layer by "
                        f"layer only, and this one can't be: {exc}"
                    ) from exc
                # the in-memory path below takes it
    try:
        files, _digest = read_inspected_files(source_dir)
    except IntegrityError as exc:
        raise CompressError(f"source {source_dir} failed inspection: {exc}") from exc
    model = load_model(source_dir, files=files, dtype=torch.float32)
    if isinstance(model.config, MoEConfig):
        raise CompressError(
            f"{model.config.model_type} models are compressed layer by layer only "
            "(sequential=True)"
        )
    check_moe_recipe(model.config, recipe, scheme)
    tokenizer = load_tokenizer(source_dir, files=files)
    if scheme and scheme.quantize_lm_head and model.config.tie_word_embeddings:
        raise RecipeError(
            "quantize_lm_head=true but lm_head is tied to the embeddings "
            "(tie_word_embeddings=true), which stay unquantized"
        )
    if scheme and scheme.head:
        check_head_width(model.config.hidden_size)
    needs_text = (
        scheme and (scheme.method != "rtn" or scheme.awq)
    ) or recipe.kv_cache_dtype == "fp8"
    sequences = None
    if needs_text:
        sequences = calibration_sequences(tokenizer, *(calibration_size or ()))

    quantized = (
        _quantize_model(model, scheme, sequences, progress, signround_steps)
        if scheme
        else {}
    )
    dense_dtype = torch.float16 if recipe.weights == "fp16" else DENSE_DTYPE
    head = (  # the head's own format (gpuagent.compress.head), untied
        quantize_head_int8(model.lm_head.weight, dense_dtype)
        if scheme and scheme.head
        else None
    )
    kv_tensors = {}
    if recipe.kv_cache_dtype == "fp8":
        kv_tensors = kv_scale_tensors(model, sequences, kv_scale_strategy)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        hf_config = json.loads(files[CONFIG_FILE])
        tensors = _output_tensors(model, quantized, recipe, head) | kv_tensors
        kv_scheme = kv_cache_scheme(kv_scale_strategy) if kv_tensors else None
        if scheme:
            hf_config["quantization_config"] = _quant_config(
                scheme, quantized, kv_scheme
            )
        elif kv_scheme:  # dense weights, fp8 KV: the scales' scheme alone
            hf_config["quantization_config"] = kv_cache_only_config(kv_scheme)
        if head is not None:
            hf_config["tie_word_embeddings"] = False
        # transformers 5 and vLLM read `dtype` first, older readers `torch_dtype`:
        # both, so a source's stale `dtype` never wins over the weights written.
        dense = "float16" if recipe.weights == "fp16" else "bfloat16"
        hf_config["dtype"] = hf_config["torch_dtype"] = dense
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        for name, data in files.items():
            if name in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) or name.endswith(
                ".safetensors"
            ):
                continue
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)  # tokenizer, generation config: unchanged
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)  # mkdtemp made it 0700
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sizes, before, after, gpu = size_report(model, tensors, files)
    return CompressResult(
        out_dir=str(out_dir),
        recipe=recipe,
        quantized_layers=len(quantized) + (head is not None),
        sizes=sizes,
        total_bytes_before=before,
        total_bytes_after=after,
        expected_gpu_weight_bytes=gpu,
        kv_scales=bool(kv_tensors),
        kv_scale_strategy=kv_scale_strategy if kv_tensors else None,
        group_sizes={
            p: q.group_size
            for p, q in _by_projection(quantized).items()
            if q.group_size is not None
        },
        seconds=time.monotonic() - started,
    )


def _quantize_model(
    model,
    scheme: WeightScheme,
    sequences,
    progress: Progress,
    signround_steps: int = DEFAULT_STEPS,
) -> dict[str, QuantizedWeight]:
    """Quantize every projection (and an untied head when asked); the model's
    weights are replaced by their dequantized values as it goes, so GPTQ's later
    layers see the inputs the quantized earlier layers produce."""
    quantized: dict[str, QuantizedWeight] = {}
    total = len(model.layers) + int(scheme.quantize_lm_head)
    if scheme.method != "rtn" or scheme.awq:
        _calibrated_layers(
            model, scheme, sequences, total, progress, quantized, signround_steps
        )
    else:
        for i, layer in enumerate(model.layers):
            _quantize_layer(i, layer, scheme, quantized)
            progress(i + 1, total, f"layer {i}")
    if scheme.quantize_lm_head:
        qw = quantize_rtn(model.lm_head.weight, scheme)
        _replace_weight(model.lm_head, qw)
        quantized["lm_head"] = qw
        progress(total, total, "lm_head")
    return quantized


def _replace_weight(module: torch.nn.Linear, qw: QuantizedWeight) -> None:
    with torch.no_grad():
        module.weight.copy_(qw.dequantize())


def _quantize_layer(i, layer, scheme, quantized, calibration=None) -> None:
    """Every projection of decoder layer i: RTN, or GPTQ when `calibration`
    (hidden, cos, sin) is given, one group of projections sharing an input at a
    time, each group's Hessian from the inputs the layer produces with the groups
    before it already quantized (GPTQ's "true sequential" order)."""
    for group in _INPUT_GROUPS:
        hessian = None
        if calibration is not None:
            acc = HessianAccumulator(layer.get_submodule(group[0]).in_features)
            run_layer(layer, *calibration, {group[0]: acc.add})
            hessian = acc.hessian
        for p in group:
            module = layer.get_submodule(p)
            if hessian is None:
                qw = quantize_rtn(module.weight, scheme)
            else:
                qw = quantize_gptq(module.weight, hessian, scheme)
            _replace_weight(module, qw)
            quantized[f"model.layers.{i}.{p}"] = qw


def _calibrated_layers(
    model, scheme, sequences, total, progress, quantized, signround_steps
) -> None:
    """Layer by layer on the calibration tokens, each layer seeing the outputs of
    the quantized layers before it: AWQ scales folded in (`scheme.awq`), then
    GPTQ on the Hessians of the (scaled) inputs, sign-gradient rounding towards the
    unquantized model's outputs (carried beside), or RTN."""
    tokens = torch.tensor(sequences)  # [B, T]
    positions = torch.arange(tokens.shape[1])
    with torch.no_grad():
        cos, sin = model._rope(positions)  # [T, 1, D]
        hidden = model.embed_tokens(tokens)  # [B, T, hidden]
        unquantized = hidden if scheme.method == "signround" else None
        for i, layer in enumerate(model.layers):
            if scheme.awq:
                scale_layer(layer, hidden, cos, sin, scheme)
            if unquantized is not None:
                unquantized = run_layer(layer, unquantized, cos, sin)
                for p, qw in tune_layer(
                    layer, hidden, unquantized, cos, sin, scheme, signround_steps
                ).items():
                    quantized[f"model.layers.{i}.{p}"] = qw
            else:
                gptq = scheme.method == "gptq"
                _quantize_layer(
                    i, layer, scheme, quantized, (hidden, cos, sin) if gptq else None
                )
            hidden = run_layer(layer, hidden, cos, sin)
            progress(i + 1, total, f"layer {i}")


def _output_tensors(
    model, quantized, recipe: Recipe, head: QuantizedWeight | None = None
) -> dict[str, torch.Tensor]:
    dense_dtype = torch.float16 if recipe.weights == "fp16" else DENSE_DTYPE
    tensors: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        hf = name if name == "lm_head.weight" else "model." + name
        module = hf.removesuffix(".weight")
        if module == "lm_head" and head is not None:  # stored untied
            tensors |= quantized_tensors(module, head)
        elif module in quantized:
            tensors |= quantized_tensors(module, quantized[module])
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        else:
            tensors[hf] = param.detach().to(dense_dtype).contiguous()
    return tensors


def _by_projection(quantized: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    # one example per projection kind ("mlp.down_proj", "mlp.experts.up_proj")
    out = {}
    for name, qw in quantized.items():
        out.setdefault(projection_kind(name), qw)
    return out


def _quant_config(
    scheme, quantized, kv_scheme: dict | None, extra_ignore: list[str] = ()
) -> dict[str, Any]:
    group_targets: dict[int | None, list[str]] = {}
    for kind, qw in _by_projection(quantized).items():
        target = "re:^lm_head$" if kind == "lm_head" else projection_target(kind)
        group_targets.setdefault(qw.group_size, []).append(target)
    ignore = [] if scheme.quantize_lm_head or scheme.head else ["lm_head"]
    config = quantization_config(
        scheme, group_targets, ignore + list(extra_ignore), kv_scheme
    )
    if scheme.head:  # its own group (gpuagent.compress.head)
        groups = config["config_groups"]
        groups[f"group_{len(groups)}"] = head_config_group()
    return config
