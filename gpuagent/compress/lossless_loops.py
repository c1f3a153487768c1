"""The lossless coder's compiled inner loops (`_lossless_loops.c`, built by `pip
install`): `merge16`, the merge of 16-bit words from their planes
(`lossless_planes`), and `huffman_stream`, the writing of one Huffman stream
(`lossless_huffman`). An unbuilt extension is reported with how to build it."""

try:
    from gpuagent.compress._lossless_loops import huffman_stream, merge16
except ImportError as exc:
    raise ImportError(
        "gpuagent.compress._lossless_loops (the lossless coder's compiled loops, "
        "gpuagent/compress/_lossless_loops.c) is not built for this Python: install "
        "the project with `make install` or `pip install -e .`, which compile it"
    ) from exc

__all__ = ["huffman_stream", "merge16"]
