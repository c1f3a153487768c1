"""The lossless coder's compiled inner loops (`_loops.c`, built by `pip
install`): `merge16`, the merge of 16-bit words from their planes
(`planes`), and `huffman_stream`, the writing of one Huffman stream
(`huffman`). An unbuilt extension is reported with how to build it."""

try:
    from gpuagent.lossless._loops import huffman_stream, merge16
except ImportError as exc:
    raise ImportError(
        "gpuagent.lossless._loops (the lossless coder's compiled loops, "
        "gpuagent/lossless/_loops.c) is not built for this Python: install "
        "the project with `make install` or `pip install -e .`, which compile it"
    ) from exc

__all__ = ["huffman_stream", "merge16"]
