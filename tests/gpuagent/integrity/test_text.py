"""Report-forging names: every control, separator and bidirectional character is
escaped in text and JSON reports, whichever report names the file."""

import json
import os
import unicodedata

import pytest

from gpuagent.integrity import (
    ManifestMismatchError,
    ModelRejectedError,
    UnsafePathError,
    hash_model,
    inspect_model,
)
from gpuagent.integrity.__main__ import EXIT_REJECTED, main
from gpuagent.integrity._text import printable, unsafe_char
from tests.gpuagent.integrity.builders import write_model

# One of each class that can forge or reorder a line of a report.
FORGING = {
    "newline": "\n",
    "carriage-return": "\r",
    "escape": "\x1b",
    "c1-next-line": "\x85",
    "c1-csi": "\x9b",
    "line-separator": "\u2028",
    "paragraph-separator": "\u2029",
    "right-to-left-override": "\u202e",
    "left-to-right-embedding": "\u202a",
    "right-to-left-isolate": "\u2067",
    "pop-directional-isolate": "\u2069",
    "right-to-left-mark": "\u200f",
    "arabic-letter-mark": "\u061c",
    "zero-width-no-break": "\ufeff",
}
FORGED_LINE = "  ok       safetensors model.safetensors"


def raw_characters_left(text: str) -> set[str]:
    return {c for c in text if c != "\n" and unsafe_char(c)}


@pytest.mark.parametrize("char", FORGING.values(), ids=FORGING.keys())
def test_it_escapes_the_character_in_inspect_reports(tmp_path, char):
    folder = write_model(tmp_path / "model")
    (folder / f"notes{char}{FORGED_LINE}").write_text("x")

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder)

    report = caught.value.report
    assert report.codes() == {"path-name-invalid"}
    text = report.to_text()
    assert raw_characters_left(text) == set()
    assert text.splitlines().count(FORGED_LINE) == 1  # only the real file
    assert raw_characters_left(str(caught.value)) == set()
    dumped = json.dumps(caught.value.to_dict(), ensure_ascii=False)
    paths = [f["path"] for f in json.loads(dumped)["report"]["files"]]
    assert len(paths) == 4
    assert all(raw_characters_left(p) == set() for p in paths)
    assert ascii(char)[1:-1] in text


def test_it_escapes_names_in_the_cli_text_and_json_output(tmp_path, capsys):
    folder = write_model(tmp_path / "model")
    (folder / "a\u2028b\u202ec").write_text("x")

    assert main(["inspect", str(folder)]) == EXIT_REJECTED
    text = capsys.readouterr().out
    assert main(["inspect", str(folder), "--json"]) == EXIT_REJECTED
    report = json.loads(capsys.readouterr().out)

    assert raw_characters_left(text) == set()
    paths = [f["path"] for f in report["report"]["files"]]
    assert "a\\u2028b\\u202ec" in paths
    assert all(raw_characters_left(p) == set() for p in paths)


def test_it_names_a_forging_name_in_hash_errors_escaped(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "x\x9b31mOK").write_text("x")

    with pytest.raises(UnsafePathError) as caught:
        hash_model(folder)

    assert "x\\x9b31mOK" in str(caught.value)
    assert raw_characters_left(str(caught.value)) == set()


def test_it_escapes_signed_names_in_manifest_mismatch_reports():
    # Names in a signed manifest come from whoever signed it.
    error = ManifestMismatchError(["w\u2029.safetensors"], ["e\x85"], ["c\u2066"])

    assert error.missing == ["w\\u2029.safetensors"]
    assert raw_characters_left(str(error)) == set()
    assert raw_characters_left(json.dumps(error.to_dict(), ensure_ascii=False)) == (
        set()
    )


def test_it_escapes_every_format_and_control_character_and_keeps_other_text():
    unsafe = [
        chr(c)
        for c in range(0x110000)
        if unicodedata.category(chr(c)) in ("Cc", "Cf", "Zl", "Zp")
    ]

    assert all(printable(c) != c and printable(c).isascii() for c in unsafe)
    assert printable("모델 가중치 🙂.safetensors") == "모델 가중치 🙂.safetensors"
    # Once anything is escaped, a backslash is too: "\\u202e" spelled out in a
    # name can't pass for an escaped override.
    assert printable("a\\u202e\u202e") == "a\\\\u202e\\u202e"


def test_it_keeps_a_file_name_with_a_literal_backslash_as_is(tmp_path):
    folder = write_model(tmp_path / "model")
    os.close(os.open(folder / "a\\b.txt", os.O_CREAT | os.O_WRONLY))

    assert printable("a\\b.txt") == "a\\b.txt"
    assert "a\\b.txt" in hash_model(folder).files()
