"""Paged KV-cache bookkeeping: block pool, block tables, slot mapping, accounting.

vLLM's shape: everything here is plain Python over integers and is tested on the CPU;
the kernels only ever see tensors (the per-layer `PagedKVCache`s, a slot mapping and
block tables). A sequence's token at position `p` lives in block
`block_table[p // block_size]` at offset `p % block_size`, i.e. in cache slot
`block_id * block_size + offset`.

A cache with a full-precision window (`kernels.kv_quant`) also gives each live
sequence one window row; its newest `window` tokens are copied to ring slot
`row * window + p % window` as well. Rows come from a free list like blocks, and a
sequence takes one with its first block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

import kernels


class NoFreeBlocksError(RuntimeError):
    """The block pool has fewer free blocks than were asked for."""


class BlockPool:
    """A fixed set of KV blocks handed out from a free list, with reference counts.

    Blocks are returned to the back of the free list and taken from the front, so a
    freed block is reused as late as possible (stale data is overwritten anyway; this
    just makes use-after-free bugs show up as wrong tokens sooner in tests).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    def allocate(self, count: int = 1) -> list[int]:
        """Take `count` blocks off the free list; all or nothing."""
        if count > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {count} KV blocks, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def share(self, block_id: int) -> None:
        """Add a reference to an allocated block (e.g. a shared prompt prefix)."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block with none left is free again."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold `block_id`."""
        return self._ref_counts[block_id]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


def slot_mapping(
    block_table: Sequence[int], start: int, end: int, block_size: int
) -> list[int]:
    """Cache slots of token positions `start..end-1` of one sequence."""
    if end > len(block_table) * block_size:
        raise ValueError(
            f"positions up to {end} need {blocks_needed(end, block_size)} blocks, "
            f"the table has {len(block_table)}"
        )
    return [
        block_table[pos // block_size] * block_size + pos % block_size
        for pos in range(start, end)
    ]


class BlockManager:
    """Block tables (and window rows) of live sequences over one `BlockPool`
    (no tensors)."""

    def __init__(
        self, num_blocks: int, block_size: int, window: int = 0, num_windows: int = 0
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if window < 0 or num_windows < 0 or (window == 0) != (num_windows == 0):
            raise ValueError(
                "window and num_windows must both be 0 or both be positive, got "
                f"{window} and {num_windows}"
            )
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.window = window
        self.num_windows = num_windows
        self._free_windows: deque[int] = deque(range(num_windows))
        self.window_rows: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds."""
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences."""
        return self.pool.num_used_blocks

    @property
    def capacity_tokens(self) -> int:
        """Most tokens one sequence could ever hold (the whole pool)."""
        return self.pool.num_blocks * self.block_size

    def block_table(self, seq_id: str) -> list[int]:
        """The blocks of `seq_id` in position order (empty if it holds none)."""
        return self.block_tables.get(seq_id, [])

    def extra_blocks_for(self, seq_id: str, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so that it can hold `num_tokens` tokens."""
        held = len(self.block_tables.get(seq_id, ()))
        return max(0, blocks_needed(num_tokens, self.block_size) - held)

    def _needs_window_row(self, seq_id: str) -> bool:
        return self.num_windows > 0 and seq_id not in self.window_rows

    def can_hold(self, seq_id: str, num_tokens: int) -> bool:
        """Whether the free lists cover growing `seq_id` to `num_tokens` tokens."""
        if self._needs_window_row(seq_id) and not self._free_windows:
            return False
        return self.extra_blocks_for(seq_id, num_tokens) <= self.pool.num_free_blocks

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> bool:
        """Grow `seq_id`'s table to hold `num_tokens` (and give it a window row);
        False (nothing taken) if the pool can't."""
        if not self.can_hold(seq_id, num_tokens):
            return False
        if self._needs_window_row(seq_id):
            self.window_rows[seq_id] = self._free_windows.popleft()
        extra = self.extra_blocks_for(seq_id, num_tokens)
        table = self.block_tables.setdefault(seq_id, [])
        if extra:
            table.extend(self.pool.allocate(extra))
        return True

    def free(self, seq_id: str) -> int:
        """Return every block (and the window row) of `seq_id`; returns how many
        blocks."""
        table = self.block_tables.pop(seq_id, [])
        self.pool.free(table)
        row = self.window_rows.pop(seq_id, None)
        if row is not None:
            self._free_windows.append(row)
        return len(table)

    def window_row(self, seq_id: str) -> int:
        """The window row `seq_id` holds (a cache with a window only)."""
        return self.window_rows[seq_id]

    def window_slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Window ring slot of each position `start..end-1` of `seq_id`: positions
        that are among the newest `window` after this step get theirs, -1 the rest
        (so no two new tokens share a slot)."""
        row, window = self.window_rows[seq_id], self.window
        first = max(start, end - window)
        return [-1] * (first - start) + [
            row * window + pos % window for pos in range(first, end)
        ]

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Cache slots of positions `start..end-1` of `seq_id`."""
        return slot_mapping(self.block_table(seq_id), start, end, self.block_size)


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) from our LlamaConfig or a transformers config."""
    num_layers = config.num_hidden_layers
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return num_layers, num_kv_heads, head_dim


def kv_bytes_per_token(config: Any, kv_dtype: str) -> int:
    """KV-cache bytes one token takes across all layers (K and V, scales included).

    Exact: equals the summed `nbytes` of the model's caches divided by the number of
    token slots in them.
    """
    num_layers, num_kv_heads, head_dim = _kv_shape(config)
    per_layer = kernels.kv_bytes_per_token(kv_dtype, num_kv_heads, head_dim)
    return num_layers * per_layer


def kv_static_bytes(config: Any, kv_dtype: str) -> int:
    """Bytes the caches hold whatever their size (fp8's per-head scales)."""
    num_layers, num_kv_heads, _ = _kv_shape(config)
    return num_layers * kernels.kv_static_bytes(kv_dtype, num_kv_heads)


def kv_window_bytes(config: Any, window: int) -> int:
    """Bytes one sequence's full-precision window takes across all layers."""
    num_layers, num_kv_heads, head_dim = _kv_shape(config)
    return num_layers * kernels.kv_window_bytes(num_kv_heads, head_dim, window)


def num_blocks_for_budget(
    config: Any,
    kv_dtype: str,
    budget_bytes: int,
    block_size: int,
    window: int = 0,
    num_windows: int = 0,
) -> int:
    """How many KV blocks (all layers) fit in `budget_bytes`, after the window rows
    (`num_windows` of `window` tokens) and any static scales take theirs."""
    block_bytes = kv_bytes_per_token(config, kv_dtype) * block_size
    rest = int(budget_bytes) - num_windows * kv_window_bytes(config, window)
    rest -= kv_static_bytes(config, kv_dtype)
    return max(0, rest) // block_bytes


class KVCacheManager:
    """The model's per-layer paged KV caches plus the block tables that index them."""

    def __init__(
        self,
        config: Any,
        kv_dtype: str,
        num_blocks: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        window: int = 0,
        num_windows: int = 0,
    ) -> None:
        if kv_dtype not in kernels.KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {kv_dtype!r}; "
                f"choose from {', '.join(kernels.KV_CACHE_DTYPES)}"
            )
        num_layers, num_kv_heads, head_dim = _kv_shape(config)
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.bytes_per_token = kv_bytes_per_token(config, kv_dtype)
        self.blocks = BlockManager(num_blocks, block_size, window, num_windows)
        self.kv_caches: list[kernels.PagedKVCache] = [
            kernels.allocate_kv_cache(
                kv_dtype,
                num_blocks,
                block_size,
                num_kv_heads,
                head_dim,
                device,
                window=window,
                num_windows=num_windows,
            )
            for _ in range(num_layers)
        ]

    @classmethod
    def for_budget(
        cls,
        config: Any,
        kv_dtype: str,
        budget_bytes: int,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        window: int = 0,
        num_windows: int = 0,
    ) -> KVCacheManager:
        """As many blocks as `budget_bytes` holds beside the window rows."""
        num_blocks = num_blocks_for_budget(
            config, kv_dtype, budget_bytes, block_size, window, num_windows
        )
        if num_blocks == 0:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no block of "
                f"{block_size} tokens at {kv_bytes_per_token(config, kv_dtype)} "
                f"bytes/token (after {num_windows} window rows of {window} tokens)"
            )
        return cls(
            config, kv_dtype, num_blocks, block_size, device, window, num_windows
        )

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.blocks.num_blocks

    @property
    def window(self) -> int:
        """Newest tokens per sequence also kept in bf16 (0: no window)."""
        return self.blocks.window

    @property
    def nbytes(self) -> int:
        """Bytes of every cache tensor, scales and windows included."""
        return sum(cache.nbytes for cache in self.kv_caches)
