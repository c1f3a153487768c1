"""The evaluation sets that ship with the project (`gpuagent/evaluate/data/`, written
for it): per slice, passages scored teacher-forced and prompts continued greedily;
and the long-context slice, built here from those passages with a fact planted
early and asked for at the end (the retrieval check).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
TEXT_SLICES = ("english", "code", "korean")
PASSAGE_SEPARATOR = "\n=====\n"
LONG_CONTEXT = "long_context"
SENTENCE_END = r"(?<=[.!?])\s+|\n+"


@dataclass
class Prompt:
    """A prompt to continue greedily and the answer a right continuation holds."""

    text: str
    answer: str


@dataclass
class EvalSlice:
    """One slice: passages (teacher-forced) and prompts (greedy continuations)."""

    name: str
    passages: list[str]
    prompts: list[Prompt] = field(default_factory=list)


def load_text_slices(data_dir: Path = DATA_DIR) -> list[EvalSlice]:
    """The english, code and korean slices from `data_dir`."""
    continuations = json.loads((data_dir / "continuations.json").read_text("utf-8"))
    slices = []
    for name in TEXT_SLICES:
        text = (data_dir / f"{name}.txt").read_text("utf-8")
        passages = [p.strip("\n") for p in text.split(PASSAGE_SEPARATOR)]
        prompts = [Prompt(c["prompt"], c["answer"]) for c in continuations[name]]
        slices.append(EvalSlice(name, [p for p in passages if p], prompts))
    return slices


def long_context_slice(
    text_slices: Sequence[EvalSlice],
    num_tokens: int,
    count_tokens: Callable[[str], int],
    seed: int,
    data_dir: Path = DATA_DIR,
) -> EvalSlice:
    """One long prompt per planted fact, each about `num_tokens` long (by
    `count_tokens`, the model's tokenizer): a sentence, the fact, then sentences (or
    code lines) of every slice's passages in a seeded order (repeated as needed),
    then the question. The
    passage scored teacher-forced is the prompt itself; the prompt to continue is
    the same text, whose right answer is the fact's value."""
    facts = json.loads((data_dir / "long_context.json").read_text("utf-8"))
    pool = [
        unit
        for s in text_slices
        for p in s.passages
        for unit in re.split(SENTENCE_END, p)
        if unit.strip()
    ]
    rng = random.Random(seed)
    passages, prompts = [], []
    for fact in facts:
        order = pool[:]
        rng.shuffle(order)
        question = "\n\n" + fact["question"]
        budget = num_tokens - count_tokens(fact["fact"] + question)
        # The fact comes early: after the first sentence short enough to leave room.
        lead = next(
            (u for u in order if count_tokens(u + " " + fact["fact"]) < budget), None
        )
        if lead is None:
            raise ValueError(
                f"{num_tokens} tokens is too short for a long-context prompt"
            )
        order.remove(lead)
        parts = [lead, fact["fact"]]
        used = count_tokens(" ".join(parts))
        # Sentences in the seeded order, round and round, each one that still fits
        # (a long one is skipped for a shorter), until none does.
        index, misses = 0, 0
        while misses < len(order):
            passage = order[index % len(order)]
            cost = count_tokens(" " + passage)
            index += 1
            if used + cost > budget:
                misses += 1
                continue
            parts.append(passage)
            used += cost
            misses = 0
        if len(parts) < 3:
            raise ValueError(
                f"{num_tokens} tokens is too short for a long-context prompt"
            )
        text = " ".join(parts) + question
        passages.append(text)
        prompts.append(Prompt(text, fact["answer"]))
    return EvalSlice(LONG_CONTEXT, passages, prompts)


# Held-out long passages (`heldout/`): text from outside the project, never used to
# tune a recipe or calibrate a cache, each scored whole (the KV long-text bench).
HELDOUT_DIR = Path(__file__).resolve().parent / "heldout"


@dataclass
class HeldOutPassage:
    """One held-out passage: its slice (english, code, korean), name and text."""

    slice: str
    name: str
    text: str


def load_heldout_passages(data_dir: Path = HELDOUT_DIR) -> list[HeldOutPassage]:
    """The held-out passages, one file `<slice>-<name>.txt` each (sources in
    `heldout/SOURCES.md`), by slice in TEXT_SLICES order, then by name."""
    passages = []
    for path in sorted(data_dir.glob("*.txt")):
        slice_name, _, name = path.stem.partition("-")
        if slice_name not in TEXT_SLICES or not name:
            raise ValueError(
                f"held-out passage {path.name} is not named <slice>-<name>.txt "
                f"with a slice in {TEXT_SLICES}"
            )
        passages.append(HeldOutPassage(slice_name, name, path.read_text("utf-8")))
    passages.sort(key=lambda p: (TEXT_SLICES.index(p.slice), p.name))
    return passages
