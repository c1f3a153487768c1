import pytest

from gpuagent.engine.cache import (
    BlockManager,
    BlockPool,
    KVCacheManager,
    NoFreeBlocksError,
    SinkCopy,
    blocks_needed,
    kv_bytes_per_token,
    kv_sink_bytes,
    kv_window_bytes,
    num_blocks_for_budget,
    slot_mapping,
    window_refill_tokens,
)
from gpuagent.engine.model import LlamaConfig

KV_DTYPES = ("bf16", "fp16", "fp8-per-token", "int8", "int4", "fp32")


def small_config(head_dim: int = 64, num_kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=264,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
    )


def test_it_hands_out_every_block_once_and_takes_them_back():
    pool = BlockPool(8)

    first = pool.allocate(5)
    second = pool.allocate(3)

    assert sorted(first + second) == list(range(8))
    assert pool.num_free_blocks == 0
    pool.free(first)
    assert pool.num_free_blocks == 5
    assert pool.num_used_blocks == 3


def test_it_refuses_more_blocks_than_free_without_taking_any():
    pool = BlockPool(4)
    pool.allocate(3)

    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)

    assert pool.num_free_blocks == 1


def test_it_rejects_a_double_free():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)

    with pytest.raises(ValueError, match="freed twice"):
        pool.free(blocks)


def test_it_keeps_a_shared_block_until_its_last_reference_goes():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.share(block)

    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_it_maps_positions_to_slots_through_the_block_table():
    table = [5, 2, 9]

    slots = slot_mapping(table, 2, 10, block_size=4)

    assert slots == [22, 23, 8, 9, 10, 11, 36, 37]


def test_it_refuses_slots_beyond_the_table():
    with pytest.raises(ValueError, match="need 3 blocks"):
        slot_mapping([0, 1], 0, 9, block_size=4)


def test_it_grows_block_tables_only_when_a_block_fills():
    blocks = BlockManager(num_blocks=6, block_size=4)

    assert blocks.ensure_capacity("a", 4)
    assert len(blocks.block_table("a")) == 1
    assert blocks.ensure_capacity("a", 5)
    assert len(blocks.block_table("a")) == 2
    assert blocks.ensure_capacity("a", 8)
    assert len(blocks.block_table("a")) == 2
    assert blocks.num_used_blocks == 2


def test_it_takes_nothing_when_a_sequence_cannot_grow():
    blocks = BlockManager(num_blocks=3, block_size=4)
    blocks.ensure_capacity("a", 8)

    assert not blocks.ensure_capacity("b", 9)

    assert blocks.block_table("b") == []
    assert blocks.num_free_blocks == 1


def test_it_gives_distinct_sequences_disjoint_slots():
    blocks = BlockManager(num_blocks=10, block_size=4)
    for seq_id, length in (("a", 7), ("b", 13), ("c", 1)):
        assert blocks.ensure_capacity(seq_id, length)

    all_slots = [
        slot
        for seq_id, length in (("a", 7), ("b", 13), ("c", 1))
        for slot in blocks.slot_mapping(seq_id, 0, length)
    ]

    assert len(all_slots) == len(set(all_slots)) == 21
    assert max(all_slots) < 10 * 4


def test_it_frees_a_sequences_blocks_at_once():
    blocks = BlockManager(num_blocks=4, block_size=4)
    blocks.ensure_capacity("a", 10)

    assert blocks.free("a") == 3

    assert blocks.num_free_blocks == 4
    assert blocks.block_table("a") == []


def test_it_counts_blocks_for_partial_blocks():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_it_counts_kv_bytes_per_token_exactly(kv_dtype, head_dim):
    config = small_config(head_dim=head_dim)
    manager = KVCacheManager(config, kv_dtype, num_blocks=5, block_size=16)

    per_token = kv_bytes_per_token(config, kv_dtype)

    assert per_token * 5 * 16 == manager.nbytes
    assert manager.bytes_per_token == per_token
    assert len(manager.kv_caches) == config.num_hidden_layers


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_it_fits_as_many_blocks_as_the_budget_holds(kv_dtype):
    config = small_config()
    budget_bytes = 1_000_000

    num_blocks = num_blocks_for_budget(config, kv_dtype, budget_bytes, 16)
    manager = KVCacheManager.for_budget(config, kv_dtype, budget_bytes, 16)

    assert manager.num_blocks == num_blocks
    assert manager.nbytes <= budget_bytes
    one_block_more = manager.nbytes + kv_bytes_per_token(config, kv_dtype) * 16
    assert one_block_more > budget_bytes


def test_it_gives_quantized_dtypes_the_expected_share_of_bf16_bytes():
    config = small_config(head_dim=64)
    bf16 = kv_bytes_per_token(config, "bf16")

    assert kv_bytes_per_token(config, "fp16") == bf16
    assert kv_bytes_per_token(config, "int8") / bf16 <= 0.52
    assert kv_bytes_per_token(config, "fp8-per-token") / bf16 <= 0.52
    assert kv_bytes_per_token(config, "int4") / bf16 <= 0.27
    # Scales must be counted: quantized sizes exceed the bare payload.
    assert kv_bytes_per_token(config, "int8") > bf16 / 2
    assert kv_bytes_per_token(config, "int4") > bf16 / 4


def test_it_rejects_an_unknown_kv_dtype():
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        KVCacheManager(small_config(), "int3", num_blocks=1)


def test_it_refuses_a_budget_below_one_block():
    with pytest.raises(ValueError, match="holds no block"):
        KVCacheManager.for_budget(small_config(), "bf16", 100, 16)


def test_it_gives_each_sequence_one_window_row_with_its_first_blocks():
    blocks = BlockManager(num_blocks=8, block_size=4, window=6, num_windows=2)

    assert blocks.ensure_capacity("a", 5)
    assert blocks.ensure_capacity("a", 9)  # growing keeps the row
    assert blocks.ensure_capacity("b", 1)

    assert sorted(blocks.window_rows.values()) == [0, 1]
    row_a = blocks.window_row("a")
    blocks.free("a")
    assert "a" not in blocks.window_rows
    assert blocks.ensure_capacity("c", 1)
    assert blocks.window_row("c") == row_a


def test_it_takes_nothing_when_no_window_row_is_free():
    blocks = BlockManager(num_blocks=8, block_size=4, window=6, num_windows=1)
    assert blocks.ensure_capacity("a", 4)

    assert not blocks.can_hold("b", 4)
    assert not blocks.ensure_capacity("b", 4)
    assert blocks.block_table("b") == [] and blocks.num_free_blocks == 7
    assert blocks.can_hold("a", 8)  # a holds its row already


def test_it_maps_only_the_newest_positions_to_window_slots():
    blocks = BlockManager(num_blocks=16, block_size=4, window=4, num_windows=3)
    for seq_id in ("x", "y"):
        blocks.ensure_capacity(seq_id, 20)
    row = blocks.window_row("y")

    # A 10-token chunk: only positions 6..9 are among the newest 4 afterwards.
    assert blocks.window_slots("y", 0, 10) == [-1] * 6 + [
        row * 4 + p % 4 for p in range(6, 10)
    ]
    # A chunk shorter than the window: every token goes in, wrapping the ring.
    assert blocks.window_slots("y", 10, 12) == [row * 4 + 2, row * 4 + 3]
    assert blocks.window_slots("y", 12, 13) == [row * 4 + 0]


def test_it_takes_window_rows_out_of_the_budget():
    config = small_config()
    budget_bytes = 1_000_000
    row_bytes = kv_window_bytes(config, 16)

    manager = KVCacheManager.for_budget(
        config, "int4", budget_bytes, 16, window=16, num_windows=8
    )

    # bf16 K and V of 16 tokens in every layer
    assert row_bytes == config.num_hidden_layers * 2 * 16 * 2 * 64 * 2
    block_bytes = kv_bytes_per_token(config, "int4") * 16
    assert manager.nbytes == manager.num_blocks * block_bytes + 8 * row_bytes
    assert manager.nbytes <= budget_bytes < manager.nbytes + block_bytes
    assert manager.num_blocks == num_blocks_for_budget(
        config, "int4", budget_bytes, 16, 16, 8
    )


def test_it_refuses_a_window_on_an_unquantized_cache():
    with pytest.raises(ValueError, match="quantized caches"):
        KVCacheManager(small_config(), "bf16", 4, window=8, num_windows=2)
    with pytest.raises(ValueError, match="both be 0 or both be positive"):
        BlockManager(4, 4, window=8, num_windows=0)


# -- prefix cache ----------------------------------------------------------------------

ROOT = b"root"


def caching_blocks(num_blocks: int, block_size: int = 4, refill: int = 0):
    blocks = BlockManager(num_blocks, block_size)
    blocks.enable_prefix_caching(ROOT, refill)
    return blocks


def hashes_of(blocks: BlockManager, tokens: list[int]) -> list[bytes]:
    return blocks.extend_block_hashes([], lambda a, b: tokens[a:b], len(tokens))


def admit(blocks: BlockManager, seq_id: str, tokens: list[int]) -> list[int]:
    """Admit `tokens` as a new sequence from its cached prefix, "compute" the rest
    and cache its full blocks, as the scheduler does; returns the prefix's blocks."""
    hashes = hashes_of(blocks, tokens)
    cached = blocks.cached_prefix(hashes, len(tokens))
    assert blocks.ensure_capacity(seq_id, len(tokens), cached)
    blocks.cache_computed_blocks(seq_id, hashes, len(tokens))
    return cached


def test_it_reuses_the_cached_blocks_of_a_shared_prefix_by_reference():
    blocks = caching_blocks(8)
    first = admit(blocks, "a", list(range(10)))  # blocks 0-3, 4-7 full; 8-9 not

    cached = admit(blocks, "b", list(range(8)) + [50, 51, 52])

    assert first == []
    assert cached == blocks.block_table("a")[:2] == blocks.block_table("b")[:2]
    assert [blocks.pool.ref_count(b) for b in cached] == [2, 2]
    assert blocks.num_used_blocks == 3 + 1  # a's three, b's own third


def test_it_leaves_the_last_token_of_a_fully_cached_prompt_to_compute():
    blocks = caching_blocks(8)
    admit(blocks, "a", list(range(8)))

    cached = admit(blocks, "b", list(range(8)))

    # both blocks are cached; the second is recomputed so that there are logits
    assert len(cached) == 1
    assert blocks.block_table("b")[1] != blocks.block_table("a")[1]


def test_it_changes_every_later_block_hash_when_an_earlier_token_changes():
    blocks = caching_blocks(12)
    tokens = list(range(16))
    changed = tokens.copy()
    changed[5] = 99  # in the second block

    before, after = hashes_of(blocks, tokens), hashes_of(blocks, changed)

    assert before[0] == after[0]
    assert all(b != a for b, a in zip(before[1:], after[1:], strict=True))
    admit(blocks, "a", tokens + [0])
    assert len(admit(blocks, "b", changed + [0])) == 1


def test_it_keeps_a_freed_block_cached_until_the_pool_needs_it():
    blocks = caching_blocks(4)
    admit(blocks, "a", list(range(9)))  # three blocks, two full
    blocks.free("a")
    assert blocks.num_free_blocks == 4 and blocks.pool.num_cached_blocks == 2

    cached = admit(blocks, "b", list(range(8)) + [7])

    assert len(cached) == 2 and blocks.num_free_blocks == 1
    blocks.free("b")
    blocks.pool.allocate(4)  # the pool needs every block: both hashes go
    assert blocks.pool.num_cached_blocks == 0
    assert blocks.pool.num_evicted_blocks == 2


def test_it_evicts_the_least_recently_freed_cached_block_first():
    blocks = caching_blocks(4)
    for seq_id, first in (("old", 0), ("new", 100)):
        admit(blocks, seq_id, list(range(first, first + 5)))  # one full block each
    blocks.free("old")
    blocks.free("new")

    blocks.pool.allocate(3)  # free list: old's tail, old's cached, new's tail

    new_tokens = list(range(100, 105))
    assert blocks.cached_prefix(hashes_of(blocks, new_tokens), 5) != []
    assert blocks.cached_prefix(hashes_of(blocks, list(range(5))), 5) == []


def test_it_frees_a_sequences_tail_before_its_prefix():
    blocks = caching_blocks(4)
    tokens = list(range(13))  # three full blocks, one partial
    admit(blocks, "a", tokens)
    blocks.free("a")

    blocks.pool.allocate(2)  # the partial block, then the last full one

    assert len(blocks.cached_prefix(hashes_of(blocks, tokens), len(tokens))) == 2


def test_it_never_evicts_a_block_in_use():
    blocks = caching_blocks(5)
    admit(blocks, "held", list(range(9)))  # three blocks, the first two cached
    admit(blocks, "gone", list(range(50, 55)))  # one cached block, freed
    blocks.free("gone")
    held = blocks.block_table("held")

    taken = blocks.pool.allocate(blocks.num_free_blocks)

    assert set(taken).isdisjoint(held)
    with pytest.raises(NoFreeBlocksError):
        blocks.pool.allocate(1)
    tokens = list(range(8)) + [1]
    assert blocks.cached_prefix(hashes_of(blocks, tokens), len(tokens)) == held[:2]
    assert blocks.cached_prefix(hashes_of(blocks, list(range(50, 55))), 5) == []


def test_it_never_writes_into_a_cached_prefix():
    blocks = caching_blocks(8, refill=3)
    admit(blocks, "a", list(range(9)))
    tokens = list(range(8)) + [40, 41]
    cached = blocks.cached_prefix(hashes_of(blocks, tokens), len(tokens))
    start = blocks.prefix_compute_start(len(cached))
    assert blocks.ensure_capacity("b", len(tokens), cached)

    slots = blocks.slot_mapping("b", start, len(tokens))

    assert start == 8 - 3
    assert slots[:3] == [-1, -1, -1]
    own = blocks.block_table("b")[2]
    assert slots[3:] == [own * 4, own * 4 + 1]


# -- sinks (int4c: position 0 in the window row's last slot) ---------------------------


def sink_blocks(num_blocks: int, num_sinks: int) -> BlockManager:
    blocks = BlockManager(num_blocks, 4, window=3, num_windows=4, num_sinks=num_sinks)
    blocks.enable_prefix_caching(ROOT, 0)
    return blocks


def test_it_caches_a_first_block_with_a_sink_and_owes_the_copies():
    blocks = sink_blocks(8, num_sinks=2)
    admit(blocks, "a", list(range(9)))  # two full blocks
    saved = blocks.take_sink_copies()

    cached = admit(blocks, "b", list(range(8)) + [50])

    first = blocks.block_table("a")[0]
    sink = blocks.pool.sink_of(first)
    assert saved == [SinkCopy(save=True, row=blocks.window_row("a"), sink=sink)]
    assert blocks.pool.sink_of(blocks.block_table("a")[1]) is None  # first only
    assert cached == blocks.block_table("a")[:2]
    assert blocks.take_sink_copies() == [
        SinkCopy(save=False, row=blocks.window_row("b"), sink=sink)
    ]
    assert blocks.take_sink_copies() == []


def test_it_frees_a_sink_with_its_evicted_first_block():
    blocks = sink_blocks(3, num_sinks=1)
    tokens = list(range(5))
    admit(blocks, "a", tokens)
    first = blocks.block_table("a")[0]
    blocks.free("a")

    blocks.pool.allocate(3)  # every block: a's first one is evicted

    assert blocks.pool.sink_of(first) is None
    blocks.pool.free(range(3))
    blocks.take_sink_copies()
    assert admit(blocks, "b", tokens) == []  # recomputed from position 0
    assert blocks.take_sink_copies() == [
        SinkCopy(save=True, row=blocks.window_row("b"), sink=0)
    ]


def test_it_takes_the_sink_of_the_least_recently_used_unheld_first_block():
    blocks = sink_blocks(12, num_sinks=2)
    prompts = {name: [first] * 5 for name, first in (("a", 1), ("b", 2), ("c", 3))}
    admit(blocks, "a", prompts["a"])
    admit(blocks, "b", prompts["b"])
    blocks.free("a")
    blocks.free("b")
    admit(blocks, "a2", prompts["a"])  # a hit: a's block used more recently
    blocks.free("a2")

    admit(blocks, "c", prompts["c"])

    def hit(name: str) -> bool:
        tokens = prompts[name]
        return blocks.cached_prefix(hashes_of(blocks, tokens), len(tokens)) != []

    assert (hit("a"), hit("b"), hit("c")) == (True, False, True)
    assert blocks.pool.num_cached_blocks == 2


def test_it_caches_no_first_block_while_every_sink_is_held():
    blocks = sink_blocks(12, num_sinks=2)
    admit(blocks, "a", [1] * 5)
    admit(blocks, "b", [2] * 5)
    blocks.take_sink_copies()

    admit(blocks, "c", [3] * 9)  # held a's and b's sinks stay

    assert blocks.take_sink_copies() == []
    assert blocks.pool.num_cached_blocks == 2
    blocks.free("a")  # c's blocks enter the cache at its next step
    blocks.cache_computed_blocks("c", hashes_of(blocks, [3] * 9), 9)
    assert [c.save for c in blocks.take_sink_copies()] == [True]
    assert blocks.pool.num_cached_blocks == 2 + 1


def test_it_recomputes_one_window_per_layer_before_a_cached_prefix():
    # fp8/int4 queries read their newest `window` positions in bf16; int4c's read
    # window - 1 and the sink (module docstring)
    assert window_refill_tokens(4, "int4", 18) == 4 * 17
    assert window_refill_tokens(4, "int4c", 18) == 4 * 16
    assert window_refill_tokens(4, "int8", 0) == 0


def test_it_counts_the_sinks_in_the_bytes_and_the_budget():
    config = small_config()
    budget_bytes = 1_000_000
    row_bytes = kv_window_bytes(config, 16)

    manager = KVCacheManager.for_budget(
        config, "int4c", budget_bytes, 16, window=16, num_windows=8
    )

    sink_bytes = kv_sink_bytes(config)
    assert sink_bytes == row_bytes // 16
    assert [s.shape[0] for s in manager.sink_key] == [8] * config.num_hidden_layers
    block_bytes = kv_bytes_per_token(config, "int4c") * 16
    means = config.num_hidden_layers * 2 * 64 * 4
    assert manager.nbytes == (
        manager.num_blocks * block_bytes + 8 * (row_bytes + sink_bytes) + means
    )
    assert manager.nbytes <= budget_bytes < manager.nbytes + block_bytes
    plain = KVCacheManager(config, "int4", 4, 16, window=16, num_windows=8)
    assert plain.sink_key == [] and plain.blocks.pool.num_sinks == 0
