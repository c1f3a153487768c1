"""A paged-attention driver for model tests: sequences through a model's paged
path as the engine's scheduler batches them (chunked prefill, mixed batches)."""

import torch

from gpuagent.engine.cache import KVCacheManager
from gpuagent.engine.model import AttentionMetadata


def run_paged(model, seqs, prefill_lens, kv_dtype="fp32", block_size=4, chunk=None):
    """Run seqs through the paged path as the engine's scheduler would, all seqs in
    one batch per step: each prefills its first prefill_lens[b] tokens (in chunks of
    at most `chunk` tokens, the later chunks reading the earlier ones from the cache),
    then decodes the rest one token per step. A seq that finished its prefill decodes
    in the same step as another one's prefill chunk (a mixed batch). The caches are
    the engine's own (`KVCacheManager`: a Llama's per-head K/V, MLA's latent).
    Returns per-seq logits [T_b, V]."""
    max_blocks = max(-(-len(s) // block_size) for s in seqs)
    kv = KVCacheManager(model.config, kv_dtype, len(seqs) * max_blocks, block_size)
    tables = torch.tensor(  # reversed blocks: the table is not the identity
        [
            list(range((b + 1) * max_blocks - 1, b * max_blocks - 1, -1))
            for b in range(len(seqs))
        ],
        dtype=torch.int32,
    )

    def slot(b, pos):
        return tables[b, pos // block_size].item() * block_size + pos % block_size

    out = [[] for _ in seqs]
    lens = [0] * len(seqs)
    while any(n < len(s) for s, n in zip(seqs, lens, strict=True)):
        live = [b for b in range(len(seqs)) if lens[b] < len(seqs[b])]
        take = {}
        for b in live:
            left = prefill_lens[b] - lens[b]
            take[b] = 1 if left <= 0 else min(left, chunk or left)
        decode_only = all(lens[b] >= prefill_lens[b] for b in live)
        ids, positions, slots, qsl = [], [], [], [0]
        for b in live:
            span = range(lens[b], lens[b] + take[b])
            ids += [seqs[b][p] for p in span]
            positions += list(span)
            slots += [slot(b, p) for p in span]
            qsl.append(qsl[-1] + take[b])
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=tables[live],
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            context_lens=torch.tensor(
                [lens[b] + take[b] for b in live], dtype=torch.int32
            ),
            decode_only=decode_only,
        )
        with torch.no_grad():
            logits = model(
                torch.tensor(ids), torch.tensor(positions), kv.kv_caches, attn, True
            )
        for i, b in enumerate(live):
            out[b].append(logits[qsl[i] : qsl[i + 1]])
            lens[b] += take[b]
    return [torch.cat(o) for o in out]
