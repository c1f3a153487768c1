"""Lossless coding of float checkpoints for storage and distribution: the
`model.lossless.safetensors` container (`container`: encode, strict read, decode,
whole folders), the exponent and sign+mantissa planes it is cut into (`planes`), the
Huffman-coded zstd frames of the exponent planes (`huffman`) and their compiled inner
loops (`loops`).

A format of its own, shared by whoever writes it (`compress_folder`) and the engine's
loader, which decodes it: the engine imports it and not the compressor.
Kept import-light: import `gpuagent.lossless.container` explicitly.
"""
