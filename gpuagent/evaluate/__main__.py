"""`python -m gpuagent.evaluate --candidate URL|DIR --reference URL|DIR
[--kv-cache-dtype int8] [--reference-kv-cache-dtype bf16] [--seed 0] [--top-n 20]
[--slices english,code,korean,long_context] [--long-context-tokens N]
[--passage-tokens N] [--continuation-tokens N] [--max-items N] [--threads N]
[--json OUT]`

Prints one row per slice (and overall), then for a MoE candidate one row per MoE
layer (router agreement, expert-load shift) and the worst layer, and writes the
QualityReport as JSON. A side
given as a folder is loaded by the project's engine with its own KV dtype
(`--kv-cache-dtype` for the candidate; the reference defaults to bf16, the
uncompressed parent's); a side given as http(s)://... is scored over the
OpenAI-compatible API, and then KL is the top-N estimate (with its bucketed lower
bound and the reference's tail mass beside it). Exit status 1 with the reason on
stderr when a side can't be loaded or reached.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gpuagent.evaluate.evalsets import LONG_CONTEXT, TEXT_SLICES
from gpuagent.evaluate.inprocess import EngineModel
from gpuagent.evaluate.regression import (
    DEFAULT_CONTINUATION_TOKENS,
    DEFAULT_PASSAGE_TOKENS,
    DEFAULT_TOP_N,
    Settings,
    Side,
    evaluate_quality,
)
from gpuagent.evaluate.remote import Endpoint, EndpointError
from gpuagent.protocol import KV_CACHE_DTYPES, QualityReport, RoutingReport

ALL_SLICES = (*TEXT_SLICES, LONG_CONTEXT)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(prog="python -m gpuagent.evaluate")
    parser.add_argument("--candidate", required=True, help="URL or model folder")
    parser.add_argument("--reference", required=True, help="URL or model folder")
    parser.add_argument(
        "--kv-cache-dtype",
        default="bf16",
        choices=(*KV_CACHE_DTYPES, "fp32"),
        help="the candidate's KV cache, when it is a folder",
    )
    parser.add_argument(
        "--reference-kv-cache-dtype", default="bf16", choices=(*KV_CACHE_DTYPES, "fp32")
    )
    parser.add_argument("--candidate-model", help="model name at the candidate URL")
    parser.add_argument("--reference-model", help="model name at the reference URL")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top-n", type=int, default=DEFAULT_TOP_N)
    parser.add_argument(
        "--slices",
        default=",".join(ALL_SLICES),
        help="comma-separated, of " + ", ".join(ALL_SLICES),
    )
    parser.add_argument(
        "--long-context-tokens",
        type=int,
        default=None,
        help="length of the long-context prompts (default: the longest both hold)",
    )
    parser.add_argument("--passage-tokens", type=int, default=DEFAULT_PASSAGE_TOKENS)
    parser.add_argument(
        "--continuation-tokens", type=int, default=DEFAULT_CONTINUATION_TOKENS
    )
    parser.add_argument(
        "--max-items", type=int, help="passages and prompts per slice (default: all)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for in-process scoring (default: torch's; on a shared "
        "CPU, 1 avoids threads spinning against each other)",
    )
    parser.add_argument("--json", type=Path, help="write the QualityReport here")
    return parser


def open_side(
    where: str, kv_cache_dtype: str, model: str | None, max_tokens: int | None
) -> Side:
    """An endpoint for a URL, else a model folder in-process."""
    if where.startswith(("http://", "https://")):
        return Endpoint(where, model)
    if not Path(where).is_dir():
        raise SystemExit(f"error: {where} is neither a URL nor a model folder")
    return EngineModel(where, kv_cache_dtype, max_tokens=max_tokens)


def render(report: QualityReport) -> str:
    """The report as a table, one row per slice."""
    top_n = report.method == "http_top_n"
    header = (
        f"{'slice':<13}{'tokens':>7}{'mean KLD':>11}{'95% CI':>21}{'p99':>9}"
        f"{'max':>8}{'top-1':>8}{'ppl ratio':>10}{'exact':>7}{'flips':>6}"
        + (f"{'KLD lower':>11}{'tail mass':>10}" if top_n else "")
        + "  retrieval"
    )
    lines = [
        f"candidate {report.candidate} vs reference {report.reference} "
        f"({report.method}{f', top-{report.top_n}' if report.top_n else ''}, "
        f"seed {report.seed})",
        header,
    ]
    for s in report.slices:
        ci = s.mean_kld_ci95
        ci_text = f"[{ci.low:.5f}, {ci.high:.5f}]" if ci else "-"
        retrieval = (
            ""
            if s.retrieval_ok is None
            else (
                f"{'ok' if s.retrieval_ok else 'MISSED'} (reference "
                f"{'ok' if s.reference_retrieval_ok else 'missed'})"
            )
        )
        bound = (
            f"{s.mean_kld_lower or 0:>11.5f}{s.tail_mass_mean or 0:>10.4f}"
            if top_n
            else ""
        )
        lines.append(
            f"{s.name:<13}{s.num_tokens:>7}{s.mean_kld:>11.5f}{ci_text:>21}"
            f"{s.p99_kld:>9.4f}{s.max_kld:>8.3f}{100 * s.same_top1:>7.2f}%"
            f"{s.ppl_ratio:>10.4f}{100 * s.exact_match:>6.0f}%{s.flips:>6}{bound}"
            f"  {retrieval}"
        )
    return "\n".join(lines + render_routing(report.routing))


def render_routing(routing: RoutingReport | None) -> list[str]:
    """The MoE regression: one row per MoE layer and the worst layer's numbers."""
    if routing is None:
        return ["routing: not reported"]
    if routing.status != "measured":
        return [f"routing: {routing.status.replace('_', ' ')} ({routing.reason})"]
    lines = [
        f"routing: top-{routing.top_k} of {routing.num_experts} experts, "
        "candidate vs reference on the same tokens",
        f"{'layer':<7}{'tokens':>8}{'agreement':>11}{'jaccard':>9}"
        f"{'load shift':>12}{'max load change':>17}",
    ]
    for e in routing.layers:
        lines.append(
            f"{e.layer:<7}{e.num_tokens:>8}{100 * e.router_agreement:>10.2f}%"
            f"{e.mean_jaccard:>9.4f}{e.load_shift:>12.4f}"
            f"{e.max_load_change:>9.3f} (e{e.max_load_change_expert})"
        )
    lines.append(
        f"worst: agreement {100 * routing.min_router_agreement:.2f}% (layer "
        f"{routing.worst_agreement_layer}), load shift {routing.max_load_shift:.4f} "
        f"(layer {routing.worst_load_shift_layer}), max load change "
        f"{routing.max_load_change:.3f}"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> QualityReport:
    """Entry point of `python -m gpuagent.evaluate`."""
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    slices = [s for s in args.slices.split(",") if s]
    unknown = sorted(set(slices) - set(ALL_SLICES))
    if unknown:
        raise SystemExit(f"error: unknown slices {unknown}; known: {ALL_SLICES}")
    try:
        candidate = open_side(
            args.candidate,
            args.kv_cache_dtype,
            args.candidate_model,
            args.long_context_tokens,
        )
        reference = open_side(
            args.reference,
            args.reference_kv_cache_dtype,
            args.reference_model,
            args.long_context_tokens,
        )
        report = evaluate_quality(
            candidate,
            reference,
            Settings(
                seed=args.seed,
                top_n=args.top_n,
                continuation_tokens=args.continuation_tokens,
                passage_tokens=args.passage_tokens,
                long_context_tokens=args.long_context_tokens,
                slices=slices,
                max_items=args.max_items,
            ),
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (EndpointError, ValueError, OSError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(render(report))
    if args.json:
        args.json.write_text(report.model_dump_json(indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
