"""A side scored now and replayed later: for a reference whose server must stop
before the candidate's can start (memory for one at a time). `Recording` wraps a
live side and keeps every answer; evaluating it against itself
(`evaluate_quality(rec, rec, settings)`) asks exactly what a later evaluation
against it will ask, each question once. `Replay` then answers from what was kept
and refuses, by name, anything it was not asked before."""

from __future__ import annotations

from typing import Any

from gpuagent.evaluate.metrics import TopN


class Recording:
    """`side` (a `regression.Side`) with every answer kept."""

    def __init__(self, side: Any) -> None:
        self.side = side
        self.label: str = side.label
        self.max_model_len: int = side.max_model_len
        self.encoded: dict[str, list[int]] = {}
        self.tops: dict[tuple[tuple[int, ...], int], list[TopN]] = {}
        self.greedies: dict[tuple[tuple[int, ...], int], tuple[Any, str]] = {}

    def encode(self, text: str) -> list[int]:
        if text not in self.encoded:
            self.encoded[text] = self.side.encode(text)
        return list(self.encoded[text])

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def top_n(self, ids: list[int], n: int) -> list[TopN]:
        key = (tuple(ids), n)
        if key not in self.tops:
            self.tops[key] = self.side.top_n(ids, n)
        return self.tops[key]

    def greedy(self, ids: list[int], max_tokens: int) -> tuple[Any, str]:
        key = (tuple(ids), max_tokens)
        if key not in self.greedies:
            self.greedies[key] = self.side.greedy(ids, max_tokens)
        return self.greedies[key]

    def replay(self) -> Replay:
        """The kept answers, as a side that needs no server."""
        return Replay(self)


class Replay:
    """A recorded side's answers; ValueError for a question it wasn't asked."""

    def __init__(self, recording: Recording) -> None:
        self.label = recording.label
        self.max_model_len = recording.max_model_len
        self._recording = recording

    def encode(self, text: str) -> list[int]:
        try:
            return list(self._recording.encoded[text])
        except KeyError:
            raise ValueError(
                f"{self.label} was not asked to encode {text[:40]!r}... while it "
                "was served"
            ) from None

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def top_n(self, ids: list[int], n: int) -> list[TopN]:
        try:
            return self._recording.tops[(tuple(ids), n)]
        except KeyError:
            raise ValueError(
                f"{self.label} did not score this {len(ids)}-token sequence at "
                f"top-{n} while it was served (the candidate asked other positions: "
                "a shorter max_model_len?)"
            ) from None

    def greedy(self, ids: list[int], max_tokens: int) -> tuple[Any, str]:
        try:
            return self._recording.greedies[(tuple(ids), max_tokens)]
        except KeyError:
            raise ValueError(
                f"{self.label} did not continue this {len(ids)}-token prompt for "
                f"{max_tokens} tokens while it was served"
            ) from None
