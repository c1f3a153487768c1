"""The package's public surface, and that importing it never pulls in torch
(the control plane imports it)."""

import subprocess
import sys

import gpuagent.integrity as integrity


def test_it_imports_without_torch():
    code = (
        "import sys, gpuagent.integrity, gpuagent.integrity.__main__, "
        "gpuagent.benches.integrity; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('torch', 'triton', 'django')))"
    )

    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_it_exports_every_error_as_an_integrity_error():
    errors = [getattr(integrity, n) for n in integrity.__all__ if n.endswith("Error")]

    assert len(errors) >= 10
    assert all(issubclass(e, integrity.IntegrityError) for e in errors)
