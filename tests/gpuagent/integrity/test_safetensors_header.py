"""strict_json_loads and parse_header directly (the corpus in test_inspection
covers each rejection reason through inspect_model)."""

import os

import numpy as np
import pytest
from safetensors.numpy import save

from gpuagent.integrity.safetensors_header import (
    HeaderRejected,
    parse_header,
    strict_json_loads,
)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('{"a": {"b": {"c": 1, "c": 2}}}', "duplicate-key"),
        ('[{"x": 1}, {"y": 2, "y": 3}]', "duplicate-key"),
        ('{"a": -Infinity}', "nonfinite-literal"),
        ('{"rope_theta": 1e999}', "nonfinite-number"),  # float() makes it inf
        ("[-1.8e308]", "nonfinite-number"),
        ('{"a": 1} {"b": 2}', "invalid-json"),
        ("[[[[1]]]]", "nesting-too-deep"),
    ],
)
def test_it_rejects_json_that_parsers_could_read_differently(text, code):
    with pytest.raises(HeaderRejected) as info:
        strict_json_loads(text, max_depth=3)

    assert info.value.code == code


def test_it_keeps_large_but_finite_numbers_and_big_ints():
    text = '{"max": 1.7976931348623157e308, "tiny": 1e-999, "big": 1' + "0" * 40 + "}"

    value = strict_json_loads(text, max_depth=3)

    assert value == {"max": 1.7976931348623157e308, "tiny": 0.0, "big": 10**40}


def test_it_refuses_an_int_too_long_to_convert_with_its_own_error():
    with pytest.raises(HeaderRejected) as info:
        strict_json_loads("[" + "9" * 5000 + "]", max_depth=3)

    assert info.value.code == "invalid-json"


def test_it_parses_a_header_written_by_the_library(tmp_path):
    arrays = {"b": np.ones((2, 3), np.float16), "a": np.zeros(5, np.int64)}
    path = tmp_path / "w.safetensors"
    path.write_bytes(save(arrays, metadata={"k": "v"}))
    fd = os.open(path, os.O_RDONLY)
    try:
        header = parse_header(fd, path.stat().st_size)
    finally:
        os.close(fd)

    assert header.metadata == {"k": "v"}
    assert header.tensors["b"].shape == (2, 3) and header.tensors["b"].dtype == "F16"
    assert header.data_start + header.data_bytes == path.stat().st_size
    assert sorted(t.end - t.begin for t in header.tensors.values()) == [12, 40]
