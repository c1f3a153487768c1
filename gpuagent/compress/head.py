"""The recipe option `head: "int8"`: the output head written as its own int8.

The head of a release is usually left bf16 (compressed-tensors `ignore: [lm_head]`);
with `head="int8"` compress writes it as llama.cpp's Q8_0 head: groups of
HEAD_GROUP_SIZE (32) inputs, symmetric round-to-nearest (scale = absmax / 127,
codes in -127..127), float32 scales, weight-only. In the folder it is a Linear of
the compressed-tensors pack-quantized layout (`lm_head.weight_packed` int32 with
four codes a word, `lm_head.weight_scale` float32 [vocab, hidden / 32],
`lm_head.weight_shape`) under a config group of its own (8-bit int, symmetric,
strategy group, group_size 32) targeting lm_head only, the rest of the config
unchanged; so compressed-tensors' decompressor and transformers read it as any
quantized Linear, and the engine's loader puts it straight into its int8 head
kernel (`gpuagent.engine.weights.Int8Head`), no float copy of the head made.

The codes are those the engine's `quantize_head="int8"` makes at serve time of the
same release written without the option: the head as that release stores it
(rounded to the dense dtype, bf16) quantized by `kernels.int8_cpu.quantize_int8`,
float32 scales kept as they are. So serving the release decodes the same greedy
tokens as serving the bf16-head release with `--quantize-head int8`, and the
measured speed is the release's own. (SmolLM2's float32 source, converted from a
GGUF whose head is Q8_0, would give back the GGUF's exact scales; its bf16 copy
gives the same codes with scales within 0.05%.)

Tied embeddings: as llm-compressor does when a recipe targets a tied lm_head
(`untie_word_embeddings`: the head cloned from the embedding, saved with
`tie_word_embeddings: false`; it re-ties only heads quantized exactly as the
embedding), the head is stored untied: `model.embed_tokens.weight` stays as it
was (bf16) and config.json says `tie_word_embeddings: false`. So a tied model's
release grows by the int8 head (SmolLM2-135M w4a16-g128: 112.8 MB -> 144.6 MB,
codes 28.3 MB and scales 3.5 MB), what the engine holds anyway when it makes the
same head at serve time beside the embedding.
"""

from __future__ import annotations

from typing import Any

import torch

from gpuagent.compress.quantize import QuantizedWeight
from gpuagent.compress.recipes import RecipeError
from gpuagent.protocol import HEAD_GROUP_SIZE
from kernels import int8_cpu

HEAD_TARGET = "re:^lm_head$"


def check_head_width(hidden_size: int) -> None:
    """Refuse a hidden size the head's groups don't divide, naming it."""
    if hidden_size % HEAD_GROUP_SIZE:
        raise RecipeError(
            f"head 'int8' quantizes groups of {HEAD_GROUP_SIZE} inputs, which do not "
            f"divide hidden_size={hidden_size}; leave the head option out"
        )


def quantize_head_int8(weight: torch.Tensor, dense: torch.dtype) -> QuantizedWeight:
    """The int8 head of `weight` [vocab, hidden] as the folder stores it: the
    weight rounded to `dense` first (module docstring), codes int8 [vocab, hidden],
    scales float32 [vocab, hidden / 32]."""
    check_head_width(weight.shape[1])
    rounded = weight.detach().to(dense).float()
    codes, scale = int8_cpu.quantize_int8(rounded, HEAD_GROUP_SIZE)
    return QuantizedWeight(codes, scale, None, 8, HEAD_GROUP_SIZE)


def head_config_group() -> dict[str, Any]:
    """The `quantization_config` config group of the int8 head."""
    return {
        "targets": [HEAD_TARGET],
        "weights": {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": HEAD_GROUP_SIZE,
            "dynamic": False,
            "actorder": None,
            "block_structure": None,
            "observer": "minmax",
            "observer_kwargs": {},
        },
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }
