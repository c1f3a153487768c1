"""Serving engine for Llama-family models over a paged, quantized KV cache.

Kept import-light on purpose: import `gpuagent.engine.model`, `.loader`,
`.tokenizer` (and the runtime modules) explicitly.
"""
