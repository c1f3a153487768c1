"""Convert a llama.cpp GGUF file of a Llama model into a Hugging Face folder.

    python -m gpuagent.models.from_gguf GGUF OUT_DIR [--dtype float32|bfloat16]

writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with the
chat template) and generation_config.json, which transformers' LlamaForCausalLM and
the engine's loader both load. Weights are dequantized with the `gguf` package (its
numpy reference of each ggml quant type) and are the "parent" model the project
measures compression against: exactly the values llama.cpp computes with.

Three things differ between the two layouts:

- llama.cpp's converter permutes the rows of q_proj and k_proj per head so that RoPE
  rotates adjacent pairs (x[2i], x[2i+1]); transformers rotates halves (x[i],
  x[i + D/2]). Row r = 2i + j of a GGUF head is row j * D/2 + i of the HF head; undone
  here (`unpermute_rope_rows`).
- GGUF tensor shapes are listed fastest dimension first ([in, out]); the data is
  row-major [out, in], which is HF's layout.
- A GGUF without `output.weight` ties the output head to `token_embd.weight`.

The folder appears atomically: everything is written into a temporary sibling folder
which is renamed into place only when complete, so an interrupted run leaves no
half-written model behind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from gpuagent.engine.model import LlamaConfig
from gpuagent.models.gguf_tokenizer import TokenizerConversionError, build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# llama.* metadata this converter understands; any other llama.* key (RoPE scaling,
# experts, sliding windows, ...) changes the model in a way it does not implement.
LLAMA_KEYS = {
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
}
# GGUF tensor name -> HF name (N = layer index)
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


class ConversionError(ValueError):
    """The GGUF file is not a model this converter handles; the message says why."""


@dataclass
class GGUFModel:
    """What a GGUF file holds: metadata (name -> value) and tensors (name -> reader
    tensor, still quantized)."""

    metadata: dict[str, Any]
    tensors: dict[str, Any]


def read_gguf(path: str | Path) -> GGUFModel:
    """Open a GGUF file with the `gguf` package's reader (memory-mapped)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name in tensors:
            raise ConversionError(f"{path} holds tensor {tensor.name!r} twice")
        tensors[tensor.name] = tensor
    return GGUFModel(metadata, tensors)


# -------------------------------------------------------------------------- config


def llama_config(gguf: GGUFModel) -> LlamaConfig:
    """The model's `LlamaConfig` from GGUF metadata (tied embeddings: no
    `output.weight` tensor); ConversionError for anything that is not a plain Llama
    decoder."""
    metadata = gguf.metadata
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ConversionError(f"general.architecture {arch!r} is not 'llama'")
    unknown = sorted(
        key
        for key in metadata
        if key.startswith("llama.") and key.removeprefix("llama.") not in LLAMA_KEYS
    )
    if unknown:
        raise ConversionError(f"unsupported llama metadata {unknown}")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise ConversionError(f"the GGUF metadata has no llama.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ConversionError("key_length != value_length is not a Llama attention")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ConversionError(
            f"llama.rope.dimension_count {get('rope.dimension_count')} != head_dim "
            f"{head_dim} (partial rotary embeddings are not supported)"
        )
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    try:
        return LlamaConfig(
            vocab_size=int(get("vocab_size", len(tokens) or None)),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length")),
            rope_theta=_float32_repr(get("rope.freq_base", 10000.0)),
            rms_norm_eps=_float32_repr(get("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        )
    except ValueError as exc:
        raise ConversionError(f"GGUF llama metadata: {exc}") from exc


def _float32_repr(value: float) -> float:
    # GGUF stores float32; 9.999999747378752e-06 is the float32 nearest 1e-05, and the
    # shortest decimal that reads back as that float32 is what the HF config said.
    return float(str(np.float32(value)))


# ------------------------------------------------------------------------- tensors


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order of q_proj/k_proj [num_heads * D, in]: GGUF
    row 2i + j of a head is HF row j * D/2 + i (pairs -> halves)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ConversionError(f"{rows} rows do not split into {num_heads} RoPE heads")
    half = rows // num_heads // 2
    # [H, D/2, 2, in] (GGUF: pair index, then which of the pair) -> [H, 2, D/2, in]
    per_head = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32, row-major in HF's order ([out, in] for matrices)."""
    from gguf.quants import dequantize as gguf_dequantize

    try:
        values = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ConversionError(
            f"{tensor.name}: ggml type {tensor.tensor_type.name} has no dequantizer"
        ) from exc
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    # a copy: F32 tensors come straight from the read-only memory map
    return np.array(values, dtype=np.float32, order="C").reshape(shape)


def hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The HF tensor name of a GGUF tensor name, or None if it has none."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_TENSORS:
        return None
    layer = int(match[1])
    if layer >= num_layers:
        return None
    return f"model.layers.{layer}.{LAYER_TENSORS[match[2]]}.weight"


def hf_state_dict(
    gguf: GGUFModel, config: LlamaConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized and renamed to HF's Llama names, q/k rows put back in
    HF's RoPE order. ConversionError lists unknown tensors and missing or misshapen
    ones."""
    names = {name: hf_name(name, config.num_hidden_layers) for name in gguf.tensors}
    unknown = sorted(name for name, hf in names.items() if hf is None)
    if unknown:
        raise ConversionError(f"tensors this converter does not know: {unknown}")
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(names.values()))
    if missing:
        raise ConversionError(f"tensors missing from the GGUF: {missing}")

    state = {}
    for name, tensor in gguf.tensors.items():
        target = names[name]
        values = dequantize(tensor)
        if values.shape != expected[target]:
            raise ConversionError(
                f"{name}: shape {values.shape}, the config implies {expected[target]}"
            )
        if target.endswith("q_proj.weight"):
            values = unpermute_rope_rows(values, config.num_attention_heads)
        elif target.endswith("k_proj.weight"):
            values = unpermute_rope_rows(values, config.num_key_value_heads)
        state[target] = torch.from_numpy(values).to(dtype)
    return dict(sorted(state.items()))


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a Llama with this config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    per_layer = {
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    for layer in range(config.num_hidden_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}.weight"] = shape
    return shapes


# -------------------------------------------------------------------------- output


def convert(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    force: bool = False,
) -> Path:
    """Convert `gguf_path` into the HF folder `out_dir` (created atomically).

    Raises FileExistsError if `out_dir` exists (unless `force`, which replaces it
    once the new folder is complete) and ConversionError for unsupported models.
    """
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists (--force replaces it)")
    gguf = read_gguf(gguf_path)
    config = llama_config(gguf)
    try:
        tokenizer, tokenizer_config = build_tokenizer(gguf.metadata)
    except TokenizerConversionError as exc:
        raise ConversionError(str(exc)) from exc
    if tokenizer.get_vocab_size(with_added_tokens=True) != config.vocab_size:
        raise ConversionError(
            f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model "
            f"{config.vocab_size}"
        )
    state = hf_state_dict(gguf, config, DTYPES[dtype])
    hf_config = config.to_hf_config()
    hf_config["torch_dtype"] = dtype
    pad_id = gguf.metadata.get("tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        hf_config["pad_token_id"] = pad_id
    generation_config = {
        k: v
        for k, v in (
            ("bos_token_id", config.bos_token_id),
            ("eos_token_id", config.eos_token_id),
            ("pad_token_id", pad_id),
        )
        if v is not None
    }
    metadata = {"format": "pt", "source_gguf_sha256": _sha256(gguf_path)}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata)
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", hf_config)
        _write_json(tmp / "generation_config.json", generation_config)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        for name in OUTPUT_FILES:
            _fsync(tmp / name)
            (tmp / name).chmod(0o644)  # save_file and mkdtemp make them private
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _replace_dir(new: Path, target: Path) -> None:
    # A directory can't be renamed onto a non-empty one: move the old one aside
    # first, so the target is always either the old or the complete new folder.
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints what it wrote, or the error, and returns 0 or 1."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuagent.models.from_gguf",
        description="Convert a Llama GGUF file into a Hugging Face model folder.",
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="folder to create")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument(
        "--force", action="store_true", help="replace OUT_DIR if it exists"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        out = convert(args.gguf, args.out_dir, args.dtype, args.force)
    except (ConversionError, FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    config = json.loads((out / "config.json").read_text())
    print(
        f"wrote {out} ({args.dtype}, {config['num_hidden_layers']} layers, vocab "
        f"{config['vocab_size']}, tied={config['tie_word_embeddings']}) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
