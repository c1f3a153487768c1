"""`python -m gpuagent.integrity`: exit codes and reports."""

import json
import subprocess
import sys

import pytest

from gpuagent.integrity import hash_model
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
    assert main(verify_args(folder, keys, "--json")) == EXIT_REJECTED
    error = json.loads(capsys.readouterr().out)
    assert error["error"] == "manifest-mismatch" and error["changed"] == ["config.json"]


def test_it_exits_with_the_usage_code_on_bad_arguments(tmp_path, keys, capsys):
    folder = write_model(tmp_path / "model")

    with pytest.raises(SystemExit) as info:
        main(["sign", str(folder)])
    assert info.value.code == EXIT_USAGE
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
