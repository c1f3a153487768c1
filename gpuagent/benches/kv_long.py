"""KV-cache quality on long held-out text: every served KV dtype against bf16 KV on
passages of at least 2048 tokens from outside the project, each scored whole
(issue 33 item 4).

The engine bench's quality table (`gpuagent.benches.engine`) scores the project's
own eval passages, cut at 512 tokens: text the layouts were chosen on, and short
enough that a window covers a good share of it. Here the passages are
`gpuagent/evaluate/heldout/` (English prose, code and Korean copied from licensed
files on disk, `SOURCES.md`), never cut: a passage shorter than MIN_TOKENS is an
error, not a shorter score. Each is scored as `kv_quality` scores the eval sets:
teacher-forced through the engine's paged cache, prefilled in the chunks the
server gives a lone prompt, exact KL over the vocabulary; every dtype runs in
lockstep with one bf16 reference, chunk by chunk (no passage's full distributions
are held). Printed per slice, overall, and over the positions >= 512 alone (where
a cut passage had none).

Bytes per token vs bf16 are counted at the measured length: quantized storage
and scales for every token, plus the window row and any static scales spread over
the shortest passage scored (not a fixed 2k sequence).

Layouts measured beside the served ones (`kv_alternatives`, simulated, not
served) are scored against the same bf16 reference with `--simulate NAME ...`.

    python -m gpuagent.benches.kv_long --model-dir var/models/smollm2-135m

The exit status is 0 when every served dtype meets its bar (TARGETS), else 1; a
simulated int4 variant (sim-int4*) is judged against int4's bar and printed, but
never sets it.

Measured on the shared 2-core CPU (SmolLM2-135M, float32 weights, 8 passages,
16588 positions, 12492 at >= 512; ~25-50 min a run there):

============  ================  ================  =========  ======
KV dtype      overall KLD/top1  pos>=512          bytes/tok  bar
============  ================  ================  =========  ======
fp8+w16       0.00153 / 98.06%  0.00163 / 98.00%  0.5078     PASS
int8          0.00032 / 99.09%  0.00033 / 99.16%  0.5156     PASS
int4+w18 v1   0.0170 / 93.75%   0.0185 / 93.49%   0.2744     FAIL
int4+w18 v2   0.0140 / 94.33%   0.0149 / 94.44%   0.2744     FAIL
============  ================  ================  =========  ======

(v1: the absmax int4 scale; v2: the least-squared-error scale,
`kernels.kv_quant`.)

int4 variants at int4's bytes, simulated (`kv_alternatives.int4_variant_layout`,
not served; the same 8 passages, 16588 positions, bytes with the float32 key means
counted as static scales are):

================  ================  ================  =========  ===========
layout            overall KLD/top1  pos>=512          bytes/tok  int4's bar
================  ================  ================  =========  ===========
sim-int4+w18      0.0138 / 94.19%   0.0147 / 94.20%   0.2744     FAIL
sim-int4+w17s1    0.0134 / 94.45%   0.0144 / 94.29%   0.2744     FAIL
sim-int4c+w17s1   0.0072 / 95.97%   0.0076 / 96.01%   0.2748     FAIL (top-1)
sim-int4gc+w17s1  0.0061 / 96.23%   0.0065 / 96.19%   0.2748     PASS
================  ================  ================  =========  ===========

    python -m gpuagent.benches.kv_long --dtypes --simulate sim-int4+w18 \
        sim-int4+w17s1 sim-int4c+w17s1 sim-int4gc+w17s1

(measured as two runs of two layouts each, ~35 min apiece on the shared CPU; the
first row is the served int4 v2 simulated: 0.0138 / 94.19% vs the engine's 0.0140 /
94.33%.) c: keys stored less their layer's RoPE'd key mean, g: Gaussian
(Lloyd-Max) levels, s1: the first position in bf16 in place of the window's 18th
token. The first 3 passages (one per slice, `--max-per-slice 1`) without the bf16
first position: sim-int4gc+w18 0.0071 / 95.38%, sim-int4c+w18 0.0078 / 95.13%, where
sim-int4gc+w17s1 reads ~0.0060 / ~96.0% (from its per-passage lines): the sink's
bf16 copy is worth ~0.6 points of top-1. Only g+c+s1 clears the bar, by 0.2 points
of top-1 (about 1.5 standard errors of a binomial over these positions, less for
correlated ones); none of the three is served yet (with centered keys the first
position's bf16 copy pays, where without them it did not; below).

Served: int4c (`gpuagent.engine.kv_int4c`, kv dtype "int4c") is sim-int4gc+w17s1
as the engine serves it (torch path; no kernel yet). The first 3 passages (one per
slice), side by side in one run:

============  ================  ================  =========  ======
KV dtype      overall KLD/top1  pos>=512          bytes/tok  bar
============  ================  ================  =========  ======
int4+w18 v2   0.0137 / 93.81%   0.0142 / 93.94%   0.2744     FAIL
int4c+w18     0.0059 / 96.27%   0.0060 / 96.28%   0.2748     PASS
============  ================  ================  =========  ======

    python -m gpuagent.benches.kv_long --dtypes int4 int4c --max-per-slice 1

All 8 passages (16588 positions, 12492 at >= 512; `--dtypes int4c`, 520 s on the
shared CPU): int4c+w18 0.0061 / 96.33% overall, 0.0065 / 96.41% at pos>=512, 0.2748
of bf16: PASS, where its simulation read 0.0061 / 96.23% and 0.0065 / 96.19% (the
served int4 v2 above: 0.0140 / 94.33%). By slice: English 0.0048 / 96.73%, code
0.0077 / 95.90%, Korean 0.0058 / 96.40%: code alone stays under 96% top-1.

Leads measured and not taken before: attention sinks (the first tokens in bf16,
`kv_alternatives.sink_int4_layout`) at equal bytes, simulated on one English passage
with the v1 writer: w18 0.0134 / 94.42%, w17+s1 0.0139 / 94.76%, w14+s4 0.0194 /
94.66%: the newest tokens are worth more than the first. KIVI (keys per channel)
cannot fit 0.28 at head_dim 64: its key minima and scales over G tokens and a
residual of at least G tokens cost 0.31 at G 64 over 2061 tokens. The rotation
already spans the whole head (64); a rotation across kv heads would not preserve
each head's q.k. On one code passage (textwrap, v2 writer, simulated): w18 0.0154 /
94.43%, w22 0.0139 / 94.77% (a longer window pays, but the capacity bar, >= 3.6x
bf16's 2k-token sequences with a row reserved per max_num_seqs, allows <= 19), and a
finer, wider scale grid (1 .. 0.6 of absmax in steps of 0.025) 0.0160 / 93.80%:
least squared error per vector is not least KLD once it clips much.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuagent.benches.kv_alternatives import (
    Layout,
    key_means,
    layout_logprobs,
    named_layout,
)
from gpuagent.engine.cache import kv_bytes_per_token, kv_sequence_extra_bytes
from gpuagent.engine.engine import default_kv_window
from gpuagent.engine.kv_calibration import calibration_sequences
from gpuagent.evaluate.evalsets import (
    TEXT_SLICES,
    HeldOutPassage,
    load_heldout_passages,
)
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.metrics import PositionStats, slice_quality
from gpuagent.evaluate.regression import exact_position_stats
from gpuagent.protocol import SliceQuality

DEFAULT_MODEL_DIR = Path("var/models/smollm2-135m")
MIN_TOKENS = 2048
# Positions from which the tail is scored apart (where a 512-token cut stopped).
TAIL_FROM = 512
DTYPES = ("fp8", "int8", "int4")
# (mean KLD, same top-1, bytes/token vs bf16) each dtype must reach on this text:
# int4's is issue 33's, fp8's and int8's are issue 12's quality bars and the
# engine bench's memory targets.
TARGETS = {
    "fp8": (0.003, 0.97, 0.52),
    "int8": (0.002, 0.975, 0.52),
    "int4": (0.01, 0.96, 0.28),
    "int4c": (0.01, 0.96, 0.28),  # int4's layout variant (engine.kv_int4c)
}


def measured_bytes_ratio(config, kv_dtype: str, window: int, num_tokens: int) -> float:
    """KV bytes/token of `kv_dtype` with a `window`-token bf16 row vs bf16 KV, the
    row and the static scales spread over a `num_tokens`-token sequence."""
    extra = kv_sequence_extra_bytes(config, kv_dtype, window)
    per_token = kv_bytes_per_token(config, kv_dtype) + extra / num_tokens
    return per_token / kv_bytes_per_token(config, "bf16")


def tail_stats(stats: PositionStats, start: int) -> PositionStats:
    """The positions of one scored sequence from query position `start` on (stats
    row i is the query at position i predicting token i + 1)."""
    return PositionStats(
        stats.kld[start:],
        stats.same_top1[start:],
        stats.logprob_candidate[start:],
        stats.logprob_reference[start:],
    )


@dataclass
class LongQuality:
    """One KV dtype (or simulated layout) vs bf16 KV on the held-out passages."""

    name: str
    bytes_ratio: float
    slices: list[SliceQuality]  # per slice, then "overall", then the tail's
    tail_from: int = TAIL_FROM

    def get(self, name: str) -> SliceQuality:
        return next(s for s in self.slices if s.name == name)

    @property
    def tail(self) -> SliceQuality:
        """The positions >= tail_from of every passage."""
        return self.get(f"pos>={self.tail_from}")


def score_passages(
    model_dir: Path,
    model,
    kv_dtypes: Sequence[str],
    layouts: Sequence[Layout] = (),
    max_per_slice: int | None = None,
    progress=print,
    passages: Sequence[HeldOutPassage] | None = None,
    min_tokens: int | None = None,
) -> tuple[dict[str, dict[str, list[PositionStats]]], list[int]]:
    """Per dtype or layout name, per slice: the PositionStats of each passage
    (default: the held-out ones) vs bf16 KV; and the passages' token counts. A
    passage under `min_tokens` (default MIN_TOKENS) is refused."""
    min_tokens = MIN_TOKENS if min_tokens is None else min_tokens
    passages = list(load_heldout_passages() if passages is None else passages)
    if max_per_slice is not None:
        passages = [
            p
            for s in TEXT_SLICES
            for p in [q for q in passages if q.slice == s][:max_per_slice]
        ]
    probe = EngineModel(model_dir, "bf16", max_tokens=16, model=model)
    encoded = [probe.encode(p.text) for p in passages]
    means = None
    if any(layout.center_keys for layout in layouts):
        # the engine's calibration text, none of the scored passages
        means = key_means(model, calibration_sequences(probe.engine.tokenizer))
    del probe
    for passage, ids in zip(passages, encoded, strict=True):
        if len(ids) < min_tokens:
            raise ValueError(
                f"held-out passage {passage.slice}-{passage.name} is {len(ids)} "
                f"tokens, under the {min_tokens} the bench scores whole"
            )
    longest = max(len(ids) for ids in encoded)
    reference = EngineModel(model_dir, "bf16", max_tokens=longest, model=model)
    sides = {
        d: EngineModel(model_dir, d, max_tokens=longest, model=model) for d in kv_dtypes
    }
    names = [*kv_dtypes, *(layout.name for layout in layouts)]
    stats: dict[str, dict[str, list[PositionStats]]] = {
        name: {s: [] for s in TEXT_SLICES} for name in names
    }
    for passage, ids in zip(passages, encoded, strict=True):
        started = time.perf_counter()
        ref_chunks = reference.logprobs_chunks(ids)
        cand_chunks = [side.logprobs_chunks(ids) for side in sides.values()]
        parts: dict[str, list[PositionStats]] = {d: [] for d in kv_dtypes}
        kept = []  # the reference's chunks, where layouts are scored against them
        start = 1
        for ref, *cands in zip(ref_chunks, *cand_chunks, strict=True):
            if layouts:
                kept.append(ref)
            for dtype, cand in zip(kv_dtypes, cands, strict=True):
                parts[dtype].append(
                    exact_position_stats([ref], [cand], ids[start - 1 :])
                )
            start += ref.shape[0]
        for dtype in kv_dtypes:
            stats[dtype][passage.slice].append(PositionStats.concat(parts[dtype]))
        if layouts:
            ref_full = torch.cat(kept)
            for layout in layouts:
                cand = layout_logprobs(model, ids, layout, means)
                stats[layout.name][passage.slice].append(
                    exact_position_stats([ref_full], [cand], ids)
                )
                del cand
            del ref_full
        scores = ", ".join(
            f"{name} {per[passage.slice][-1].kld.mean():.5f}/"
            f"{100 * per[passage.slice][-1].same_top1.mean():.1f}%"
            for name, per in stats.items()
        )
        progress(
            f"  scored {passage.slice}-{passage.name}: {len(ids)} tokens, "
            f"KLD/top-1 {scores} ({time.perf_counter() - started:.0f} s)"
        )
    return stats, [len(ids) for ids in encoded]


def long_quality(
    config,
    stats: dict[str, dict[str, list[PositionStats]]],
    num_tokens: int,
    layouts: Sequence[Layout] = (),
    seed: int = 0,
    tail_from: int | None = None,
) -> list[LongQuality]:
    """Per-slice, overall and tail (positions >= `tail_from`) quality of each
    scored name, with its bytes ratio at `num_tokens` (the shortest passage);
    `tail_from` defaults to TAIL_FROM."""
    tail_from = TAIL_FROM if tail_from is None else tail_from
    rng = np.random.default_rng(seed)
    by_name = {layout.name: layout for layout in layouts}
    results = []
    for name, per_slice in stats.items():
        slices = [
            slice_quality(s, per_slice[s], [], rng) for s in TEXT_SLICES if per_slice[s]
        ]
        every = [x for s in TEXT_SLICES for x in per_slice[s]]
        slices.append(slice_quality("overall", every, [], rng))
        tails = [tail_stats(x, tail_from) for x in every]
        slices.append(slice_quality(f"pos>={tail_from}", tails, [], rng))
        if name in by_name:
            ratio = by_name[name].bytes_ratio(config, num_tokens)
        else:
            ratio = measured_bytes_ratio(
                config, name, default_kv_window(name), num_tokens
            )
        results.append(LongQuality(name, ratio, slices, tail_from))
    return results


def bar(name: str) -> tuple[float, float, float] | None:
    """The (mean KLD, top-1, bytes ratio) bar `name` is judged against: a served
    dtype's own, int4's for a simulated int4 variant (sim-int4*: judged and printed,
    never part of the exit status), else None."""
    if name in TARGETS:
        return TARGETS[name]
    return TARGETS["int4"] if name.startswith("sim-int4") else None


def verdict(result: LongQuality) -> bool | None:
    """Whether `result` meets its bar (`bar`), overall and at positions >= 512
    (None: no bar)."""
    if (target := bar(result.name)) is None:
        return None
    kld, top1, ratio = target
    return result.bytes_ratio <= ratio and all(
        q.mean_kld <= kld and q.same_top1 >= top1
        for q in (result.get("overall"), result.tail)
    )


def table(results: Sequence[LongQuality]) -> list[str]:
    """One line per dtype and slice, then one verdict line per judged dtype."""
    lines = [
        f"{'KV dtype':<22} {'slice':<9} {'tokens':>6} {'mean KLD':>10} "
        f"{'top-1':>8} {'bytes/tok':>9}"
    ]
    for result in results:
        window = default_kv_window(result.name)
        label = result.name + (f"+w{window}" if window else "")
        for q in result.slices:
            lines.append(
                f"{label:<22} {q.name:<9} {q.num_tokens:>6} {q.mean_kld:>10.6f} "
                f"{100 * q.same_top1:>7.2f}% {result.bytes_ratio:>9.4f}"
            )
    for result in results:
        ok = verdict(result)
        if ok is None:
            continue
        kld, top1, ratio = bar(result.name)
        served = "" if result.name in TARGETS else " (simulated, int4's bar)"
        lines.append(
            f"{result.name}{served}: mean KLD <= {kld}, top-1 >= {100 * top1:g}% "
            f"(overall and pos>={result.tail_from}), bytes <= {ratio} of bf16: "
            f"{'PASS' if ok else 'FAIL'}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the bench; 0 when every judged dtype meets its bar, else 1."""
    from gpuagent.engine.loader import load_model

    parser = argparse.ArgumentParser(prog="python -m gpuagent.benches.kv_long")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--dtypes",
        nargs="*",
        default=list(DTYPES),
        help="served KV dtypes to score (none: the simulated layouts alone)",
    )
    parser.add_argument(
        "--simulate",
        nargs="*",
        default=[],
        help="kv_alternatives layouts to score beside them (e.g. kivi-g32r32)",
    )
    parser.add_argument(
        "--max-per-slice", type=int, default=None, help="fewer passages (a sweep)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (args.model_dir / "config.json").exists():
        parser.error(f"{args.model_dir} holds no model (config.json)")
    model = load_model(args.model_dir, dtype=torch.float32)
    layouts = [named_layout(name) for name in args.simulate]
    started = time.perf_counter()
    print(
        f"KV quality vs bf16 KV on held-out passages, scored whole "
        f"(model {args.model_dir.name}; gpuagent/evaluate/heldout/)"
    )
    stats, lengths = score_passages(
        args.model_dir, model, args.dtypes, layouts, args.max_per_slice
    )
    shortest = min(lengths)
    print(
        f"{len(lengths)} passages, {min(lengths)}-{max(lengths)} tokens; bytes/token "
        f"with the window spread over {shortest} tokens (the shortest)"
    )
    results = long_quality(model.config, stats, shortest, layouts)
    for line in table(results):
        print(line)
    print(f"({time.perf_counter() - started:.0f} s)")
    served = [r for r in results if r.name in TARGETS]
    return 0 if all(verdict(r) is not False for r in served) else 1


if __name__ == "__main__":
    raise SystemExit(main())
