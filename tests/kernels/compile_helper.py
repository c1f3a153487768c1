"""Lower one op's kernels through Triton's real compiler for sm_90, on a CPU.

The interpreter accepts Python the real compiler rejects, so each op's tests also run
`kernels.compile_check` in a subprocess with TRITON_INTERPRET unset."""

import os
import subprocess
import sys
from pathlib import Path


def compile_for_sm90(op: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "kernels.compile_check", op],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
