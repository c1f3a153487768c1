"""`import triton` guarded so that `import kernels` works where triton is missing.

Where triton is absent the `@triton.jit` decorators become no-ops and every public
op runs its torch reference; asking for impl="triton" then raises a clear error.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is a declared dependency
    HAS_TRITON = False
    triton = SimpleNamespace(jit=lambda fn=None, **_: fn, cdiv=lambda a, b: -(-a // b))
    tl = SimpleNamespace(constexpr=int)

IMPLS = ("auto", "triton", "reference")


def use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    """Resolve `impl` for these tensors: Triton on CUDA, the reference elsewhere.

    impl="triton" on CPU tensors is allowed only under TRITON_INTERPRET=1 (tests),
    which must be set before `kernels` is imported.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "auto":
        return on_cuda and HAS_TRITON
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' requested but triton is not installed")
    if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
            "`kernels` is imported"
        )
    return True


def check(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless cond: launcher argument checks."""
    if not cond:
        raise ValueError(message)
