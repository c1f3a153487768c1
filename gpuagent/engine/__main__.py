"""`python -m gpuagent.engine serve MODEL_DIR --kv-cache-dtype int8 --kv-memory-gb 2
--port 8100 [--host 127.0.0.1] [--block-size 16] [--served-model-name NAME...]
[--threads N] [--default-max-tokens N] [--manifest-digest D
[--signature S --public-key PEM ...] [--release-model M --release-version V
--release-recipe R]]`.

With `--manifest-digest`, every file is read through
`gpuagent.integrity.read_verified_files` (which hashes exactly the bytes it returns) and
the model and tokenizer are built from those bytes only: verify-on-load. With
`--signature`, the signature must verify against a trust anchor (`--public-key`,
repeatable; or `--certificate-chain` / `--sigstore-trust-config` with `--identity` and
`--issuer`), sign exactly that manifest and be bound to the release named by
`--release-*` (required with `--signature`). Without `--manifest-digest` there is
nothing approved to compare with, so the folder is only inspected
(`gpuagent.integrity.read_inspected_files`: `inspect_model`, then the strict checks on
the bytes loaded) and a warning names its digest for pinning. A folder that fails any
check is refused: exit status 1, the reason on stderr; so is a tokenizer or chat
template that fails its probe (`gpuagent.engine.untrusted`).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from gpuagent.engine.engine import AsyncLLMEngine, LLMEngine
from gpuagent.engine.server import DEFAULT_MAX_TOKENS
from gpuagent.engine.weights import HEAD_FORMATS
from gpuagent.integrity import IntegrityError
from gpuagent.integrity.policy import Policy, policy_from_trust_args, release_from_flags
from kernels.kv_quant import KV_CACHE_DTYPES


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(prog="python -m gpuagent.engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model folder over HTTP")
    serve.add_argument("model_dir", type=Path)
    serve.add_argument(
        "--kv-cache-dtype",
        default="bf16",
        choices=KV_CACHE_DTYPES,
        help="fp8: calibrated (or the checkpoint's) static scales, rotated; "
        "fp8-per-token: per-token scales, for measurement; fp32 is a plain copy "
        "for float32 parity checks, not a serving format",
    )
    serve.add_argument(
        "--kv-window",
        type=int,
        default=None,
        help="newest tokens per sequence also kept in bf16 beside a quantized cache "
        "(default: 18 for int4, 16 for fp8, none for the others; int4c's 18 are "
        "its newest 17 and its first)",
    )
    serve.add_argument("--kv-memory-gb", type=float, default=2.0)
    serve.add_argument(
        "--memory-budget-bytes",
        type=int,
        default=None,
        help="the most this server's weights and KV pool may take on its device "
        "(the control plane's placement): the KV pool is cut to what the loaded "
        "weights leave of it, and the server refuses to start when they leave none",
    )
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) requests may use; answers carry the first (default: the model "
        "path as given, as vLLM does); /v1/models gives the folder's absolute path "
        "as each name's `root`, for tools that load the tokenizer",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op CPU threads of the engine (default: torch's, one per core)",
    )
    serve.add_argument(
        "--quantize-head",
        choices=HEAD_FORMATS,
        default=None,
        help="run the output head as its own quantized copy (faster decode of a "
        "small model, at a logits cost `python -m gpuagent.benches.engine` prints; "
        "default: the checkpoint's head; a release compressed with the recipe "
        "option head=int8 carries the int8 head already)",
    )
    serve.add_argument(
        "--int8-activations",
        action="store_true",
        help="round the int4 layers' activations to int8 per block of 32 at CPU "
        "decode, as llama.cpp does (faster, at a logits cost `python -m "
        "gpuagent.benches.llamacpp` prints; a float32 w4a16 model on a CPU only)",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="answer length of a request that gives no max_tokens",
    )
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=512)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the cached KV of earlier requests' full prompt blocks (vLLM's "
        "automatic prefix caching; on by default, --no-enable-prefix-caching: off)",
    )
    serve.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu"
    )
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights dtype; auto: bfloat16 on CUDA, float32 on CPU",
    )
    serve.add_argument("--manifest-digest", default=None)
    serve.add_argument("--signature", type=Path, default=None)
    trust = serve.add_argument_group(
        "signature trust (with --signature)",
        "who may have signed the model, and the release the signature must be for",
    )
    trust.add_argument(
        "--public-key",
        type=Path,
        action="append",
        default=[],
        help="trusted ECDSA public key, PEM (repeatable)",
    )
    trust.add_argument("--certificate-chain", type=Path, help="pinned chain, PEM")
    trust.add_argument("--sigstore-trust-config", type=Path, help="pinned config")
    trust.add_argument("--identity", help="certificate / sigstore signer identity")
    trust.add_argument("--issuer", help="certificate issuer / OIDC issuer")
    trust.add_argument("--release-model", help="model name the signature must bind")
    trust.add_argument("--release-version", help="release version it must bind")
    trust.add_argument("--release-recipe", help="release recipe it must bind")
    trust.add_argument("--release-parent-digest", default="")
    serve.add_argument("--log-level", default="info")
    return parser


def signature_policy(args: argparse.Namespace) -> Policy | None:
    """The policy `--signature` is verified against (None without a signature).

    Built by `gpuagent.integrity.policy.policy_from_trust_args`, as the integrity CLI's
    `verify` does. Bad flag combinations exit with a usage message.
    """
    if args.signature is None:
        trust_flags = (
            args.public_key,
            args.certificate_chain,
            args.sigstore_trust_config,
            args.release_model,
            args.release_version,
            args.release_recipe,
        )
        if any(trust_flags):  # they would check nothing: say so
            raise SystemExit("error: trust and release flags need --signature")
        return None
    try:
        release = release_from_flags(
            args.release_model,
            args.release_version,
            args.release_recipe,
            args.release_parent_digest,
        )
        if release is None:
            # The agent always knows which release it deploys; a signature checked
            # without that binding could be one replayed from another release.
            raise ValueError(
                "--signature needs the release it must be bound to: "
                "--release-model, --release-version and --release-recipe"
            )
        return policy_from_trust_args(args, release=release)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """Load (and verify, when a digest is given) the model and size the KV pool.

    Raises `gpuagent.integrity.IntegrityError` when the folder fails verification.
    """
    if args.signature is not None and args.manifest_digest is None:
        raise SystemExit("error: --signature needs --manifest-digest")
    policy = signature_policy(args)
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    from gpuagent.integrity import read_inspected_files, read_verified_files

    if args.manifest_digest is not None:
        files = read_verified_files(
            args.model_dir,
            args.manifest_digest,
            signature_path=args.signature,
            policy=policy,
        )
    else:
        # Nothing approved to compare with, but still nothing uninspected loaded.
        files, digest = read_inspected_files(args.model_dir, policy=policy)
        logging.getLogger(__name__).warning(
            "%s is not checked against an approved manifest (no --manifest-digest); "
            "inspected and loaded as %s: pass --manifest-digest %s to pin it",
            args.model_dir,
            digest,
            digest,
        )
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    model = load_model(
        args.model_dir,
        dtype=getattr(torch, dtype_name),
        device=args.device,
        files=files,
    )
    kv_memory_bytes = kv_pool_bytes(
        int(args.kv_memory_gb * 2**30), args.memory_budget_bytes, weight_bytes(model)
    )
    return LLMEngine(
        model,
        load_tokenizer(args.model_dir, files=files),
        kv_cache_dtype=args.kv_cache_dtype,
        kv_window=args.kv_window,
        kv_memory_bytes=kv_memory_bytes,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        quantize_head=args.quantize_head,
        int8_activations=args.int8_activations,
    )


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the loaded model's parameters and buffers take on its device."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_pool_bytes(kv_memory_bytes: int, budget_bytes: int | None, weights: int) -> int:
    """The KV pool a server sizes: `kv_memory_bytes`, cut to what `weights` leave
    of the placement's `budget_bytes` (None: no budget). ValueError when the
    weights leave nothing of the budget."""
    if budget_bytes is None:
        return kv_memory_bytes
    left = budget_bytes - weights
    if left <= 0:
        raise ValueError(
            f"the memory budget of {budget_bytes} bytes does not hold the loaded "
            f"weights ({weights} bytes) and a KV cache"
        )
    return min(kv_memory_bytes, left)


def served_model_names(args: argparse.Namespace) -> list[str]:
    """The names the server answers to: `--served-model-name`, else the model path
    exactly as given on the command line."""
    return list(args.served_model_name or [str(args.model_dir)])


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m gpuagent.engine`."""
    import uvicorn

    from gpuagent.engine.server import build_app

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit("error: --threads must be at least 1")
        torch.set_num_threads(args.threads)
    if args.default_max_tokens < 1:
        raise SystemExit("error: --default-max-tokens must be at least 1")
    try:
        engine = build_engine(args)
    except IntegrityError as e:
        # A refusal, not a crash: one line that says which check failed.
        raise SystemExit(
            f"error: refused to load {args.model_dir}: [{e.code}] {e}"
        ) from None
    except ValueError as e:  # an engine setting that can't work, e.g. no KV block
        raise SystemExit(f"error: {e}") from None
    names = served_model_names(args)
    logging.getLogger(__name__).info(
        "serving %s: kv %s, %d blocks x %d tokens, %d bytes/token, window %d, "
        "%d threads",
        names[0],
        engine.kv.kv_dtype,
        engine.kv.num_blocks,
        engine.kv.block_size,
        engine.kv.bytes_per_token,
        engine.kv.window,
        torch.get_num_threads(),
    )
    try:
        app = build_app(
            AsyncLLMEngine(engine),
            names,
            args.default_max_tokens,
            model_root=str(args.model_dir.absolute()),
        )
    except ValueError as e:  # e.g. a chat template that fails its probe
        raise SystemExit(f"error: refused to serve {args.model_dir}: {e}") from None
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
