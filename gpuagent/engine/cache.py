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

Prefix caching (vLLM's automatic prefix caching, v1 `KVCacheManager`/`BlockPool`):
every full block is named by a hash chain, SHA-256 of its parent block's hash and
its token ids, rooted in a hash of everything else its bytes depend on (the model's
weights, the KV dtype and its writer's version, block size and window, each layer's
rotation and static fp8 scales: `KVCacheManager.prefix_cache_root`), so equal hashes
mean equal bytes and caches that differ in any of those never share one. Once a
block's K/V are computed it enters the cache (`BlockManager.cache_computed_blocks`;
a block whose tokens another block holds already stays private). A new sequence
starts its table with the longest run of cached blocks of its tokens
(`cached_prefix`), shared by reference count, and computes only the rest; at least
its last token is always computed, for the logits of the next one, so a prompt that
is all cached blocks recomputes its last block. A freed block keeps its hash on the
free list: the list is the LRU order (a sequence's last blocks are freed first, so
its tail goes before the prefix others may share), a hit takes a free cached block
back off it, and a block's hash entry is dropped only when the pool hands it out
again. Eviction thus never frees a block anyone holds. A cached prefix's positions
are never written again (their slots are -1): several sequences may read the block.

With a full-precision window, a cached block's quantized bytes are what any request
would write for those tokens (K/V at a position depend only on the tokens up to
it), but the window is not in the block: each query reads its newest `window`
positions in bf16 (`kernels.paged_attention`), and a bf16 copy of an older position
exists only in the row of the sequence that computed it. A sequence that starts
after a cached prefix of C tokens would need the bf16 K/V of positions
C - window + 1 .. C - 1 in every layer. Recomputing positions from S on, with an
empty window row, gives exact layer-0 K/V from S on (they depend on the token
alone), exact layer-1 K/V from S + window - 1 on (each query there has its whole
window among the recomputed positions), and exact layer-l K/V from
S + l (window - 1) on. So the rule: a hit of C tokens on a cache with a window
recomputes from S = C - layers * (window - 1) (`window_refill_tokens`; at least 0),
writing those positions into the window row only, never into the shared blocks;
from C on every layer's window holds exactly what a request without the cache would
have there, and greedy outputs are the same with the cache on or off (the K/V are
bit for bit the same where the chunks are; tests/gpuagent/engine/
test_prefix_cache.py). The blocks are still shared, and the tokens reported cached
(`Sequence.num_cached_tokens`) are the S not computed.

The window rule in general (`window_refill_tokens`): what is cached is the
quantized blocks only; a hit recomputes layers * (n - 1) positions, n being the
newest positions a query reads in bf16 (itself among them), and copies whatever
else the row holds that a query reads. fp8 and int4: n = window, nothing to copy.
int4c (`engine.kv_int4c`): the row's W slots hold the newest n = W - 1 positions
and, in the last slot, position 0 (the attention sink), which every query reads
in bf16. Position 0's K/V depend on its token alone, but only its own forward
writes them, and a hit starts later. So a cached first block keeps a copy of
them per layer, its sink: a slot of a small store beside the window rows
(`KVCacheManager.sink_key` / `sink_value`, counted in `nbytes` and in the
budget), saved from the row of the sequence that computed the block when the
block enters the cache, copied into the row's last slot of each sequence that
hits it (`BlockManager.take_sink_copies`, `KVCacheManager.apply_sink_copies`).
There is one sink slot per window row: every live sequence's first block can
always get one (a slot held by a cached first block that nobody holds is taken
from it, dropping that block from the cache, least recently used first), and a
block evicted from the pool frees its slot. A first block is a hit only with its
sink. A hit then recomputes layers * (W - 2) positions, as fp8 and int4 do theirs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

import kernels
from gpuagent.engine import kv_int4c, mla


class SinkCopy(NamedTuple):
    """A copy the sink store owes (`BlockManager.take_sink_copies`): position 0's
    bf16 K/V from window row `row`'s last slot into sink slot `sink` (`save`), or
    back from the sink into the row (a prefix-cache hit)."""

    save: bool
    row: int
    sink: int


class NoFreeBlocksError(RuntimeError):
    """The block pool has fewer free blocks than were asked for."""


class BlockPool:
    """A fixed set of KV blocks handed out from a free list, with reference counts,
    and the prefix cache's map from block hash to the block holding those tokens.

    Blocks are returned to the back of the free list and taken from the front, so a
    freed block is reused as late as possible: the free list is also the prefix
    cache's LRU order. A freed block keeps its hash (its K/V stay valid), so a later
    request can take it back off the free list (`touch`); its hash entry is dropped
    only when the block is handed out again (evicted). Eviction therefore never
    touches a block anyone holds.
    """

    def __init__(self, num_blocks: int, num_sinks: int = 0) -> None:
        if num_blocks < 0 or num_sinks < 0:
            raise ValueError(
                f"num_blocks and num_sinks must be >= 0, got {num_blocks}, {num_sinks}"
            )
        self.num_blocks = num_blocks
        # An ordered dict as a queue that also removes from the middle in O(1) (a
        # cached free block taken back); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_evicted_blocks = 0
        # Sinks (`cache_first_block`): cached first block -> its sink slot, least
        # recently used first; a slot goes with its block's hash entry.
        self.num_sinks = num_sinks
        self._free_sinks: deque[int] = deque(range(num_sinks))
        self._sinks: OrderedDict[int, int] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash entry, held or free."""
        return len(self._cached)

    def allocate(self, count: int = 1) -> list[int]:
        """Take `count` blocks off the front of the free list, evicting the hash
        entries of cached ones; all or nothing."""
        if count > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {count} KV blocks, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
            if self._block_hashes[block_id] is not None:
                self._evict(block_id)
        return blocks

    def _evict(self, block_id: int) -> None:
        del self._cached[self._block_hashes[block_id]]
        self._block_hashes[block_id] = None
        self.num_evicted_blocks += 1
        sink = self._sinks.pop(block_id, None)
        if sink is not None:
            self._free_sinks.append(sink)

    def share(self, block_id: int) -> None:
        """Add a reference to an allocated block (e.g. a shared prompt prefix)."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        self._ref_counts[block_id] += 1

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each cached block, taking free ones off the free
        list (a prefix-cache hit)."""
        for block_id in block_ids:
            if self._block_hashes[block_id] is None:
                raise ValueError(f"block {block_id} is not cached")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            if block_id in self._sinks:
                self._sinks.move_to_end(block_id)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block with none left goes to the back
        of the free list (keeping its hash, if cached), in the order given."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold `block_id`."""
        return self._ref_counts[block_id]

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Record that held `block_id` holds the tokens `block_hash` names; False
        (nothing changed) when another block holds them already or this one is
        cached."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        if block_hash in self._cached or self._block_hashes[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self._block_hashes[block_id] = block_hash
        return True

    def cache_first_block(self, block_id: int, block_hash: bytes) -> int | None:
        """`cache_block` for a sequence's first block, with a sink slot for its
        position 0: a free slot, or the slot of the least recently used cached
        first block nobody holds, evicted for it (out of the free list's order; it
        stays there, a plain free block). Returns the slot, or None (nothing
        changed) when every slot's block is held, another block holds these
        tokens already or this one is cached."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
        if block_hash in self._cached or self._block_hashes[block_id] is not None:
            return None
        if not self._free_sinks:
            unheld = (b for b in self._sinks if self._ref_counts[b] == 0)
            oldest = next(unheld, None)
            if oldest is None:
                return None
            self._evict(oldest)
        self.cache_block(block_id, block_hash)
        sink = self._sinks[block_id] = self._free_sinks.popleft()
        return sink

    def sink_of(self, block_id: int) -> int | None:
        """The sink slot of cached first block `block_id`, if it has one."""
        return self._sinks.get(block_id)

    def cached_block(self, block_hash: bytes) -> int | None:
        """The block that holds the tokens `block_hash` names, or None."""
        return self._cached.get(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash of the tokens `block_id` holds, if it is cached."""
        return self._block_hashes[block_id]


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
    (no tensors), and the prefix cache over its full blocks when enabled."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int = 0,
        num_windows: int = 0,
        num_sinks: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if window < 0 or num_windows < 0 or (window == 0) != (num_windows == 0):
            raise ValueError(
                "window and num_windows must both be 0 or both be positive, got "
                f"{window} and {num_windows}"
            )
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, num_sinks)
        self.block_tables: dict[str, list[int]] = {}
        self.window = window
        self.num_windows = num_windows
        self._free_windows: deque[int] = deque(range(num_windows))
        self.window_rows: dict[str, int] = {}
        # Prefix caching (off until `enable_prefix_caching`).
        self.prefix_caching = False
        self.root_hash = b""
        self.window_refill_tokens = 0
        # Per sequence: leading blocks of its table that are cached (taken from the
        # cache or cached since), and the positions its cached prefix covers, which
        # are never written again (their blocks may be shared).
        self._num_cached_blocks: dict[str, int] = {}
        self._shared_tokens: dict[str, int] = {}
        # Sinks (a window row whose last slot holds position 0, int4c; module
        # docstring): the copies the cache's tensors owe (`take_sink_copies`).
        if num_sinks and not num_windows:
            raise ValueError("sinks are copies of window rows' last slots: no rows")
        self._sink_copies: list[SinkCopy] = []

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

    def can_hold(
        self, seq_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Whether the free lists cover growing `seq_id` to `num_tokens` tokens
        (a new sequence: after taking `cached_blocks`, its cached prefix)."""
        if self._needs_window_row(seq_id) and not self._free_windows:
            return False
        extra = self.extra_blocks_for(seq_id, num_tokens)
        extra = max(0, extra - len(cached_blocks))
        # cached blocks nobody holds sit on the free list: taking them shrinks it
        taken = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        return extra <= self.pool.num_free_blocks - taken

    def ensure_capacity(
        self, seq_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow `seq_id`'s table to hold `num_tokens` (and give it a window row);
        False (nothing taken) if the pool can't. A sequence that holds no block yet
        may start its table with `cached_blocks` (`cached_prefix`), shared."""
        if cached_blocks and seq_id in self.block_tables:
            raise ValueError(f"{seq_id!r} holds blocks already")
        if not self.can_hold(seq_id, num_tokens, cached_blocks):
            return False
        if self._needs_window_row(seq_id):
            self.window_rows[seq_id] = self._free_windows.popleft()
        if cached_blocks:
            self.pool.touch(cached_blocks)
            self.block_tables[seq_id] = list(cached_blocks)
            self._num_cached_blocks[seq_id] = len(cached_blocks)
            self._shared_tokens[seq_id] = len(cached_blocks) * self.block_size
            if self.pool.num_sinks:  # position 0's bf16 K/V into the row
                sink = self.pool.sink_of(cached_blocks[0])
                row = self.window_rows[seq_id]
                self._sink_copies.append(SinkCopy(save=False, row=row, sink=sink))
        extra = self.extra_blocks_for(seq_id, num_tokens)
        table = self.block_tables.setdefault(seq_id, [])
        if extra:
            table.extend(self.pool.allocate(extra))
        return True

    def free(self, seq_id: str) -> int:
        """Return every block (and the window row) of `seq_id`; returns how many
        blocks. The last blocks go first onto the free list, so the prefix cache
        evicts a sequence's tail before the prefix that others may share."""
        table = self.block_tables.pop(seq_id, [])
        self.pool.free(table[::-1])
        self._num_cached_blocks.pop(seq_id, None)
        self._shared_tokens.pop(seq_id, None)
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
        """Cache slots of positions `start..end-1` of `seq_id`; -1 (not written)
        for positions of its cached prefix, recomputed only to refill a window."""
        slots = slot_mapping(self.block_table(seq_id), start, end, self.block_size)
        shared = self._shared_tokens.get(seq_id, 0) - start
        if shared > 0:
            slots[:shared] = [-1] * min(shared, len(slots))
        return slots

    # -- prefix cache ----------------------------------------------------------------

    def enable_prefix_caching(
        self, root_hash: bytes, window_refill_tokens: int
    ) -> None:
        """Cache full blocks under hashes chained from `root_hash` (what the block
        bytes depend on besides their tokens: `KVCacheManager.prefix_cache_root`);
        a hit on a cache with a window recomputes the `window_refill_tokens`
        positions before its first uncached one (module docstring)."""
        if window_refill_tokens < 0:
            raise ValueError("window_refill_tokens must be >= 0")
        self.prefix_caching = True
        self.root_hash = root_hash
        self.window_refill_tokens = window_refill_tokens

    def extend_block_hashes(
        self,
        block_hashes: list[bytes],
        token_ids: Callable[[int, int], Sequence[int]],
        num_tokens: int,
    ) -> list[bytes]:
        """Append to `block_hashes` (a sequence's, in block order) the hash of each
        further full block of its first `num_tokens` tokens; `token_ids(start,
        end)` gives the tokens at positions start..end-1. Returns the list."""
        size = self.block_size
        for index in range(len(block_hashes), num_tokens // size):
            parent = block_hashes[-1] if block_hashes else self.root_hash
            block_tokens = token_ids(index * size, (index + 1) * size)
            block_hashes.append(hash_block_tokens(parent, block_tokens))
        return block_hashes

    def cached_prefix(
        self, block_hashes: Sequence[bytes], num_tokens: int
    ) -> list[int]:
        """The cached blocks of the longest cached prefix of a sequence of
        `num_tokens` tokens with these block hashes, leaving at least its last token
        to compute (its logits sample the next one), as vLLM does."""
        if not self.prefix_caching:
            return []
        blocks: list[int] = []
        for block_hash in block_hashes[: (num_tokens - 1) // self.block_size]:
            block_id = self.pool.cached_block(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        if self.pool.num_sinks and blocks and self.pool.sink_of(blocks[0]) is None:
            return []  # a first block is a hit only with its sink (cached with it)
        return blocks

    def prefix_compute_start(self, num_cached_blocks: int) -> int:
        """First position a sequence computes after a cached prefix of
        `num_cached_blocks` blocks: the prefix's end, or, with a window, the
        `window_refill_tokens` before it (module docstring)."""
        return max(0, num_cached_blocks * self.block_size - self.window_refill_tokens)

    def cache_computed_blocks(
        self, seq_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int
    ) -> None:
        """Enter the full blocks of `seq_id` whose `num_computed_tokens` K/V are in
        the cache now into the prefix cache (a block whose tokens another block
        holds already stays private)."""
        if not self.prefix_caching:
            return
        table = self.block_tables[seq_id]
        first = self._num_cached_blocks.get(seq_id, 0)
        last = min(num_computed_tokens // self.block_size, len(block_hashes))
        if first == 0 < last and self.pool.num_sinks:
            # the first block enters with a copy of the row's position 0 if a sink
            # slot is to be had (else nothing of the sequence yet: tried next step)
            if self.pool.cached_block(block_hashes[0]) is None:
                sink = self.pool.cache_first_block(table[0], block_hashes[0])
                if sink is None:
                    return
                row = self.window_rows[seq_id]
                self._sink_copies.append(SinkCopy(save=True, row=row, sink=sink))
            first = 1
        for index in range(first, last):
            self.pool.cache_block(table[index], block_hashes[index])
        self._num_cached_blocks[seq_id] = max(first, last)

    def take_sink_copies(self) -> list[SinkCopy]:
        """The copies between window rows and the sink store owed since the last
        call, in the order they are owed (`KVCacheManager.apply_sink_copies`)."""
        copies, self._sink_copies = self._sink_copies, []
        return copies


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of a block's parent hash (the chain over everything before it) and
    its token ids: equal hashes mean equal tokens at equal positions after an equal
    prefix, under the same root (`KVCacheManager.prefix_cache_root`)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def model_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 of a model's config and weights (every tensor of its state dict by
    name, a tied one once): part of the prefix cache's root, since the same tokens
    give other K/V under other weights. Computed once per model object (the engine
    never changes weights after start: they are prepacked)."""
    cached = getattr(model, "_prefix_cache_model_digest", None)
    if cached is not None:
        return cached
    digest = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    seen: set[tuple[int, int]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.numel())
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if key in seen:
            continue
        seen.add(key)
        flat = tensor.detach().reshape(-1).cpu().contiguous()
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    value = digest.digest()
    model._prefix_cache_model_digest = value
    return value


def _kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) from our LlamaConfig or a transformers config."""
    num_layers = config.num_hidden_layers
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return num_layers, num_kv_heads, head_dim


def kv_bytes_per_token(config: Any, kv_dtype: str) -> int:
    """KV-cache bytes one token takes across all layers (K and V, scales included;
    for MLA the latent and RoPE key, `mla.mla_kv_bytes_per_token`).

    Exact: equals the summed `nbytes` of the model's caches divided by the number of
    token slots in them.
    """
    if mla.is_mla(config):
        return mla.mla_kv_bytes_per_token(config, kv_dtype)
    num_layers, num_kv_heads, head_dim = _kv_shape(config)
    per_layer = kernels.kv_bytes_per_token(kv_dtype, num_kv_heads, head_dim)
    return num_layers * per_layer


def kv_static_bytes(config: Any, kv_dtype: str) -> int:
    """Bytes the caches hold whatever their size (fp8's per-head scales, int4c's
    key means)."""
    if mla.is_mla(config):
        return mla.mla_kv_static_bytes(config, kv_dtype)
    num_layers, num_kv_heads, head_dim = _kv_shape(config)
    return num_layers * kernels.kv_static_bytes(kv_dtype, num_kv_heads, head_dim)


def kv_window_bytes(config: Any, window: int) -> int:
    """Bytes one sequence's full-precision window takes across all layers."""
    num_layers, num_kv_heads, head_dim = _kv_shape(config)
    return num_layers * kernels.kv_window_bytes(num_kv_heads, head_dim, window)


# KV dtypes whose window row keeps position 0 (the attention sink) in its last slot
# (engine.kv_int4c): their cached first blocks keep a copy of it (sinks).
SINK_DTYPES = (kv_int4c.DTYPE,)


def num_sinks_for(kv_dtype: str, num_windows: int) -> int:
    """Sink slots a cache keeps: one per window row for a dtype whose row holds
    position 0 (so the first block of every live sequence can be cached with its
    sink, `BlockManager`), none otherwise."""
    return num_windows if kv_dtype in SINK_DTYPES else 0


def kv_sink_bytes(config: Any) -> int:
    """Bytes one sink slot (position 0's bf16 K and V) takes across all layers."""
    return kv_window_bytes(config, 1)


def kv_sequence_extra_bytes(config: Any, kv_dtype: str, window: int) -> int:
    """KV bytes a sequence takes beside its tokens' blocks, all layers: its
    `window`-token bf16 row, its sink slot (`num_sinks_for`: one per row) and the
    cache's static scales or key means (shared, counted whole for a sequence alone),
    what a bytes-per-token comparison spreads over the sequence's tokens."""
    sinks = num_sinks_for(kv_dtype, 1) if window else 0
    return (
        kv_window_bytes(config, window)
        + sinks * kv_sink_bytes(config)
        + kv_static_bytes(config, kv_dtype)
    )


def window_refill_tokens(num_layers: int, kv_dtype: str, window: int) -> int:
    """Positions a prefix-cache hit recomputes before its first uncached one so
    that every layer's window row is what a run without the cache has there
    (module docstring): layers * (the newest positions a query reads in bf16,
    itself among them, less one). 0 without a window."""
    if not window:
        return 0
    newest = window - 1 if kv_dtype in SINK_DTYPES else window  # the row's last: 0
    return num_layers * (newest - 1)


def num_blocks_for_budget(
    config: Any,
    kv_dtype: str,
    budget_bytes: int,
    block_size: int,
    window: int = 0,
    num_windows: int = 0,
) -> int:
    """How many KV blocks (all layers) fit in `budget_bytes`, after the window rows
    (`num_windows` of `window` tokens), their sinks (`num_sinks_for`) and any
    static scales take theirs."""
    block_bytes = kv_bytes_per_token(config, kv_dtype) * block_size
    rest = int(budget_bytes) - num_windows * kv_window_bytes(config, window)
    rest -= num_sinks_for(kv_dtype, num_windows) * kv_sink_bytes(config)
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
        if mla.is_mla(config) and window:
            raise ValueError("MLA's latent cache keeps no full-precision window")
        num_sinks = num_sinks_for(kv_dtype, num_windows)
        self.blocks = BlockManager(
            num_blocks, block_size, window, num_windows, num_sinks
        )
        # per layer, position 0's bf16 K / V [num_sinks, H, D] of cached first blocks
        self.sink_key: list[torch.Tensor] = []
        self.sink_value: list[torch.Tensor] = []
        if mla.is_mla(config):  # one latent + RoPE key per token and layer
            self.kv_caches = [
                mla.allocate_mla_cache(
                    kv_dtype, num_blocks, block_size, mla.latent_dim(config), device
                )
                for _ in range(num_layers)
            ]
            return
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
        if num_sinks:
            for cache in self.kv_caches:
                sink = cache.window_key.new_zeros(num_sinks, num_kv_heads, head_dim)
                self.sink_key.append(sink)
                self.sink_value.append(torch.zeros_like(sink))

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
        """Bytes of every cache tensor, scales, windows and sinks included."""
        sinks = sum(t.nbytes for t in (*self.sink_key, *self.sink_value))
        return sum(cache.nbytes for cache in self.kv_caches) + sinks

    def apply_sink_copies(self) -> None:
        """Make the copies between window rows and sinks that the block manager
        owes (`BlockManager.take_sink_copies`), in order: call after a step's
        commit (a first block entered the cache: save its row's position 0
        before the row is reused) and before a forward (a hit: load it)."""
        for copy in self.blocks.take_sink_copies():
            for cache, sink_key, sink_value in zip(
                self.kv_caches, self.sink_key, self.sink_value, strict=True
            ):
                for sink, row in (
                    (sink_key, cache.window_key),
                    (sink_value, cache.window_value),
                ):
                    if copy.save:
                        sink[copy.sink] = row[copy.row, cache.window - 1]
                    else:
                        row[copy.row, cache.window - 1] = sink[copy.sink]

    def prefix_cache_root(self, model_digest: bytes) -> bytes:
        """The root of every block-hash chain: SHA-256 over what a block's bytes
        depend on besides its tokens and their prefix: the model (`model_digest`),
        the KV dtype (with its writer's version, `kernels.kv_writer_version`),
        block size and window, and per layer the rotation and static
        (fp8) scales or key means (int4c). Caches that differ in any of these
        never share a hash."""
        digest = hashlib.sha256(b"releasegate prefix cache v1\0")
        digest.update(model_digest)
        kv_format = self.kv_dtype
        if (version := kernels.kv_writer_version(self.kv_dtype)) > 1:
            kv_format += f"/v{version}"  # the same layout, written otherwise
        digest.update(f"{kv_format}:{self.block_size}:{self.window}".encode())
        for cache in self.kv_caches:
            digest.update(f":{cache.rotated}:{cache.key.device.type}".encode())
            if cache.static_scales:
                for scale in (cache.key_scale, cache.value_scale):
                    scale = scale.detach().cpu().contiguous()
                    digest.update(memoryview(scale.view(torch.uint8).numpy()))
            if cache.key_mean is not None:
                mean = cache.key_mean.detach().cpu().contiguous()
                digest.update(memoryview(mean.view(torch.uint8).numpy()))
        return digest.digest()

    def enable_prefix_caching(self, model_digest: bytes) -> None:
        """Turn on the prefix cache of this model's blocks; call after any static
        scales are set (they are part of the root). A hit on a cache with a window
        recomputes `window_refill_tokens` positions before its first uncached one,
        and on int4c copies position 0 from the sink of its first block (module
        docstring)."""
        refill = window_refill_tokens(len(self.kv_caches), self.kv_dtype, self.window)
        self.blocks.enable_prefix_caching(self.prefix_cache_root(model_digest), refill)
