"""Output checkpoints written as layers finish: `ShardWriter` buffers tensors and
writes a safetensors shard when the buffer would pass `max_shard_bytes`;
`write_safetensors` writes one file tensor by tensor from memory already held
(`safetensors.torch.save_file` first copies every tensor into `bytes`, doubling a
shard's memory while it writes).

The layout is the `safetensors` library's own, byte for byte (checked against
`save_file` in the tests): a little-endian u64 header length, the JSON header
with `__metadata__` first and the tensors in data order, padded with spaces to a
multiple of 8, then the data, tensors sorted by dtype as the library ranks them
(probed from the installed library: `_dtype_rank`) and then by name.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import save

from gpuagent.engine.loader import INDEX_FILE, WEIGHTS_FILE

_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@functools.cache
def _dtype_rank() -> dict[str, int]:
    # the order `safetensors` lays dtypes out in: one empty tensor of each, saved
    probe = {name: torch.zeros(0, dtype=dtype) for dtype, name in _NAMES.items()}
    data = save(probe)
    (n,) = struct.unpack("<Q", data[:8])
    return {name: i for i, name in enumerate(json.loads(data[8 : 8 + n]))}


def write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """`save_file(tensors, path, metadata)`'s bytes, written without a copy."""
    rank = _dtype_rank()
    order = sorted(tensors, key=lambda n: (rank[_NAMES[tensors[n].dtype]], n))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensors[name].contiguous()
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


class ShardWriter:
    """Output tensors written into safetensors shards as they come; `finish()`
    names the shards (`model-0000i-of-0000n.safetensors`, and the index) or, for
    a single one, writes it as `model.safetensors`."""

    def __init__(self, folder: Path, max_shard_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if self.buffer and self.buffered + size > self.max_bytes:
                self._flush()
            self.buffer[name] = t
            self.buffered += size
            self.total += size

    def _flush(self) -> None:
        name = f".shard-{len(self.shards) + 1:05d}.safetensors"
        write_safetensors(self.folder / name, self.buffer, {"format": "pt"})
        self.shards.append((name, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def finish(self) -> list[str]:
        """Names of the files written (the shards, and the index when several)."""
        if self.buffer or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            os.rename(self.folder / self.shards[0][0], self.folder / WEIGHTS_FILE)
            return [WEIGHTS_FILE]
        count = len(self.shards)
        weight_map = {}
        names = []
        for i, (tmp_name, tensors) in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.rename(self.folder / tmp_name, self.folder / final)
            names.append(final)
            weight_map |= dict.fromkeys(tensors, final)
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return [*names, INDEX_FILE]
