"""Tiny random folders laid out as Moonshot publishes Kimi K2 and DeepSeek
publishes DeepSeek-V3: config.json with auto_map, the modeling code beside it
(here, code that leaves a marker file if it is ever run), sharded safetensors
with their index, Kimi's tiktoken.model and tokenizer_config.json (auto_map to
tokenization_kimi.py), DeepSeek's tokenizer.json, a README and an image."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from gpuagent.engine.tokenizer import save_byte_tokenizer
from tests.gpuagent.engine.test_moe_archs import deepseek_folder
from tests.gpuagent.models.tiktoken_fixture import (
    kimi_tokenizer_config,
    tiktoken_model_bytes,
    trained_ranks,
)

CONFIG_AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}
CODE_FILES = {
    "kimi_k2": (
        "configuration_deepseek.py",
        "modeling_deepseek.py",
        "tokenization_kimi.py",
    ),
    "deepseek_v3": ("configuration_deepseek.py", "modeling_deepseek.py"),
}
SHAPES = dict(moe_intermediate_size=32, q_lora_rank=64, v_head_dim=16)


def marker_code(marker: Path) -> str:
    """Python that, if imported or run, writes `marker`."""
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"


def published_folder(path: Path, model_type: str, marker: Path) -> Path:
    """A published-layout folder of `model_type` (kimi_k2 or deepseek_v3)."""
    path.mkdir(parents=True)
    ranks = trained_ranks()
    vocab = len(ranks) + 256 if model_type == "kimi_k2" else 264
    deepseek_folder(path, vocab_size=vocab, **SHAPES)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = CONFIG_AUTO_MAP
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _shard(path, parts=2)
    for name in CODE_FILES[model_type]:
        (path / name).write_text(marker_code(marker))
    if model_type == "kimi_k2":
        (path / "tiktoken.model").write_bytes(tiktoken_model_bytes(ranks))
        tokenizer_config = kimi_tokenizer_config(len(ranks))
        (path / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config, indent=2, ensure_ascii=False)
        )
    else:
        save_byte_tokenizer(path)
    (path / "README.md").write_text("# a tiny published-layout model\n")
    (path / "figures").mkdir()
    (path / "figures" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
    return path


def _shard(path: Path, parts: int) -> None:
    """model.safetensors -> model-0000i-of-0000n.safetensors + the index."""
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        shard = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i::parts]}
        save_file(chunk, path / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, shard))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def hand_cleaned(src: Path, dst: Path) -> Path:
    """What a person would do: copy everything but the code, the image and the
    tiktoken tokenizer, and delete auto_map from config.json."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".py":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    del config["auto_map"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst
