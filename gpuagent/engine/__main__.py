"""`python -m gpuagent.engine serve MODEL_DIR --kv-cache-dtype int8 --kv-memory-gb 2
--port 8100 [--host 127.0.0.1] [--block-size 16] [--manifest-digest D --signature S]`.

With `--manifest-digest`, every file is read through
`gpuagent.integrity.read_verified_files` (which hashes exactly the bytes it returns) and
the model and tokenizer are built from those bytes only: verify-on-load.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from gpuagent.engine.engine import AsyncLLMEngine, LLMEngine


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    parser = argparse.ArgumentParser(prog="python -m gpuagent.engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model folder over HTTP")
    serve.add_argument("model_dir", type=Path)
    serve.add_argument(
        "--kv-cache-dtype",
        default="bf16",
        choices=("bf16", "fp16", "fp8", "int8", "int4"),
    )
    serve.add_argument("--kv-memory-gb", type=float, default=2.0)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=512)
    serve.add_argument("--max-model-len", type=int, default=None)
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
    serve.add_argument("--log-level", default="info")
    return parser


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """Load (and verify, when a digest is given) the model and size the KV pool."""
    from gpuagent.engine.loader import load_model
    from gpuagent.engine.tokenizer import load_tokenizer

    if args.signature is not None and args.manifest_digest is None:
        raise SystemExit("--signature needs --manifest-digest")
    dtype_name = args.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if str(args.device).startswith("cuda") else "float32"
    dtype = getattr(torch, dtype_name)
    if args.manifest_digest is not None:
        from gpuagent.integrity import read_verified_files

        files = read_verified_files(
            args.model_dir, args.manifest_digest, signature_path=args.signature
        )
        model = load_model(args.model_dir, dtype=dtype, device=args.device, files=files)
        tokenizer = load_tokenizer(args.model_dir, files=files)
    else:
        model = load_model(args.model_dir, dtype=dtype, device=args.device)
        tokenizer = load_tokenizer(args.model_dir)
    return LLMEngine(
        model,
        tokenizer,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_memory_bytes=int(args.kv_memory_gb * 2**30),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m gpuagent.engine`."""
    import uvicorn

    from gpuagent.engine.server import build_app

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    engine = build_engine(args)
    name = args.served_model_name or args.model_dir.resolve().name
    logging.getLogger(__name__).info(
        "serving %s: kv %s, %d blocks x %d tokens, %d bytes/token",
        name,
        engine.kv.kv_dtype,
        engine.kv.num_blocks,
        engine.kv.block_size,
        engine.kv.bytes_per_token,
    )
    app = build_app(AsyncLLMEngine(engine), name)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
