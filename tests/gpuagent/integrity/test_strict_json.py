"""strict_json: one reading of a document, and a bounded cost on hostile ones
(the cost measured in a child process, as the CLI runs)."""

import json

import pytest

from gpuagent.benches.integrity import hostile_safetensors, measure_child, wide_json
from gpuagent.integrity.strict_json import Rejected, strict_json_loads
from tests.gpuagent.integrity.builders import write_model

HOSTILE_BYTES = 99_000_000
# Generous: the gate takes ~2.5 s and ~0.4 GB here; the parser it replaced, 91 s
# and 4.8 GB. The safetensors library takes 2-9 s on the same header.
TIME_LIMIT_S = 10
MEMORY_LIMIT_BYTES = 1 << 30


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('{"a": [' + "[]," * 20 + "[]]}", "too-many-elements"),
        ("[" + "1," * 20 + "1]", "too-many-elements"),
        ('{"a": {"b": {"c": {"d": 1}}}}', "nesting-too-deep"),
        ("[" * 5 + "]" * 5, "nesting-too-deep"),
    ],
)
def test_it_refuses_documents_over_the_limits_before_parsing(text, code):
    with pytest.raises(Rejected) as info:
        strict_json_loads(text, max_depth=3, max_elements=16)

    assert info.value.code == code


def test_it_does_not_count_structure_inside_strings():
    text = json.dumps({"k": "[{,}]" * 100, "q": 'a\\"[[[[[[,,,,"'})

    assert strict_json_loads(text, max_depth=1, max_elements=4) == json.loads(text)


def test_it_accepts_a_document_exactly_at_the_limits():
    text = "[[[1, 2], [3]], 4]"  # 3 deep; 4 "[" and 3 ","

    assert strict_json_loads(text, max_depth=3, max_elements=7) == json.loads(text)
    with pytest.raises(Rejected):
        strict_json_loads(text, max_depth=3, max_elements=6)
    with pytest.raises(Rejected):
        strict_json_loads(text, max_depth=2, max_elements=7)


def test_it_leaves_unbalanced_closers_to_the_parser():
    with pytest.raises(Rejected) as info:
        strict_json_loads("[1]" + "]" * 1000, max_depth=0, max_elements=10)

    assert info.value.code == "invalid-json"


def test_it_refuses_a_lone_surrogate_escape_but_takes_a_pair():
    assert strict_json_loads('["\\ud83d\\ude00"]', 2) == ["\U0001f600"]
    with pytest.raises(Rejected) as info:
        strict_json_loads('{"k": ["\\udc00"]}', 3)

    assert info.value.code == "string-not-unicode"


def run_cli_measured(*args: str) -> tuple[float, int, str]:
    """Runs the integrity CLI in a child; (wall seconds, peak RSS bytes of the
    child alone, stdout)."""
    return measure_child(
        f"from gpuagent.integrity.__main__ import main\nmain({list(args)!r})"
    )


@pytest.mark.parametrize(
    ("name", "content", "code"),
    [
        ("model.safetensors", hostile_safetensors, "too-many-elements"),
        ("config.json", wide_json, "json-too-many-elements"),
    ],
    ids=["safetensors-header", "config-json"],
)
def test_it_refuses_a_99_mb_wide_document_in_bounded_time_and_memory(
    tmp_path, name, content, code
):
    folder = write_model(tmp_path / "model")
    (folder / name).write_bytes(content(HOSTILE_BYTES))

    seconds, peak, stdout = run_cli_measured("inspect", "--json", str(folder))

    report = json.loads(stdout)  # --json always prints one result
    assert report["ok"] is False
    reasons = {
        r["code"]
        for f in report["report"]["files"]
        if f["path"] == name
        for r in f["reasons"]
    }
    assert code in reasons
    assert seconds < TIME_LIMIT_S, seconds
    assert peak < MEMORY_LIMIT_BYTES, peak


def test_it_names_a_utf8_byte_order_mark_at_the_start():
    text = b'\xef\xbb\xbf{"model_type": "llama"}'.decode("utf-8")

    with pytest.raises(Rejected) as info:
        strict_json_loads(text, 4)

    assert info.value.code == "utf8-bom"
    assert "byte-order mark" in info.value.detail
