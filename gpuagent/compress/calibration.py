"""Calibration text for GPTQ and the KV scales, from the project's corpus: the
training side of the demo model's split (`gpuagent.models.corpus`: Python's
reference-doc topics, stdlib sources, Korean message catalogs), none of which is the
evaluation text in `gpuagent/evaluate/data` (written for the project, checked
disjoint by `check_disjoint`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping

import torch

from gpuagent.evaluate.evalsets import load_text_slices
from gpuagent.models import corpus

# 96 x 256 tokens: on SmolLM2, w8a16 GPTQ's mean KLD was 0.00420 with 32 sequences
# and 0.00405 with 96 (AWQ + GPTQ act-order + mse observer: 0.00199 -> 0.00185);
# 512-token sequences did worse (0.00458), so the sequences stay 256 long. Distinct
# windows (calibration_sequences) instead of 29 repeats of 3 Korean sequences: AWQ +
# GPTQ act-order + mse through the fp32 reference matmul 0.00161 -> 0.00151.
DEFAULT_NUM_SEQUENCES = 96
DEFAULT_SEQUENCE_TOKENS = 256
_SEED = 1234


@functools.cache
def calibration_texts(num_per_domain: int) -> tuple[tuple[str, ...], ...]:
    """Up to `num_per_domain` documents each of English prose, code and Korean
    (one tuple per domain, in that order), drawn (seeded) from the training side of
    the demo corpus."""
    rng = random.Random(_SEED)
    english = corpus.english_docs(heldout=False)
    names = [p for n, p in corpus.code_files() if not corpus.is_heldout(n)]
    code = [
        p.read_text(encoding="utf-8", errors="replace")
        for p in rng.sample(names, min(len(names), 8 * num_per_domain))
    ]
    pairs = corpus.korean_pairs(corpus.django_korean_catalogs(), False)
    korean_lines = [msgstr for _, msgstr in pairs]
    rng.shuffle(korean_lines)
    # Korean messages are short: join runs of them into documents.
    korean = ["\n".join(korean_lines[i : i + 200]) for i in range(0, 20000, 200)]
    domains = []
    for docs in (english, code, korean):
        docs = [d for d in docs if len(d) > 2000]
        domains.append(tuple(rng.sample(docs, min(num_per_domain, len(docs)))))
    check_disjoint([text for docs in domains for text in docs])
    return tuple(domains)


def check_disjoint(texts: list[str]) -> None:
    """Refuse calibration text that contains an evaluation passage's line."""
    eval_lines = {
        line.strip()
        for s in load_text_slices()
        for p in s.passages
        for line in p.splitlines()
        if len(line.strip()) > 40
    }
    for text in texts:
        overlap = eval_lines.intersection(line.strip() for line in text.splitlines())
        if overlap:
            raise ValueError(f"calibration text overlaps the eval set: {overlap!r}")


def calibration_sequences(
    tokenizer,
    num_sequences: int = DEFAULT_NUM_SEQUENCES,
    sequence_tokens: int = DEFAULT_SEQUENCE_TOKENS,
) -> list[list[int]]:
    """`num_sequences` token sequences of `sequence_tokens` each (the domains in
    turn), encoded as the engine encodes prompts. A domain's sequences are its
    documents' consecutive windows, the first window of every document, then the
    second, ...: a domain with fewer documents than sequences (Korean: 3 documents
    of joined messages) gives distinct text, and repeats only once its windows
    run out."""
    per_domain = -(-num_sequences // 3)
    windows = [
        _windows(tokenizer, docs, sequence_tokens)
        for docs in calibration_texts(per_domain)
    ]
    sequences = []
    for i in range(num_sequences):
        domain = windows[i % 3]
        if domain:
            sequences.append(domain[(i // 3) % len(domain)])
    if not sequences:
        raise ValueError(f"no calibration document has {sequence_tokens} tokens")
    return sequences


def _windows(tokenizer, docs: tuple[str, ...], tokens: int) -> list[list[int]]:
    """Every whole `tokens`-long window of the documents, window index first."""
    encoded = [tokenizer.encode_prompt(doc) for doc in docs]
    most = max((len(ids) // tokens for ids in encoded), default=0)
    return [
        ids[w * tokens : (w + 1) * tokens]
        for w in range(most)
        for ids in encoded
        if len(ids) >= (w + 1) * tokens
    ]


def run_layer(
    layer: torch.nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inputs_to: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> torch.Tensor:
    """One decoder layer over the calibration hidden states [B, T, hidden], 8
    sequences at a time: its outputs, each named projection's inputs handed to
    `inputs_to[name]` on the way (hooks removed whatever happens)."""
    hooks = [
        layer.get_submodule(name).register_forward_pre_hook(
            lambda _m, args, take=take: take(args[0])
        )
        for name, take in (inputs_to or {}).items()
    ]
    try:
        with torch.no_grad():
            return torch.cat(
                [layer.forward_dense(batch, cos, sin) for batch in hidden.split(8)]
            )
    finally:
        for hook in hooks:
            hook.remove()
