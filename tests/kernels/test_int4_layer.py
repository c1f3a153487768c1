"""A decoder layer's decode step in one call (kernels.int4_layer) against the same
layer composed of the per-op parts it replaces: the int4 matmul kernel per
projection, torch's RMSNorm, the model's RoPE, `write_kv` into a bf16 cache and
the paged decode attention's torch reference; and its refusals, which write
nothing."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from gpuagent.engine.model import apply_rope
from kernels import int4_cpu, int4_layer
from kernels.kv_quant import allocate_kv_cache, write_kv
from kernels.paged_attention import paged_decode_attention_reference
from kernels.weight_matmul import quantize_weight_int4

HIDDEN, INTER = 64, 96
BLOCK, BLOCKS = 4, 32
EPS = 1e-5


@dataclass(frozen=True)
class Heads:
    """Query heads, kv heads and head width of the layer under test."""

    heads: int = 4
    kv: int = 2
    dim: int = 16

    @property
    def scale(self) -> float:
        return self.dim**-0.5

    @property
    def shapes(self):
        """qkv, o_proj, gate_up, down_proj: (rows, columns, group, zero points)"""
        return (
            ((self.heads + 2 * self.kv) * self.dim, HIDDEN, 32, False),
            (HIDDEN, self.heads * self.dim, 64, True),
            (2 * INTER, HIDDEN, 32, False),
            (HIDDEN, INTER, 32, False),
        )


DEFAULT = Heads()
SHAPES = DEFAULT.shapes
HEADS, KV_HEADS, HEAD_DIM = DEFAULT.heads, DEFAULT.kv, DEFAULT.dim

pytestmark = pytest.mark.skipif(
    not int4_layer.AVAILABLE, reason="the int4 extension is not built"
)


def weights(seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k, group, zero_point in shapes:
        w = torch.randn(n, k, generator=g) * 0.2
        packed, scale = quantize_weight_int4(w, group)
        zs = torch.randn(n, k // group, generator=g) * scale if zero_point else None
        out.append(int4_cpu.PreparedInt4(packed, scale.float(), group, zs))
    return tuple(out)


def norms(seed):
    g = torch.Generator().manual_seed(seed)
    return [1 + 0.1 * torch.randn(HIDDEN, generator=g) for _ in range(2)]


def cache(seed, hd=DEFAULT):
    c = allocate_kv_cache("bf16", BLOCKS, BLOCK, hd.kv, hd.dim)
    g = torch.Generator().manual_seed(seed)
    c.key.copy_(torch.randn(c.key.shape, generator=g))  # earlier tokens' K/V
    c.value.copy_(torch.randn(c.value.shape, generator=g))
    return c


def step_inputs(lens, seed, hd=DEFAULT):
    """Each row's block table (shuffled blocks, no two rows sharing), its new
    token's slot at position len - 1, and RoPE cos/sin at that position."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(BLOCKS, generator=g)
    width = max((n + BLOCK - 1) // BLOCK for n in lens)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    taken = 0
    for r, n in enumerate(lens):
        used = (n + BLOCK - 1) // BLOCK
        tables[r, :used] = order[taken : taken + used].to(torch.int32)
        taken += used
    slots = torch.tensor(
        [
            int(tables[r, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK
            for r, n in enumerate(lens)
        ]
    )
    positions = torch.tensor(lens) - 1
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd.dim, 2).float() / hd.dim))
    freqs = positions.float()[:, None] * inv_freq
    cos = torch.cat((freqs, freqs), -1).cos()
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    return cos, sin, slots, tables, torch.tensor(lens, dtype=torch.int32)


def reference(x, ws, ln, kv, cos, sin, slots, tables, lens, hd=DEFAULT):
    """The layer in torch over the per-op int4 kernel; x and kv updated."""
    heads, kv_heads = hd.heads, hd.kv

    def mm(a, w):
        return int4_cpu.int4_matmul_prepared(a.contiguous(), w)

    h = F.rms_norm(x, (HIDDEN,), ln[0], EPS)
    qkv = mm(h, ws[0]).unflatten(-1, (-1, hd.dim))  # [M, H + 2 KVH, D]
    qk = apply_rope(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
    q, k = qk.split((heads, kv_heads), 1)
    v = qkv[:, heads + kv_heads :]
    write_kv(kv, k, v, slots)
    att = paged_decode_attention_reference(q, kv, tables, lens, hd.scale)
    x = x + mm(att.flatten(-2), ws[1])
    gate, up = mm(F.rms_norm(x, (HIDDEN,), ln[1], EPS), ws[2]).chunk(2, -1)
    return x + mm(F.silu(gate) * up, ws[3])


def run(layer, x, cos, sin, slots, tables, lens, kv, attention=None, hd=DEFAULT):
    step = int4_layer.DecodeStep(cos, sin, slots, tables, lens)
    int4_layer.decode(layer, x, step, kv.key, kv.value, hd.scale, attention)


def make_layer(ws, ln, hd=DEFAULT):
    return int4_layer.Int4DecodeLayer(*ln, EPS, ws, hd.heads, hd.kv, hd.dim)


def test_the_attention_has_a_simd_build_here():
    assert int4_layer.ATTENTION_PATHS[-1] == "portable"
    assert int4_layer.ATTENTION_PATHS[0] == "avx2"  # every x86-64 CPU here has it


# GQA groups of 2 (AVX2: value passes of 16 columns), 3 (SmolLM2's), 4, 8, 12 (more
# than the AVX2 build's 8: portable), and MHA at 8 columns (one pass of 8); each
# heads * dim a multiple of o_proj's group of 64
LAYOUTS = [DEFAULT, Heads(6, 2, 32), Heads(8, 2, 64), Heads(8, 1, 16), Heads(12, 1, 16),
           Heads(8, 8, 8)]  # fmt: skip


@pytest.mark.parametrize("hd", LAYOUTS, ids=lambda h: f"{h.heads}x{h.kv}x{h.dim}")
@pytest.mark.parametrize("attention", int4_layer.ATTENTION_PATHS)
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize(
    "lens",
    [[1], [7], [5, 12, 1], [3, 9, 4, 16, 2, 11, 6, 8], [37, 61]],
    ids=str,
)
def test_one_call_is_the_layer_of_per_op_parts(lens, q8, attention, hd):
    ws = weights(0, hd.shapes)
    for w in ws:
        w.int8_activations = q8
    ln = norms(1)
    x = torch.randn(len(lens), HIDDEN, generator=torch.Generator().manual_seed(2))
    cos, sin, slots, tables, ctx = step_inputs(lens, 3, hd)
    want_kv, got_kv = cache(4, hd), cache(4, hd)
    want = reference(x, ws, ln, want_kv, cos, sin, slots, tables, ctx, hd)
    got = x.clone()
    run(
        make_layer(ws, ln, hd), got, cos, sin, slots, tables, ctx, got_kv, attention, hd
    )

    # within float32 rounding, and the odd new K/V value rounded to the other bf16
    # neighbour (its inputs differ in the last bits): 1.3e-5 measured
    torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    assert not torch.equal(got, x)
    # the K/V written: each row's slot, bf16 as torch rounds it (the inputs of the
    # rounding differ by float32 rounding, so a value may land one bf16 step away)
    for store in ("key", "value"):
        a, b = getattr(got_kv, store).float(), getattr(want_kv, store).float()
        assert (a != b).float().mean() < 0.02, store
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
        flat_a = a.view(-1, hd.kv, hd.dim)
        untouched = torch.ones(flat_a.shape[0], dtype=torch.bool)
        untouched[slots] = False
        before = getattr(cache(4, hd), store).float().view(-1, hd.kv, hd.dim)
        assert torch.equal(flat_a[untouched], before[untouched])


def test_a_row_with_slot_minus_one_writes_nothing():
    ws, ln = weights(0), norms(1)
    cos, sin, slots, tables, ctx = step_inputs([6, 3], 3)
    slots[1] = -1
    kv, before = cache(4), cache(4)
    x = torch.randn(2, HIDDEN)
    want = reference(x, ws, ln, cache(4), cos, sin, slots, tables, ctx)
    got = x.clone()
    run(make_layer(ws, ln), got, cos, sin, slots, tables, ctx, kv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    row = kv.key.view(-1, KV_HEADS, HEAD_DIM)
    first = int(tables[1, 0]) * BLOCK + 2  # row 1's position 2, not written
    assert torch.equal(row[first], before.key.view(-1, KV_HEADS, HEAD_DIM)[first])


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda s: s[2].__setitem__(0, BLOCKS * BLOCK), "slot"),
        (lambda s: s[3].__setitem__((0, 0), BLOCKS), "block table entry"),
        (lambda s: s[3].__setitem__((1, 0), -1), "block table entry"),
        (lambda s: s[4].__setitem__(0, 0), "context length"),
        (lambda s: s[4].__setitem__(1, 3 * BLOCK + 1), "context length"),
    ],
)
def test_an_index_outside_the_cache_is_refused_and_nothing_is_written(
    break_it, message
):
    ws, ln = weights(0), norms(1)
    inputs = list(step_inputs([5, 12], 3))
    break_it(inputs)
    kv = cache(4)
    x = torch.randn(2, HIDDEN)
    got = x.clone()
    with pytest.raises(ValueError, match=message):
        run(make_layer(ws, ln), got, *inputs, kv)
    assert torch.equal(got, x)
    assert torch.equal(kv.key, cache(4).key) and torch.equal(kv.value, cache(4).value)


def test_an_attention_path_that_does_not_run_is_refused():
    kv = cache(4)
    with pytest.raises(ValueError, match="attention path avx9 does not run here"):
        run(make_layer(weights(0), norms(1)), torch.randn(1, HIDDEN),
            *step_inputs([3], 3), kv, "avx9")  # fmt: skip
    assert torch.equal(kv.key, cache(4).key)


def test_shapes_that_disagree_are_named():
    ln = norms(1)
    wrong_o = list(SHAPES)
    wrong_o[1] = (HIDDEN, HIDDEN + 32, 32, False)  # columns != heads * head_dim
    with pytest.raises(ValueError, match="o_proj's columns"):
        make_layer(weights(0, tuple(wrong_o)), ln)
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        make_layer(weights(0), [ln[0], torch.ones(HIDDEN + 1)])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        int4_layer.Int4DecodeLayer(*ln, EPS, weights(0), HEADS, 3, HEAD_DIM)


def test_int8_activations_on_a_group_no_q8_build_takes_are_refused():
    shapes = list(SHAPES)
    shapes[3] = (HIDDEN, INTER, 16, False)  # group 16: float builds only
    ws = weights(0, tuple(shapes))
    ws[3].int8_activations = True
    kv = cache(4)
    with pytest.raises(ValueError, match="down_proj: no int8-activation build"):
        run(make_layer(ws, norms(1)), torch.randn(1, HIDDEN), *step_inputs([3], 3), kv)
    assert torch.equal(kv.key, cache(4).key)
