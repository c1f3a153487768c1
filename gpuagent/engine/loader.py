"""Load a Hugging Face format Llama folder into `model.Transformer`, or a
DeepSeek-V3 / GLM-4.5 MoE folder into `arch.MoETransformer` (by `model_type`).

Reads `config.json` and either `model.safetensors` or the shards named by
`model.safetensors.index.json`. Tensors are parsed with `safetensors.torch.load` on the
file bytes — never `torch.load`, never pickle. With `files=` the bytes come only from
that mapping (what verify-on-load hands over after hashing exactly those bytes), so
nothing is read from disk twice or behind the verifier's back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes

from gpuagent.engine import arch, fp8_blocks, weights
from gpuagent.engine.kv_calibration import pop_checkpoint_kv_scales
from gpuagent.engine.model import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# the lossless container (gpuagent.lossless: exponent-coded bf16/fp16/fp32 weights)
LOSSLESS_FILE = "model.lossless.safetensors"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
ARCHITECTURES_BY_TYPE = {"llama": SUPPORTED_ARCHITECTURES[0], **arch.MOE_MODEL_TYPES}
CHECKPOINT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Older transformers saved RoPE's inverse frequencies as a buffer; we recompute them.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class ModelLoadError(ValueError):
    """The folder is not a loadable Llama checkpoint; the message says exactly why."""


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    files: Mapping[str, bytes] | None = None,
) -> Transformer | arch.MoETransformer:
    """Build a `Transformer` from a HF Llama folder, weights cast to `dtype`.

    `files` maps names relative to `model_dir` to their bytes; when given, only those
    bytes are used. Raises ModelLoadError for unsupported configs (auto_map, other
    architectures) and for missing, unexpected or misshapen tensors.
    """
    reader = _FileReader(Path(model_dir), files)
    hf_config = _read_json_object(reader, CONFIG_FILE)
    check_supported_config(hf_config)
    try:
        config = arch.config_for(hf_config)
    except KeyError as exc:
        raise ModelLoadError(f"{CONFIG_FILE} lacks {exc}") from exc
    except (ArithmeticError, TypeError, ValueError) as exc:  # e.g. 0 heads
        raise ModelLoadError(f"{CONFIG_FILE}: {exc}") from exc

    quantized = weights.is_quantized(hf_config)
    moe = isinstance(config, arch.MoEConfig)
    block_fp8 = fp8_blocks.is_block_fp8(hf_config)  # DeepSeek-V3 / Kimi K2 as published
    checkpoint = read_checkpoint(reader, quantized=quantized)
    checkpoint = {
        k: v
        for k, v in checkpoint.items()
        if not arch.extra_checkpoint_layer(k, config)
    }
    if block_fp8:  # dequantized here; the model then runs plain weights
        try:
            checkpoint = fp8_blocks.dequantize(
                checkpoint, hf_config["quantization_config"]
            )
        except fp8_blocks.BlockFp8Error as exc:
            raise ModelLoadError(str(exc)) from exc
        quantized = False
    with torch.device("meta"):
        model = arch.build_model(config)
    layers = {}
    if quantized:  # compressed-tensors: quantized Linears run weight-only kernels
        try:
            checkpoint, layers = weights.split_quantized(
                checkpoint, hf_config["quantization_config"]
            )
            weights.install(model, layers)
        except weights.QuantizedWeightError as exc:
            raise ModelLoadError(str(exc)) from exc
        for layer in layers.values():
            weights.to_model(layer, dtype, device)
        weights.tune_kernels(layers.values(), dtype)  # CUDA only
    try:  # fp8 KV scales (compressed-tensors kv_cache_scheme), used by the fp8 cache
        kv_scales = pop_checkpoint_kv_scales(
            checkpoint, config.num_hidden_layers, config.num_key_value_heads
        )
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    state = _match_state_dict(model, checkpoint)
    if moe and config.is_mla and kv_scales is not None:
        raise ModelLoadError("checkpoint KV scales are not supported for MLA")
    state = {  # the router stays float32, as transformers keeps it
        k: v.to(device, torch.float32 if k.endswith(arch.FP32_SUFFIXES) else dtype)
        for k, v in state.items()
    }
    model.load_state_dict(state, strict=not layers, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter with two
    if layers:
        weights.fuse_projections(model)  # int4 q/k/v, gate/up for CPU decode
        model.int4_decode = weights.int4_decode_layers(model)  # decode in one call
    model.checkpoint_kv_scales = kv_scales
    return model.eval()


def check_supported_config(hf_config: dict[str, Any]) -> None:
    """Refuse configs that would run custom code or aren't a supported model type."""
    if "auto_map" in hf_config:
        raise ModelLoadError(
            f"{CONFIG_FILE} has auto_map (custom modeling code); refusing to load. "
            "A published folder of a model type this engine implements (Kimi K2, "
            "DeepSeek-V3, GLM-4.5, Llama) can be imported without its code: "
            "python -m gpuagent.models.import_published SRC DST"
        )
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES_BY_TYPE:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported "
            f"(need one of {sorted(ARCHITECTURES_BY_TYPE)})"
        )
    expected = ARCHITECTURES_BY_TYPE[model_type]
    architectures = hf_config.get("architectures") or [expected]
    unsupported = [a for a in architectures if a != expected]
    if unsupported:
        raise ModelLoadError(f"architectures {unsupported} are not supported")


def read_checkpoint(
    reader: _FileReader, quantized: bool = False
) -> dict[str, torch.Tensor]:
    """All tensors of the single file, of every shard the index names, or of the
    lossless container (decoded, each tensor checked against its recorded digest);
    integer and fp8 tensors only when the config declares a quantized checkpoint."""
    if reader.exists(LOSSLESS_FILE):
        return _read_lossless(reader)
    if reader.exists(INDEX_FILE):
        return _read_sharded(reader, quantized)
    if reader.exists(WEIGHTS_FILE):
        return _read_safetensors(reader, WEIGHTS_FILE, quantized)
    raise ModelLoadError(f"neither {WEIGHTS_FILE} nor {INDEX_FILE} found")


def _read_json_object(reader: _FileReader, name: str) -> dict[str, Any]:
    try:
        # Decoded first: json.loads of bytes would drop a UTF-8 byte-order mark that
        # transformers, vLLM and the integrity gate refuse ("Unexpected UTF-8 BOM").
        value = json.loads(reader.read(name).decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{name} is not a JSON object")
    return value


def _read_sharded(reader: _FileReader, quantized: bool) -> dict[str, torch.Tensor]:
    weight_map = _read_json_object(reader, INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(s, str) for s in weight_map.values()
    ):
        raise ModelLoadError(f"{INDEX_FILE} has no weight_map of tensor -> file")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        _check_relative_name(shard)
        shard_tensors = _read_safetensors(reader, shard, quantized)
        listed = {n for n, s in weight_map.items() if s == shard}
        if listed != set(shard_tensors):
            raise ModelLoadError(
                f"{shard} does not match {INDEX_FILE}: "
                f"listed but absent {sorted(listed - set(shard_tensors))}, "
                f"present but unlisted {sorted(set(shard_tensors) - listed)}"
            )
        tensors.update(shard_tensors)
    return tensors


def _read_lossless(reader: _FileReader) -> dict[str, torch.Tensor]:
    from gpuagent.lossless.container import LosslessFormatError, decode_checkpoint

    present = [n for n in (WEIGHTS_FILE, INDEX_FILE) if reader.exists(n)]
    if present:
        raise ModelLoadError(f"both {LOSSLESS_FILE} and {present}: which is the model?")
    try:
        tensors = decode_checkpoint(reader.read(LOSSLESS_FILE))
    except LosslessFormatError as exc:
        raise ModelLoadError(f"{LOSSLESS_FILE}: {exc}") from exc
    return tensors


def _read_safetensors(
    reader: _FileReader, name: str, quantized: bool = False
) -> dict[str, torch.Tensor]:
    try:
        tensors = load_safetensors_bytes(reader.read(name))
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"{name} is not a valid safetensors file: {exc}") from exc
    allowed = CHECKPOINT_DTYPES + (weights.QUANTIZED_DTYPES if quantized else ())
    bad = {k: str(v.dtype) for k, v in tensors.items() if v.dtype not in allowed}
    if bad:
        raise ModelLoadError(f"{name}: unsupported tensor dtypes {bad}")
    return tensors


def hf_name(name: str) -> str:
    """HF checkpoint name of our parameter (`norm.weight` -> `model.norm.weight`)."""
    return name if name == "lm_head.weight" else "model." + name


def _match_state_dict(
    model: Transformer, checkpoint: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    # Map HF names onto our parameter names and fail with the full list of problems.
    checkpoint = {
        k: v for k, v in checkpoint.items() if not k.endswith(IGNORED_SUFFIXES)
    }
    tied = model.config.tie_word_embeddings
    # a quantized layer's buffers come from its own tensors (weights.split_quantized)
    own = {
        f"{module}.{buffer}"
        for module, m in model.named_modules()
        if isinstance(m, (weights.QuantLinear, weights.Int8Head))
        for buffer, _ in m.named_buffers()
    }
    expected = {hf_name(n): p for n, p in model.state_dict().items() if n not in own}
    if tied:
        expected.pop("lm_head.weight")
        _check_tied_head(checkpoint)
        checkpoint.pop("lm_head.weight", None)

    missing = sorted(set(expected) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(expected))
    misshapen = [
        f"{n}: checkpoint {tuple(checkpoint[n].shape)} vs config {tuple(p.shape)}"
        for n, p in expected.items()
        if n in checkpoint and checkpoint[n].shape != p.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if misshapen:
        problems.append(f"shape mismatch {misshapen}")
    if problems:
        raise ModelLoadError("checkpoint does not match config: " + "; ".join(problems))

    state = {
        n: checkpoint[hf_name(n)] for n in model.state_dict() if hf_name(n) in expected
    }
    if tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def _check_tied_head(checkpoint: dict[str, torch.Tensor]) -> None:
    # Some tied checkpoints carry a copy of the embedding as lm_head; a copy that
    # differs means the config's tie flag is wrong, and guessing would be silent.
    head = checkpoint.get("lm_head.weight")
    embed = checkpoint.get("model.embed_tokens.weight")
    if head is not None and (embed is None or not torch.equal(head, embed)):
        raise ModelLoadError(
            "tie_word_embeddings=true but lm_head.weight differs from "
            "model.embed_tokens.weight"
        )


def _check_relative_name(name: str) -> None:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name or not path.parts:
        raise ModelLoadError(f"{INDEX_FILE} names a file outside the folder: {name!r}")
    if path.suffix != ".safetensors":
        # What the integrity gate inspects as a checkpoint is *.safetensors; a shard
        # by another name would be parsed without its strict header checks.
        raise ModelLoadError(
            f"{INDEX_FILE} names a shard that is not .safetensors: {name!r}"
        )


class _FileReader:
    """Bytes of files in the model folder, or only from a given mapping."""

    def __init__(self, model_dir: Path, files: Mapping[str, bytes] | None) -> None:
        self.model_dir = model_dir
        self.files = files

    def exists(self, name: str) -> bool:
        if self.files is not None:
            return name in self.files
        return (self.model_dir / name).is_file()

    def read(self, name: str) -> bytes:
        if self.files is not None:
            if name not in self.files:
                raise ModelLoadError(f"{name} is not among the verified files")
            return self.files[name]
        path = self.model_dir / name
        if not path.is_file():
            raise ModelLoadError(f"{path} not found")
        return path.read_bytes()
