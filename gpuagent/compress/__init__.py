"""Weight compression: a source model folder -> a compressed-tensors folder
(w8a16, w4a16-gN, fp8; round-to-nearest or GPTQ), with optional static fp8 KV
scales; Llama and the DeepSeek-V3 / Kimi K2 / GLM-4.5 MoE architectures (per
expert: gpuagent.compress.moe). Entry point:
`compress(source_dir, recipe, out_dir, progress=...)`.
Lossless coding of bf16/fp16 weights for storage is gpuagent.lossless."""

from gpuagent.compress.pipeline import CompressError, compress
from gpuagent.compress.recipes import RecipeError, weight_scheme

__all__ = ["CompressError", "RecipeError", "compress", "weight_scheme"]
