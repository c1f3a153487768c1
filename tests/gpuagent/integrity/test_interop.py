"""Interop both ways with the upstream `model_signing` command-line tool."""

import subprocess
import sys
from pathlib import Path

import pytest

from gpuagent.integrity import (
    BindingMismatchError,
    ManifestMismatchError,
    SignatureError,
    sign_model,
    verify_model,
)
from tests.gpuagent.integrity.builders import RELEASE, CertificateAuthority, write_model

MODEL_SIGNING = Path(sys.executable).parent / "model_signing"


def upstream(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MODEL_SIGNING), *args], capture_output=True, text=True, timeout=60
    )


def test_it_produces_signatures_the_upstream_tool_verifies(tmp_path, keys):
    folder = write_model(tmp_path / "model", sharded=True)
    sig = folder / "model.sig"
    sign_model(folder, sig, release=RELEASE, private_key=keys.private)

    ok = upstream(
        "verify",
        "key",
        str(folder),
        "--signature",
        str(sig),
        "--public_key",
        str(keys.public),
    )
    (folder / "tokenizer.json").write_text("{}")
    tampered = upstream(
        "verify",
        "key",
        str(folder),
        "--signature",
        str(sig),
        "--public_key",
        str(keys.public),
    )

    assert ok.returncode == 0, ok.stderr
    assert "Verification succeeded" in ok.stdout
    assert tampered.returncode != 0


def test_it_verifies_signatures_made_by_the_upstream_tool(tmp_path, keys):
    folder = write_model(tmp_path / "model", sharded=True)
    sig = folder / "model.sig"
    made = upstream(
        "sign",
        "key",
        str(folder),
        "--signature",
        str(sig),
        "--private_key",
        str(keys.private),
    )
    assert made.returncode == 0, made.stderr

    # A publisher's signature carries no release binding: accepted only when
    # the policy does not demand one.
    report = verify_model(folder, sig, keys.policy(release=None))

    assert report.ok and report.release is None
    with pytest.raises(BindingMismatchError, match="not bound"):
        verify_model(folder, sig, keys.policy())
    (folder / "extra.txt").write_text("x")
    with pytest.raises(ManifestMismatchError) as info:
        verify_model(folder, sig, keys.policy(release=None))
    assert info.value.extra == ["extra.txt"]


def upstream_verify_certificate(folder: Path, chain: Path):
    return upstream(
        "verify",
        "certificate",
        str(folder),
        "--signature",
        str(folder / "model.sig"),
        "--certificate_chain",
        str(chain),
    )


def test_certificate_signatures_verify_both_ways(tmp_path):
    ca = CertificateAuthority(tmp_path, "releases", "ci@releasegate.example")
    ours = write_model(tmp_path / "ours", sharded=True)
    ca.sign(ours)
    theirs = write_model(tmp_path / "theirs", sharded=True)
    made = upstream(
        "sign",
        "certificate",
        str(theirs),
        "--signature",
        str(theirs / "model.sig"),
        "--private_key",
        str(ca.private),
        "--signing_certificate",
        str(ca.certificate),
        "--certificate_chain",
        str(ca.chain),
    )
    assert made.returncode == 0, made.stderr

    checked = upstream_verify_certificate(ours, ca.chain)
    report = verify_model(theirs, theirs / "model.sig", ca.policy(release=None))

    assert checked.returncode == 0, checked.stderr
    assert "Verification succeeded" in checked.stdout
    assert (
        report.ok
        and report.signer == "certificate ci@releasegate.example by releases CA"
    )
    # Each side still refuses the other's chain of trust.
    rogue = CertificateAuthority(tmp_path, "rogue", "ci@releasegate.example")
    refused = upstream_verify_certificate(ours, rogue.chain)
    assert refused.returncode != 0
    with pytest.raises(SignatureError):
        verify_model(theirs, theirs / "model.sig", rogue.policy(release=None))
