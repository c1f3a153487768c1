"""Layer-by-layer compression (sequential onloading, as llm-compressor does): the
same output as the in-memory path (`pipeline._compress_in_memory`), tensor for
tensor, with memory bounded by a decoder layer or two, not by the model.

- The source is opened with `integrity.streamed_load.open_inspected`: every file
  hashed in a streaming pass first, then each tensor read from the same
  descriptor when it is needed and used only if its bytes are those the digest
  covered.
- One decoder layer at a time is built in float32 from its own tensors, quantized
  (RTN, GPTQ, AWQ scales, sign-gradient rounding: the in-memory path's own
  functions, in the same order), run over the calibration hidden states it needs
  (carried from layer to layer, `Activations`: spilled to a file in the
  temporary output folder when larger than `spill_bytes`), its fp8 KV scales taken
  (the paged prefill the engine's calibration runs, one layer at a time over
  per-sequence hidden states), then written and dropped.
- Output tensors go to safetensors shards of at most `max_shard_bytes` as layers
  finish (`shard_writer.ShardWriter`, written from the tensors held, no copy),
  in a temporary folder renamed into place at the end;
  several shards get `model.safetensors.index.json`, a single one is written as
  `model.safetensors`, byte for byte the in-memory path's file.
- DeepSeek-V3 / Kimi K2 / GLM-4.5 MoE sources (`engine.arch`) take this path only:
  each layer is an `arch.MoEBlock`, quantized by `gpuagent.compress.moe` (per
  expert, GPTQ on the tokens routed to each), sized by the MoE tensor classes
  (`size_report`); the multi-token-prediction layers after the decoder are not
  carried (serving does not run them; transformers drops them on load too).
- A source in DeepSeek's published block fp8 (DeepSeek-V3, Kimi K2 as released:
  `engine.fp8_blocks`) is read tensor by tensor too, each fp8 weight dequantized
  with its `weight_scale_inv` blocks to float32 when its layer is built; the
  output's `quantization_config` is the recipe's (none for bf16 weights).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import kernels
from gpuagent.compress.awq import scale_layer
from gpuagent.compress.calibration import calibration_sequences, run_layer
from gpuagent.compress.checkpoint import (
    DENSE_DTYPE,
    kv_cache_only_config,
    quantized_tensors,
)
from gpuagent.compress.head import check_head_width, quantize_head_int8
from gpuagent.compress.kv_scales import _SHAPES, kv_cache_scheme
from gpuagent.compress.moe import (
    ROUTER_IGNORE,
    dense_linears,
    quantize_moe_layer,
)
from gpuagent.compress.quantize import quantize_rtn
from gpuagent.compress.recipes import RecipeError, WeightScheme
from gpuagent.compress.shard_writer import ShardWriter
from gpuagent.compress.signround import DEFAULT_STEPS, tune_layer
from gpuagent.compress.size_report import (
    moe_parameters,
    tensor_class,
    tensor_classes,
)
from gpuagent.engine import arch, fp8_blocks
from gpuagent.engine.kv_calibration import FP8_MAX
from gpuagent.engine.loader import (
    CONFIG_FILE,
    IGNORED_SUFFIXES,
    INDEX_FILE,
    WEIGHTS_FILE,
    ModelLoadError,
    check_supported_config,
)
from gpuagent.engine.model import (
    AttentionMetadata,
    LlamaConfig,
    TransformerBlock,
    rope_cos_sin,
    rope_inv_freq,
)
from gpuagent.engine.tokenizer import load_tokenizer
from gpuagent.integrity.streamed_load import StreamedModel
from gpuagent.protocol import (
    DEFAULT_MIN_EXPERT_TOKENS,
    CompressResult,
    ExpertFallback,
    Recipe,
    TensorClassSize,
)

# Output shards (`max_shard_bytes=None`): one decoder layer in bf16, at least 128
# MiB. The shard being filled is held in memory, so it is sized like the layer
# that is (a small model's output then fits one `model.safetensors`, the in-memory
# path's file; a 70B layer's 1.7 GB gives shards of that size).
MIN_SHARD_BYTES = 128 << 20
# Calibration hidden states larger than this are carried in a file, not in memory.
DEFAULT_SPILL_BYTES = 256 << 20
SOURCE_DTYPES = ("F32", "BF16", "F16")


class SequentialUnsupported(ValueError):
    """The source is one the layer-by-layer path does not take (the in-memory
    path does); the message says why."""


def _release_freed_memory() -> None:
    """Hand memory freed by the layer just done back to the OS (glibc's
    `malloc_trim`; elsewhere nothing). glibc raises its mmap threshold to the
    size of each large block freed (up to 32 MiB), so a layer's weights and
    temporaries come from the heap, whose freed pages it keeps: without this the
    resident size creeps up layer after layer."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _load_libc()


class Activations:
    """Calibration hidden states [B, T, hidden] carried between layers: in memory,
    or (over `spill_bytes`) written to a file of `folder` and mapped back
    privately, so that the states a layer reads are clean file pages the kernel
    may drop and read again under memory pressure, not anonymous memory. What
    stays in memory: the states the current layer produces (`run_layer` joins its
    batches) and the methods' own per-layer statistics (GPTQ's Hessians, AWQ's
    sampled rows)."""

    def __init__(self, folder: Path, spill_bytes: int, label: str) -> None:
        self.folder, self.spill_bytes, self.label = folder, spill_bytes, label
        self.count = 0

    def keep(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.numel() * hidden.element_size() <= self.spill_bytes:
            return hidden
        self.count += 1
        path = self.folder / f".activations-{self.label}-{self.count % 2}.bin"
        hidden.contiguous().numpy().tofile(path)
        shape, dtype = hidden.shape, hidden.dtype
        del hidden
        mapped = torch.from_file(
            str(path), shared=False, size=int(torch.Size(shape).numel()), dtype=dtype
        )
        return mapped.view(shape)


def _block(config: LlamaConfig | arch.MoEConfig, index: int) -> torch.nn.Module:
    # decoder layer `index` of the config's architecture (on the current device)
    if isinstance(config, arch.MoEConfig):
        return arch.MoEBlock(config, index)
    return TransformerBlock(config)


def _rope(config: LlamaConfig | arch.MoEConfig) -> tuple[torch.Tensor, float]:
    # (inverse frequencies, cos/sin scale) as the engine's model computes them
    if isinstance(config, arch.MoEConfig):
        return arch.rope_parameters(config)
    return rope_inv_freq(config), 1.0


def check_source(
    src: StreamedModel, hf_config: dict[str, Any]
) -> LlamaConfig | arch.MoEConfig:
    """The source's config, if this path takes it; SequentialUnsupported naming
    why not (a quantized or lossless source goes through the in-memory path),
    ValueError for a checkpoint that does not match its config."""
    from gpuagent.engine import weights

    if weights.is_quantized(hf_config) and not fp8_blocks.is_block_fp8(hf_config):
        raise SequentialUnsupported("the source is already quantized")
    block = source_block(hf_config)
    if not src.headers:
        raise SequentialUnsupported("the source has no .safetensors checkpoint")
    check_supported_config(hf_config)
    try:
        config = arch.config_for(hf_config)
    except KeyError as exc:
        raise ModelLoadError(f"{CONFIG_FILE} lacks {exc}") from exc
    except (ArithmeticError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{CONFIG_FILE}: {exc}") from exc
    if INDEX_FILE in src.files:
        index = json.loads(src.files[INDEX_FILE])
        listed = set(index.get("weight_map", {}).values())
        unlisted = sorted(set(src.headers) - listed)
        if unlisted:
            raise ModelLoadError(f"{INDEX_FILE} does not name {unlisted}")
        for name, shard in index["weight_map"].items():
            ref = src.refs.get(name)
            if ref is None or ref.file != shard:
                raise ModelLoadError(f"{shard} does not hold {name} ({INDEX_FILE})")
    elif set(src.headers) != {WEIGHTS_FILE}:
        raise SequentialUnsupported(f"shards without {INDEX_FILE}")
    expected = _expected_shapes(config)
    present = {
        n: r
        for n, r in src.refs.items()
        if not n.endswith(IGNORED_SUFFIXES)
        and not arch.extra_checkpoint_layer(n, config)
    }
    if config.tie_word_embeddings:
        present.pop("lm_head.weight", None)
    problems = []
    if block is not None:  # each fp8 weight with its block scales, read together
        scales = {n for n in present if n.endswith(fp8_blocks.SCALE_SUFFIX)}
        for n in sorted(scales):
            weight = n.removesuffix(fp8_blocks.SCALE_SUFFIX) + ".weight"
            ref = present.get(weight)
            if ref is None or ref.dtype != "F8_E4M3":
                problems.append(f"{n} has no fp8 weight {weight}")
                continue
            want = tuple(-(-d // b) for d, b in zip(ref.shape, block, strict=True))
            if tuple(present[n].shape) != want:
                problems.append(f"{n}: shape {present[n].shape}, expected {want}")
        for n in scales:
            present.pop(n)
        fp8 = {
            n
            for n, r in present.items()
            if r.dtype == "F8_E4M3"
            and n.removesuffix(".weight") + fp8_blocks.SCALE_SUFFIX in scales
        }
    else:
        fp8 = set()
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    misshapen = [
        f"{n}: checkpoint {present[n].shape} vs config {expected[n]}"
        for n in expected
        if n in present and present[n].shape != expected[n]
    ]
    bad_dtypes = {
        n: r.dtype
        for n, r in present.items()
        if r.dtype not in SOURCE_DTYPES and n not in fp8
    }
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if misshapen:
        problems.append(f"shape mismatch {misshapen}")
    if bad_dtypes:
        problems.append(f"unsupported tensor dtypes {bad_dtypes}")
    if problems:
        raise ModelLoadError("checkpoint does not match config: " + "; ".join(problems))
    return config


def source_block(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, columns) scale block of a block-fp8 source; None for a plain one.
    ModelLoadError for a block-fp8 config `engine.fp8_blocks` does not read."""
    if not fp8_blocks.is_block_fp8(hf_config):
        return None
    try:
        return fp8_blocks.block_size(hf_config["quantization_config"])
    except fp8_blocks.BlockFp8Error as exc:
        raise ModelLoadError(str(exc)) from exc


def default_shard_bytes(config: LlamaConfig | arch.MoEConfig) -> int:
    """Output shard size for `max_shard_bytes=None`: one (the last) layer in bf16,
    at least MIN_SHARD_BYTES."""
    with torch.device("meta"):
        block = _block(config, config.num_hidden_layers - 1)
    layer = sum(p.numel() for p in block.parameters()) * 2
    return max(MIN_SHARD_BYTES, layer)


def _expected_shapes(
    config: LlamaConfig | arch.MoEConfig,
) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, as the model's state dict has
    them (built a layer at a time: a whole model on the meta device first costs
    torch ~80 MB of imports for its embedding; an MoE model's dense and MoE layers
    each built once)."""
    shapes: dict[bool, dict[str, tuple[int, ...]]] = {}
    expected = {}
    for i in range(config.num_hidden_layers):
        kind = i < getattr(config, "first_k_dense_replace", 0)
        if kind not in shapes:
            with torch.device("meta"):
                block = _block(config, i)
            shapes[kind] = {n: tuple(p.shape) for n, p in block.state_dict().items()}
        for n, shape in shapes[kind].items():
            expected[f"model.layers.{i}.{n}"] = shape
    v, h = config.vocab_size, config.hidden_size
    expected["model.embed_tokens.weight"] = (v, h)
    expected["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (v, h)
    return expected


class SequentialCompressor:
    """One run of the layer-by-layer path (module docstring); `run()` writes the
    tensors and returns what `pipeline` needs to finish the folder."""

    def __init__(
        self,
        src: StreamedModel,
        src_dir: Path,
        config: LlamaConfig | arch.MoEConfig,
        recipe: Recipe,
        scheme: WeightScheme | None,
        tmp: Path,
        progress,
        *,
        calibration_size,
        kv_scale_strategy: str,
        max_shard_bytes: int,
        spill_bytes: int,
        block: tuple[int, int] | None = None,
        signround_steps: int = DEFAULT_STEPS,
    ) -> None:
        self.src, self.config, self.recipe, self.scheme = src, config, recipe, scheme
        self.block = block  # a block-fp8 source's scale block
        self.moe = isinstance(config, arch.MoEConfig)
        self.signround_steps = signround_steps
        self.fallbacks: list[ExpertFallback] = []
        self.ignore: list[str] = []  # MoE: Linears left dense, by full name
        self.src_dir = src_dir
        self.tmp, self.progress = tmp, progress
        self.calibration_size = calibration_size
        self.kv_strategy = kv_scale_strategy
        self.writer = ShardWriter(tmp, max_shard_bytes)
        self.spill_bytes = spill_bytes
        self.dense = torch.float16 if recipe.weights == "fp16" else DENSE_DTYPE
        self.after = dict.fromkeys(tensor_classes(self.moe), 0)
        self.examples: dict[str, Any] = {}  # one QuantizedWeight per projection kind
        self.quantized_count = 0
        self.kv_written = False

    # -- tensors
    def _f32(self, name: str) -> torch.Tensor:
        tensor = self.src.tensor(name)
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor.to(torch.float32)
        # block fp8 (check_source paired it with its scales): W = codes * scale
        scale = name.removesuffix(".weight") + fp8_blocks.SCALE_SUFFIX
        rows, cols = self.block
        qc = {"weight_block_size": [rows, cols]}
        both = {name: tensor, scale: self.src.tensor(scale)}
        try:
            return fp8_blocks.dequantize(both, qc)[name]
        except fp8_blocks.BlockFp8Error as exc:
            raise ModelLoadError(str(exc)) from exc

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.after[tensor_class(name, self.moe)] += t.numel() * t.element_size()
        self.writer.add(tensors)

    def _write_quantized(self, quantized: dict) -> None:
        for module, qw in quantized.items():
            self._write(quantized_tensors(module, qw))
            kind = projection_kind(module)
            if kind not in self.examples:
                self.examples[kind] = _GroupOnly(qw.group_size)
            self.quantized_count += 1

    def _layer(self, i: int) -> torch.nn.Module:
        with torch.device("meta"):
            block = _block(self.config, i)
        state = {n: self._f32(f"model.layers.{i}.{n}") for n in block.state_dict()}
        block.load_state_dict(state, assign=True)
        return block.eval()

    # -- the run
    def run(self) -> None:
        from gpuagent.compress.pipeline import _quantize_layer

        config, scheme, recipe = self.config, self.scheme, self.recipe
        embed = self._f32("model.embed_tokens.weight")
        if config.tie_word_embeddings and "lm_head.weight" in self.src.refs:
            if not torch.equal(self._f32("lm_head.weight"), embed):
                raise ModelLoadError(
                    "tie_word_embeddings=true but lm_head.weight differs from "
                    "model.embed_tokens.weight"
                )
        calibrated = scheme is not None and (scheme.method != "rtn" or scheme.awq)
        kv = recipe.kv_cache_dtype == "fp8"
        sequences = None
        if calibrated or kv:
            tokenizer = load_tokenizer(self.src_dir, files=self.src.files)
            sequences = calibration_sequences(tokenizer, *(self.calibration_size or ()))
        inv_freq, rope_scale = _rope(config)
        hidden = unquantized = kv_hidden = None
        acts = Activations(self.tmp, self.spill_bytes, "hidden")
        ref_acts = Activations(self.tmp, self.spill_bytes, "reference")
        if calibrated:
            tokens = torch.tensor(sequences)
            cos, sin = _cos_sin(inv_freq, tokens.shape[1], rope_scale)
            hidden = acts.keep(F.embedding(tokens, embed))
            if scheme.method == "signround":
                unquantized = hidden
        if kv:
            # one prefill per sequence, as engine.kv_calibration.static_kv_scales
            kv_hidden = [F.embedding(torch.tensor(ids), embed) for ids in sequences]
            kv_absmax = []
        tied = config.tie_word_embeddings
        self._write({"model.embed_tokens.weight": embed.to(self.dense)})
        if not tied:
            del embed
        total = config.num_hidden_layers + int(
            bool(scheme and (scheme.quantize_lm_head or scheme.head))
        )
        for i in range(config.num_hidden_layers):
            layer = self._layer(i)
            quantized: dict = {}
            if scheme is not None and self.moe:
                gptq = scheme.method == "gptq"
                with torch.no_grad():
                    quantize_moe_layer(
                        i,
                        layer,
                        scheme,
                        quantized,
                        (hidden, cos, sin) if gptq else None,
                        fallbacks=self.fallbacks,
                    )
                    if gptq:
                        hidden = acts.keep(run_layer(layer, hidden, cos, sin))
                prefix = f"model.layers.{i}."
                self.ignore += [prefix + n for n in dense_linears(layer, scheme)]
            elif scheme is not None and not calibrated:
                _quantize_layer(i, layer, scheme, quantized)
            elif calibrated:
                with torch.no_grad():
                    if scheme.awq:
                        scale_layer(layer, hidden, cos, sin, scheme)
                    if unquantized is not None:
                        unquantized = ref_acts.keep(
                            run_layer(layer, unquantized, cos, sin)
                        )
                        for p, qw in tune_layer(
                            layer,
                            hidden,
                            unquantized,
                            cos,
                            sin,
                            scheme,
                            steps=self.signround_steps,
                        ).items():
                            quantized[f"model.layers.{i}.{p}"] = qw
                    else:
                        gptq = scheme.method == "gptq"
                        _quantize_layer(
                            i,
                            layer,
                            scheme,
                            quantized,
                            (hidden, cos, sin) if gptq else None,
                        )
                    hidden = acts.keep(run_layer(layer, hidden, cos, sin))
            if kv:
                kv_hidden, absmax = _layer_kv_absmax(layer, kv_hidden, inv_freq)
                kv_absmax.append(absmax)
            self._write_layer(i, layer, quantized)
            del layer, quantized
            _release_freed_memory()
            if scheme is not None:
                self.progress(i + 1, total, f"layer {i}")
        del hidden, unquantized, kv_hidden
        self._write(
            {"model.norm.weight": self._f32("model.norm.weight").to(self.dense)}
        )
        if scheme is not None and scheme.quantize_lm_head:
            qw = quantize_rtn(self._f32("lm_head.weight"), scheme)
            self._write_quantized({"lm_head": qw})
            self.progress(total, total, "lm_head")
        elif scheme is not None and scheme.head:
            # its own format and config group (gpuagent.compress.head), untied;
            # not among `examples`, which are the weight scheme's groups
            weight = embed if tied else self._f32("lm_head.weight")
            qw = quantize_head_int8(weight, self.dense)
            self._write(quantized_tensors("lm_head", qw))
            self.quantized_count += 1
            self.progress(total, total, "lm_head")
        elif not tied:
            self._write({"lm_head.weight": self._f32("lm_head.weight").to(self.dense)})
        if kv:
            self._write(_kv_tensors(kv_absmax, self.kv_strategy))
            self.kv_written = True

    def _write_layer(self, i: int, layer: TransformerBlock, quantized: dict) -> None:
        # the layer's tensors in the in-memory path's order and formats
        tensors = {}
        for name, param in layer.state_dict().items():
            module = f"model.layers.{i}.{name}".removesuffix(".weight")
            if module not in quantized:
                # the router's correction bias stays float32, as published: a
                # rounded bias can change which experts a token gets
                keep = self.moe and name.endswith("e_score_correction_bias")
                dtype = torch.float32 if keep else self.dense
                tensors[f"model.layers.{i}.{name}"] = (
                    param.detach().to(dtype).contiguous()
                )
        self._write(tensors)
        self._write_quantized(quantized)


def check_moe_recipe(
    config: LlamaConfig | arch.MoEConfig, recipe: Recipe, scheme: WeightScheme | None
) -> None:
    """Refuse, by name, what this path does not do for the config's architecture."""
    if not isinstance(config, arch.MoEConfig):
        moe_options = [
            name
            for name, default in (
                ("quantize_shared_experts", True),
                ("quantize_dense_layers", True),
                ("min_expert_tokens", DEFAULT_MIN_EXPERT_TOKENS),
            )
            if getattr(recipe, name) != default
        ]
        if moe_options:
            raise RecipeError(
                f"{' / '.join(moe_options)} apply to MoE models (deepseek_v3, "
                f"kimi_k2, glm4_moe) only, not {type(config).__name__}"
            )
        return
    if recipe.kv_cache_dtype == "fp8":
        raise RecipeError(
            "kv_cache_dtype 'fp8' (static checkpoint KV scales) is not offered for "
            f"{config.model_type}: the engine quantizes MoE models' caches at run "
            "time (bf16 or a per-token dtype in the recipe)"
        )
    if scheme is not None and (scheme.awq or scheme.method == "signround"):
        raise RecipeError(
            f"{'awq' if scheme.awq else 'signround'} is not implemented for MoE "
            f"models ({config.model_type}); use method 'rtn' or 'gptq'"
        )


def projection_kind(module: str) -> str:
    """A quantized module's kind: its name within the layer, the expert index
    dropped ("mlp.experts.gate_proj"), or the module itself ("lm_head")."""
    if not module.startswith("model.layers."):
        return module
    kind = module.split(".", 3)[-1]
    if kind.startswith("mlp.experts."):
        kind = "mlp.experts." + kind.split(".", 3)[-1]
    return kind


class _GroupOnly:
    """What the config groups need of a QuantizedWeight (its group size)."""

    def __init__(self, group_size: int | None) -> None:
        self.group_size = group_size


def _cos_sin(
    inv_freq: torch.Tensor, length: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    # as Transformer._rope (MoETransformer._rope: YaRN's scale) for a float32 model
    cos, sin = rope_cos_sin(inv_freq, torch.arange(length))
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(torch.float32), sin.to(torch.float32)


def _layer_kv_absmax(
    layer: TransformerBlock, hiddens: list[torch.Tensor], inv_freq: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One layer of `static_kv_scales(model, sequences, rotated=False)`: each
    sequence's prefill through the layer into a float32 cache, the absmax per kv
    head of K and V written ([2, KVH]), and the hidden states leaving it."""
    attn_mod = layer.self_attn
    heads, dim = attn_mod.num_kv_heads, attn_mod.head_dim
    absmax = torch.zeros(2, heads)
    out = []
    for h in hiddens:
        n = h.shape[0]
        cache = kernels.allocate_kv_cache("fp32", n, 1, heads, dim, rotated=False)
        attn = AttentionMetadata(
            slot_mapping=torch.arange(n),
            block_tables=torch.arange(n, dtype=torch.int32)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            context_lens=torch.tensor([n], dtype=torch.int32),
            decode_only=n == 1,
        )
        cos, sin = _cos_sin(inv_freq, n)
        with torch.inference_mode():
            out.append(layer(h, cos, sin, cache, attn))
        for which, store in enumerate((cache.key, cache.value)):
            seen = store.view(n, heads, dim).abs().amax(dim=(0, 2))
            absmax[which] = torch.maximum(absmax[which], seen)
    return out, absmax


def _kv_tensors(absmax: list[torch.Tensor], strategy: str) -> dict[str, torch.Tensor]:
    # kv_scales.kv_scale_tensors on the per-layer absmax, as static_kv_scales ends
    shape = _SHAPES[strategy]
    scales = (torch.stack(absmax) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    tensors = {}
    for i, s in enumerate(scales):
        prefix = f"model.layers.{i}.self_attn"
        for name, per_head in (("k_scale", s[0]), ("v_scale", s[1])):
            scale = per_head.float().reshape(-1)
            if strategy == "tensor":
                scale = scale.max()
            tensors[f"{prefix}.{name}"] = scale.reshape(shape).contiguous()
    return tensors


def source_sizes(
    src: StreamedModel, config: LlamaConfig | arch.MoEConfig | None = None
) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes as stored, bytes in bf16) per tensor class of the source's headers,
    as size_report counts them (an MoE model's classes, its multi-token-prediction
    layers left out as the output leaves them out)."""
    import math

    moe = isinstance(config, arch.MoEConfig)
    before = dict.fromkeys(tensor_classes(moe), 0)
    bf16 = dict.fromkeys(tensor_classes(moe), 0)
    for header in src.headers.values():
        for entry in header.tensors.values():
            if moe and arch.extra_checkpoint_layer(entry.name, config):
                continue
            before[tensor_class(entry.name, moe)] += entry.end - entry.begin
            if not entry.name.endswith(fp8_blocks.SCALE_SUFFIX):  # not a weight
                bf16[tensor_class(entry.name, moe)] += math.prod(entry.shape) * 2
    return before, bf16


def compress_sequential(
    src: StreamedModel,
    source_dir: Path,
    hf_config: dict[str, Any],
    recipe: Recipe,
    scheme: WeightScheme | None,
    out_dir: Path,
    progress,
    *,
    calibration_size,
    kv_scale_strategy: str,
    max_shard_bytes: int | None = None,
    spill_bytes: int = DEFAULT_SPILL_BYTES,
    signround_steps: int = DEFAULT_STEPS,
    started: float,
) -> CompressResult:
    """The layer-by-layer path of `pipeline.compress` on an opened source (module
    docstring); raises SequentialUnsupported before writing anything for a source
    it does not take."""
    from gpuagent.compress.pipeline import _by_projection, _quant_config

    config = check_source(src, hf_config)
    moe = isinstance(config, arch.MoEConfig)
    check_moe_recipe(config, recipe, scheme)
    if max_shard_bytes is None:
        max_shard_bytes = default_shard_bytes(config)
    if scheme and scheme.quantize_lm_head and config.tie_word_embeddings:
        raise RecipeError(
            "quantize_lm_head=true but lm_head is tied to the embeddings "
            "(tie_word_embeddings=true), which stay unquantized"
        )
    if scheme and scheme.head:
        check_head_width(config.hidden_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        run = SequentialCompressor(
            src,
            source_dir,
            config,
            recipe,
            scheme,
            tmp,
            progress,
            calibration_size=calibration_size,
            kv_scale_strategy=kv_scale_strategy,
            max_shard_bytes=max_shard_bytes,
            spill_bytes=spill_bytes,
            block=source_block(hf_config),
            signround_steps=signround_steps,
        )
        run.run()
        for spilled in tmp.glob(".activations-*"):
            spilled.unlink()
        run.writer.finish()
        kv_scheme = kv_cache_scheme(kv_scale_strategy) if run.kv_written else None
        if scheme:
            extra_ignore = [ROUTER_IGNORE, *run.ignore] if moe else []
            hf_config["quantization_config"] = _quant_config(
                scheme, run.examples, kv_scheme, extra_ignore
            )
        elif kv_scheme:
            hf_config["quantization_config"] = kv_cache_only_config(kv_scheme)
        else:  # dense weights out (a block-fp8 source's config goes with its fp8)
            hf_config.pop("quantization_config", None)
        if scheme and scheme.head:  # the head is stored untied
            hf_config["tie_word_embeddings"] = False
        hf_config["dtype"] = hf_config["torch_dtype"] = (
            "float16" if recipe.weights == "fp16" else "bfloat16"
        )
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        for name, data in src.files.items():
            if name in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE) or name.endswith(
                ".safetensors"
            ):
                continue
            target = tmp / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    before, bf16 = source_sizes(src, config)
    sizes = [
        TensorClassSize(
            tensor_class=c,
            bytes_before=before[c],
            bytes_after=run.after[c],
            bytes_bf16=bf16[c],
        )
        for c in tensor_classes(moe)
    ]
    total, active = moe_parameters(src, config) if moe else (None, None)
    total_after = sum(run.after.values())
    return CompressResult(
        out_dir=str(out_dir),
        recipe=recipe,
        quantized_layers=run.quantized_count,
        sizes=sizes,
        total_bytes_before=sum(before.values()),
        total_bytes_after=total_after,
        expected_gpu_weight_bytes=total_after,
        kv_scales=run.kv_written,
        kv_scale_strategy=kv_scale_strategy if run.kv_written else None,
        group_sizes={
            p: q.group_size
            for p, q in _by_projection(run.examples).items()
            if q.group_size is not None
        },
        rtn_fallback_experts=run.fallbacks,
        min_expert_tokens=(
            scheme.min_expert_tokens
            if moe and scheme and scheme.method == "gptq"
            else None
        ),
        total_parameters=total,
        active_parameters=active,
        seconds=time.monotonic() - started,
    )
