"""`python -m gpuagent.integrity`: exit codes and reports."""

import json
import subprocess
import sys

import pytest

from gpuagent.integrity import ReleaseBinding, hash_model, sign_model
from gpuagent.integrity.__main__ import EXIT_OK, EXIT_REJECTED, EXIT_USAGE, main
from tests.gpuagent.integrity.builders import RELEASE, write_model

RELEASE_ARGS = [
    "--model",
    RELEASE.model,
    "--version",
    RELEASE.version,
    "--recipe",
    RELEASE.recipe,
]


def sign_args(folder, keys):
    return [
        "sign",
        str(folder),
        "--signature",
        str(folder / "model.sig"),
        "--private-key",
        str(keys.private),
        *RELEASE_ARGS,
    ]


def verify_args(folder, keys, *extra):
    return [
        "verify",
        str(folder),
        "--signature",
        str(folder / "model.sig"),
        "--public-key",
        str(keys.public),
        *extra,
    ]


def test_it_inspects_with_exit_codes_and_a_json_report(tmp_path, capsys):
    folder = write_model(tmp_path / "model")

    assert main(["inspect", str(folder)]) == EXIT_OK
    assert "OK" in capsys.readouterr().out
    (folder / "evil.py").write_text("")
    assert main(["inspect", str(folder), "--json"]) == EXIT_REJECTED
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    bad = [f for f in report["report"]["files"] if f["verdict"] == "rejected"]
    assert bad == [
        {
            "path": "evil.py",
            "kind": "file",
            "verdict": "rejected",
            "reasons": [
                {"code": "python-file", "detail": bad[0]["reasons"][0]["detail"]}
            ],
        }
    ]


def test_it_hashes_like_the_library(tmp_path, capsys):
    folder = write_model(tmp_path / "model")
    out = tmp_path / "manifest.json"

    assert (
        main(
            [
                "hash",
                str(folder),
                "--algorithm",
                "blake3",
                "--json",
                "--output",
                str(out),
            ]
        )
        == EXIT_OK
    )

    printed = json.loads(capsys.readouterr().out)
    assert printed["digest"] == hash_model(folder, "blake3").digest
    assert json.loads(out.read_text())["digest"] == printed["digest"]


def test_it_signs_verifies_and_rejects_tampering(tmp_path, keys, capsys):
    folder = write_model(tmp_path / "model")
    assert main(sign_args(folder, keys)) == EXIT_OK
    digest = hash_model(folder, ignore_paths=("model.sig",)).digest

    assert (
        main(verify_args(folder, keys, *RELEASE_ARGS, "--manifest-digest", digest)) == 0
    )
    assert digest in capsys.readouterr().out
    assert (
        main(
            verify_args(
                folder,
                keys,
                "--model",
                "x",
                "--version",
                "2",
                "--recipe",
                RELEASE.recipe,
            )
        )
        == EXIT_REJECTED
    )
    assert "binding-mismatch" in capsys.readouterr().err
    (folder / "config.json").write_text("{}")
    assert main(verify_args(folder, keys, *RELEASE_ARGS, "--json")) == EXIT_REJECTED
    error = json.loads(capsys.readouterr().out)
    assert error["error"] == "manifest-mismatch" and error["changed"] == ["config.json"]


def test_it_exits_with_the_usage_code_on_bad_arguments(tmp_path, keys, capsys):
    folder = write_model(tmp_path / "model")

    assert main(["sign", str(folder)]) == EXIT_USAGE  # argparse's own error
    assert main(["verify", str(folder), "--signature", "x.sig"]) == EXIT_USAGE
    assert main(["hash", str(tmp_path / "missing")]) == EXIT_USAGE
    assert main(["inspect", str(tmp_path / "missing")]) == EXIT_USAGE
    assert main(verify_args(folder, keys, "--model", "only-model")) == EXIT_USAGE
    capsys.readouterr()


def test_it_runs_as_a_module(tmp_path):
    folder = write_model(tmp_path / "model")

    done = subprocess.run(
        [sys.executable, "-m", "gpuagent.integrity", "hash", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(hash_model(folder).digest)


# --- release binding is required -----------------------------------------------

REVOKED = ReleaseBinding(RELEASE.model, "0.9.0-revoked", "old-recipe", "")


@pytest.fixture
def revoked(tmp_path, keys):
    """A folder signed for a revoked release."""
    folder = write_model(tmp_path / "model")
    sign_model(folder, folder / "model.sig", release=REVOKED, private_key=keys.private)
    return folder


def test_verify_requires_the_release_flags(revoked, keys, capsys):
    assert main(verify_args(revoked, keys)) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    for flag in ("--model", "--version", "--recipe", "--any-release"):
        assert flag in captured.err

    assert main(verify_args(revoked, keys, "--model", RELEASE.model)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "missing --version, --recipe" in err and "missing --model" not in err


def test_verify_refuses_a_revoked_release_replayed_for_the_current_one(
    revoked, keys, capsys
):
    assert main(verify_args(revoked, keys, *RELEASE_ARGS)) == EXIT_REJECTED
    assert "binding-mismatch" in capsys.readouterr().err


def test_any_release_skips_the_binding_and_says_so(revoked, keys, capsys):
    assert main(verify_args(revoked, keys, "--any-release")) == EXIT_OK
    out = capsys.readouterr().out
    assert "NOT CHECKED" in out and "--any-release" in out
    assert "0.9.0-revoked" in out

    assert main(verify_args(revoked, keys, "--any-release", "--json")) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["binding_checked"] is False
    assert report["release"]["version"] == "0.9.0-revoked"

    assert main(verify_args(revoked, keys, *RELEASE_ARGS[:2], "--any-release")) == (
        EXIT_USAGE
    )
    assert "do not combine it with --model" in capsys.readouterr().err


def test_a_checked_binding_is_reported_as_checked(tmp_path, keys, capsys):
    folder = write_model(tmp_path / "model")
    assert main(sign_args(folder, keys)) == EXIT_OK
    capsys.readouterr()

    assert main(verify_args(folder, keys, *RELEASE_ARGS, "--json")) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["binding_checked"] is True


def test_the_any_release_help_says_it_skips_the_replay_protection(capsys):
    with pytest.raises(SystemExit) as info:
        main(["verify", "--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--any-release" in help_text
    assert "SKIPS the replay protection" in help_text


# --- stdout stays a report ---------------------------------------------------------


def test_verify_json_stays_parseable_when_the_library_prints(tmp_path, keys, capsys):
    # A blanked (unsigned) key hint makes model-signing print a WARNING to stdout.
    folder = write_model(tmp_path / "model")
    assert main(sign_args(folder, keys)) == EXIT_OK
    capsys.readouterr()
    sig = folder / "model.sig"
    bundle = json.loads(sig.read_text())
    bundle["verificationMaterial"]["publicKey"]["hint"] = ""
    sig.write_text(json.dumps(bundle))

    assert main(verify_args(folder, keys, *RELEASE_ARGS, "--json")) == EXIT_OK
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is True
    assert "WARNING" in captured.err


# --- password-protected keys -------------------------------------------------------


def test_it_signs_with_a_password_protected_key(tmp_path, capsys):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = tmp_path / "enc.pem", tmp_path / "enc.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"s3cret"),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )
    folder = write_model(tmp_path / "model")
    sign = ["sign", str(folder), "--signature", str(folder / "model.sig")]
    sign += ["--private-key", str(private), *RELEASE_ARGS]

    assert main([*sign, "--password", "wrong"]) == EXIT_REJECTED
    assert "bad password" in capsys.readouterr().err
    assert main([*sign, "--password", "s3cret"]) == EXIT_OK
    capsys.readouterr()
    verify = ["verify", str(folder), "--signature", str(folder / "model.sig")]
    assert main([*verify, "--public-key", str(public), *RELEASE_ARGS]) == EXIT_OK


@pytest.mark.parametrize(
    "failure",
    [MemoryError(), RuntimeError("boom")],
    ids=["memory-error", "crash"],
)
def test_it_answers_a_crash_with_a_json_report_not_a_traceback(
    tmp_path, capsys, monkeypatch, failure
):
    from gpuagent.integrity import __main__ as cli

    def crash(*args, **kwargs):
        raise failure

    monkeypatch.setattr(cli, "inspect_model", crash)
    folder = write_model(tmp_path / "model")

    assert main(["inspect", str(folder), "--json"]) == EXIT_REJECTED

    out = capsys.readouterr()
    report = json.loads(out.out)
    assert report["ok"] is False
    assert report["error"] == "internal-error"
    assert "Traceback" not in out.err


def test_it_answers_bad_usage_with_a_json_report(capsys):
    assert main(["verify", "--json", "/nonexistent"]) == EXIT_USAGE

    assert json.loads(capsys.readouterr().out)["error"] == "usage"
