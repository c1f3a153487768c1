"""inspect_model on a generated corpus of malformed safetensors files and
folders: every case is named and must be rejected for its own reason."""

import bz2
import gzip
import io
import json
import lzma
import os
import pickle
import struct
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from safetensors.numpy import save

from gpuagent.integrity import (
    DEFAULT_POLICY,
    IntegrityError,
    ModelRejectedError,
    inspect_model,
)
from tests.gpuagent.integrity.builders import (
    DATA_FILES,
    make_sparse,
    raw_safetensors,
    refuse_reads,
    shard_under_extras,
    write_model,
)

F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def weights(folder: Path, content: bytes, name: str = "model.safetensors") -> None:
    (folder / name).write_bytes(content)


def entry(begin: int, end: int, shape=None, dtype="F32") -> dict:
    shape = [(end - begin) // 4] if shape is None else shape
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def index(
    folder: Path,
    weight_map: dict,
    raw: str | None = None,
    name: str = "model.safetensors.index.json",
) -> None:
    text = raw if raw is not None else json.dumps({"weight_map": weight_map})
    (folder / name).write_text(text)


def shard(folder: Path, name: str, tensor_names: list[str]) -> None:
    arrays = {n: np.zeros(2, dtype=np.float32) for n in tensor_names}
    (folder / name).write_bytes(save(arrays))


def sharded(folder: Path, weight_map: dict, shards: dict) -> None:
    (folder / "model.safetensors").unlink()
    for name, tensor_names in shards.items():
        shard(folder, name, tensor_names)
    index(folder, weight_map)


def zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
    return buf.getvalue()


def empty_zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w"):
        pass
    return buf.getvalue()


# Pickles that call os.getcwd() when loaded but carry no protocol header, each
# hiding the call behind something a short or strict look at the start misses.
LONG_TEXT_ARGUMENT = ("S'" + "a" * 3000 + "'\n0cos\ngetcwd\n)R.").encode()
LONG_BINARY_ARGUMENT = (
    b"X" + struct.pack("<I", 3000) + b"a" * 3000 + b"0\x8c\x02os\x8c\x06getcwd\x93)R."
)
HEX_INT_FIRST = b"I0x10\n0cos\ngetcwd\n)R."  # the C unpickler takes 0x10
# FRAME of 2 bytes, then BINFLOAT: read from a file, the C unpickler drops the
# frame's last byte and takes the float from the 8 bytes after the frame.
FRAME_SPLIT = (
    b"\x95"
    + struct.pack("<Q", 2)
    + b"G\xef"
    + b"\x9c\x11zC\x83b\xdde"
    + b"\x8c\x02os\x8c\x06getcwd\x93)R."
)


class RecordingUnpickler(pickle.Unpickler):
    """CPython's own unpickler, reading a file, with every import resolved to a
    recorder: loading shows what a pickle would call, and runs nothing."""

    def find_class(self, module, name):
        def record(*args, **kwargs):
            self.calls.append(f"{module}.{name}")

        return record

    def calls_made(self) -> list[str]:
        self.calls: list[str] = []
        try:
            self.load()
        except Exception:  # noqa: BLE001 - what it called before failing counts
            pass
        return self.calls


def tar_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("data.pkl")
        payload = pickle.dumps([1])
        info.size = len(payload)
        t.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], None]
    code: str
    path: str = "model.safetensors"


A = 'a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'

CASES = [
    # --- safetensors header ---------------------------------------------------
    Case("too-short", lambda f: weights(f, b"\x01\x02"), "file-too-short"),
    Case(
        "header-over-limit",
        lambda f: weights(f, raw_safetensors("{}", length=200 * 1024 * 1024)),
        "header-too-large",
    ),
    Case(
        "header-past-end",
        lambda f: weights(f, raw_safetensors("{}", length=1000)),
        "header-past-end",
    ),
    Case(
        "zero-length-header",
        lambda f: weights(f, raw_safetensors("")),
        "header-not-object",
    ),
    Case(
        "header-not-utf8",
        lambda f: weights(f, raw_safetensors(b'{"\xff": 1}')),
        "header-not-utf8",
    ),
    Case(
        "leading-spaces",
        lambda f: weights(f, raw_safetensors('  {"' + A + "}", b"\0" * 8)),
        "header-not-object",
    ),
    Case(
        "header-is-array",
        lambda f: weights(f, raw_safetensors("[]")),
        "header-not-object",
    ),
    Case(
        "nul-padding",
        lambda f: weights(f, raw_safetensors('{"' + A + "}\0\0", b"\0" * 8)),
        "header-bad-padding",
    ),
    Case(
        "trailing-garbage",
        lambda f: weights(f, raw_safetensors('{"' + A + "} x", b"\0" * 8)),
        "header-bad-padding",
    ),
    Case(
        "invalid-json", lambda f: weights(f, raw_safetensors('{"a": }')), "invalid-json"
    ),
    Case(
        "duplicate-tensor-name",
        lambda f: weights(f, raw_safetensors('{"' + A + ', "' + A + "}", b"\0" * 8)),
        "duplicate-key",
    ),
    Case(
        "duplicate-field-in-entry",
        lambda f: weights(
            f,
            raw_safetensors(
                '{"a": {"dtype": "F32", "dtype": "I32", "shape": [2], '
                '"data_offsets": [0, 8]}}',
                b"\0" * 8,
            ),
        ),
        "duplicate-key",
    ),
    Case(
        "duplicate-metadata-key",
        lambda f: weights(f, raw_safetensors('{"__metadata__": {"k": "1", "k": "2"}}')),
        "duplicate-key",
    ),
    Case(
        "nan-literal-in-shape",
        lambda f: weights(
            f,
            raw_safetensors(
                '{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}'
            ),
        ),
        "nonfinite-literal",
    ),
    Case(
        "infinity-literal",
        lambda f: weights(f, raw_safetensors('{"__metadata__": {"k": Infinity}}')),
        "nonfinite-literal",
    ),
    Case(
        "number-overflows-to-infinity",
        lambda f: weights(f, raw_safetensors('{"__metadata__": {"k": 1e999}}')),
        "nonfinite-number",
    ),
    Case(
        "nesting-too-deep",
        lambda f: weights(f, raw_safetensors('{"__metadata__": ' + nested(40) + "}")),
        "nesting-too-deep",
    ),
    Case(
        "nesting-past-recursion-limit",
        lambda f: weights(f, raw_safetensors('{"a": ' + nested(100_000) + "}")),
        "nesting-too-deep",
    ),
    Case(
        "metadata-not-str-map",
        lambda f: weights(f, raw_safetensors({"__metadata__": {"k": 1}})),
        "metadata-not-str-map",
    ),
    Case(
        "entry-not-object",
        lambda f: weights(f, raw_safetensors({"a": [0, 8]}, b"\0" * 8)),
        "entry-not-object",
    ),
    Case(
        "unknown-entry-field",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "offset_hint": 0}}, b"\0" * 8)
        ),
        "entry-fields",
    ),
    Case(
        "missing-entry-field",
        lambda f: weights(
            f, raw_safetensors({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)
        ),
        "entry-fields",
    ),
    Case(
        "dtype-not-allowed",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "dtype": "F4"}}, b"\0" * 8)
        ),
        "dtype-not-allowed",
    ),
    Case(
        "shape-bool",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "shape": [True, 2]}}, b"\0" * 8)
        ),
        "shape-invalid",
    ),
    Case(
        "shape-negative",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "shape": [-2]}}, b"\0" * 8)
        ),
        "shape-invalid",
    ),
    Case(
        "shape-float",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "shape": [2.0]}}, b"\0" * 8)
        ),
        "shape-invalid",
    ),
    Case(
        "offsets-three-values",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "data_offsets": [0, 4, 8]}}, b"\0" * 8)
        ),
        "offsets-invalid",
    ),
    Case(
        "offsets-reversed",
        lambda f: weights(
            f, raw_safetensors({"a": {**F32_2, "data_offsets": [8, 0]}}, b"\0" * 8)
        ),
        "offsets-invalid",
    ),
    Case(
        "size-mismatch",
        lambda f: weights(f, raw_safetensors({"a": entry(0, 8, shape=[3])}, b"\0" * 8)),
        "size-mismatch",
    ),
    Case(
        "gap-between-tensors",
        lambda f: weights(
            f, raw_safetensors({"a": entry(0, 4), "b": entry(8, 12)}, b"\0" * 12)
        ),
        "data-gap",
    ),
    Case(
        "overlapping-tensors",
        lambda f: weights(
            f, raw_safetensors({"a": entry(0, 8), "b": entry(4, 12)}, b"\0" * 12)
        ),
        "data-overlap",
    ),
    Case(
        "tensor-past-end",
        lambda f: weights(f, raw_safetensors({"a": entry(0, 8)}, b"\0" * 4)),
        "data-past-end",
    ),
    Case(
        "trailing-bytes",
        lambda f: weights(f, raw_safetensors({"a": entry(0, 8)}, b"\0" * 12)),
        "trailing-bytes",
    ),
    Case(
        "empty-tensor-name",
        lambda f: weights(f, raw_safetensors({"": entry(0, 8)}, b"\0" * 8)),
        "tensor-name-invalid",
    ),
    # --- sharded index ----------------------------------------------------------
    Case(
        "index-parent-traversal",
        lambda f: sharded(
            f, {"a": "../model-1.safetensors"}, {"model-1.safetensors": ["a"]}
        ),
        "index-path-traversal",
        "model.safetensors.index.json",
    ),
    Case(
        "index-absolute-path",
        lambda f: sharded(
            f, {"a": "/etc/model-1.safetensors"}, {"model-1.safetensors": ["a"]}
        ),
        "index-path-traversal",
        "model.safetensors.index.json",
    ),
    Case(
        "index-missing-shard",
        lambda f: sharded(
            f,
            {"a": "model-1.safetensors", "b": "model-2.safetensors"},
            {"model-1.safetensors": ["a"]},
        ),
        "index-missing-shard",
        "model.safetensors.index.json",
    ),
    Case(
        "index-tensor-in-wrong-shard",
        lambda f: sharded(
            f,
            {"a": "model-1.safetensors", "b": "model-1.safetensors"},
            {"model-1.safetensors": ["a"], "model-2.safetensors": ["b"]},
        ),
        "index-tensor-missing",
        "model.safetensors.index.json",
    ),
    Case(
        "index-unmapped-tensor",
        lambda f: sharded(
            f, {"a": "model-1.safetensors"}, {"model-1.safetensors": ["a", "hidden"]}
        ),
        "index-unmapped-tensor",
        "model.safetensors.index.json",
    ),
    Case(
        "index-tensor-in-two-shards",
        lambda f: sharded(
            f,
            {"a": "model-1.safetensors", "b": "model-2.safetensors"},
            {"model-1.safetensors": ["a"], "model-2.safetensors": ["a", "b"]},
        ),
        "index-duplicate-tensor",
        "model.safetensors.index.json",
    ),
    Case(
        "index-unreferenced-shard",
        lambda f: sharded(
            f,
            {"a": "model-1.safetensors"},
            {"model-1.safetensors": ["a"], "model-9.safetensors": ["z"]},
        ),
        "index-unreferenced-shard",
        "model-9.safetensors",
    ),
    Case(
        "index-shard-not-safetensors",
        lambda f: sharded(f, {"a": "model-1.bin"}, {"model-1.safetensors": ["a"]}),
        "index-shard-not-safetensors",
        "model.safetensors.index.json",
    ),
    Case(
        "index-duplicate-key",
        lambda f: index(
            f, {}, '{"weight_map": {"a": "model.safetensors"}, "weight_map": {}}'
        ),
        "json-duplicate-key",
        "model.safetensors.index.json",
    ),
    Case(
        "config-with-utf8-bom",
        lambda f: (f / "config.json").write_bytes(b'\xef\xbb\xbf{"model_type": "x"}'),
        "json-utf8-bom",
        "config.json",
    ),
    # --- folder ---------------------------------------------------------------
    Case(
        "zip-under-innocent-name",
        lambda f: (f / "weights.dat").write_bytes(zip_bytes()),
        "pickle-zip",
        "weights.dat",
    ),
    Case(
        "zip-behind-a-text-prefix",
        lambda f: (f / "weights.dat").write_bytes(b"nothing to see\n" + zip_bytes()),
        "pickle-zip",
        "weights.dat",
    ),
    Case(
        "empty-zip",
        lambda f: (f / "weights.dat").write_bytes(empty_zip_bytes()),
        "pickle-zip",
        "weights.dat",
    ),
    Case(
        "pickle-named-safetensors",
        lambda f: weights(f, pickle.dumps({"a": 1}, protocol=2)),
        "pickle-protocol",
    ),
    Case(
        "pickle-long-text-argument-first",
        lambda f: (f / "optimizer.state").write_bytes(LONG_TEXT_ARGUMENT),
        "pickle-protocol",
        "optimizer.state",
    ),
    Case(
        "pickle-long-binary-argument-first",
        lambda f: (f / "optimizer.state").write_bytes(LONG_BINARY_ARGUMENT),
        "pickle-protocol",
        "optimizer.state",
    ),
    Case(
        "pickle-hex-int-first",
        lambda f: (f / "optimizer.state").write_bytes(HEX_INT_FIRST),
        "pickle-protocol",
        "optimizer.state",
    ),
    Case(
        "pickle-frame-without-protocol-header",
        lambda f: (f / "optimizer.state").write_bytes(FRAME_SPLIT),
        "pickle-protocol",
        "optimizer.state",
    ),
    Case(
        "pickle-stream-past-the-scan-limit",
        lambda f: (f / "optimizer.state").write_bytes(b"N0" * 600_000 + b"N."),
        "pickle-undecidable",
        "optimizer.state",
    ),
    Case(
        "pickle-protocol-4",
        lambda f: (f / "tokenizer.model").write_bytes(
            pickle.dumps({"a": 1}, protocol=4)
        ),
        "pickle-protocol",
        "tokenizer.model",
    ),
    Case(
        "pickle-protocol-2",
        lambda f: (f / "extra.dat").write_bytes(pickle.dumps([1], protocol=2)),
        "pickle-protocol",
        "extra.dat",
    ),
    Case(
        "7z-archive",
        lambda f: (f / "blob.dat").write_bytes(b"7z\xbc\xaf\x27\x1c" + b"\0" * 30),
        "archive-7z",
        "blob.dat",
    ),
    Case(
        "gzip-stream",
        lambda f: (f / "vocab.txt").write_bytes(gzip.compress(b"hello")),
        "archive-gzip",
        "vocab.txt",
    ),
    Case(
        "bzip2-stream",
        lambda f: (f / "vocab.txt").write_bytes(bz2.compress(b"hello")),
        "archive-other",
        "vocab.txt",
    ),
    Case(
        "xz-stream",
        lambda f: (f / "vocab.txt").write_bytes(lzma.compress(b"hello")),
        "archive-other",
        "vocab.txt",
    ),
    Case(
        "zstd-stream",
        lambda f: (f / "vocab.txt").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16),
        "archive-other",
        "vocab.txt",
    ),
    Case(
        "tar-archive",
        lambda f: (f / "data.dat").write_bytes(tar_bytes()),
        "archive-other",
        "data.dat",
    ),
    Case(
        "hdf5-file",
        lambda f: (f / "tf_model.dat").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64),
        "hdf5",
        "tf_model.dat",
    ),
    Case(
        "numpy-object-array",
        lambda f: (f / "emb.npy").write_bytes(
            npy_bytes(np.array([{"x": 1}], dtype=object))
        ),
        "numpy-object-array",
        "emb.npy",
    ),
    Case(
        "numpy-invalid-header",
        lambda f: (f / "emb.npy").write_bytes(
            b"\x93NUMPY\x01\x00" + struct.pack("<H", 10) + b"{'descr':\n"
        ),
        "numpy-invalid",
        "emb.npy",
    ),
    Case(
        "torch-bin-extension",
        lambda f: (f / "pytorch_model.bin").write_bytes(b"\0" * 16),
        "pickle-extension",
        "pytorch_model.bin",
    ),
    Case(
        "python-file",
        lambda f: (f / "modeling_llama.py").write_text("import os\n"),
        "python-file",
        "modeling_llama.py",
    ),
    Case(
        "auto-map-in-config",
        lambda f: (f / "config.json").write_text(
            json.dumps({"auto_map": {"AutoModel": "modeling.Model"}})
        ),
        "remote-code-auto_map",
        "config.json",
    ),
    Case(
        "compiled-python-file",
        lambda f: (f / "modeling_llama.cpython-311.pyc").write_bytes(b"\xa7\r\r\n"),
        "python-file",
        "modeling_llama.cpython-311.pyc",
    ),
    Case(
        "native-library",
        lambda f: (f / "kernels.so").write_bytes(b"\x7fELF" + b"\0" * 60),
        "native-code",
        "kernels.so",
    ),
    Case(
        "auto-map-nested-in-a-sub-config",
        lambda f: (f / "config.json").write_text(
            json.dumps({"text_config": {"auto_map": {"AutoModel": "m.Model"}}})
        ),
        "remote-code-auto_map",
        "config.json",
    ),
    Case(
        "auto-map-in-tokenizer-config",
        lambda f: (f / "tokenizer_config.json").write_text(
            json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]}})
        ),
        "remote-code-auto_map",
        "tokenizer_config.json",
    ),
    Case(
        "config-nan",
        lambda f: (f / "config.json").write_text('{"rope_theta": NaN}'),
        "json-nonfinite-literal",
        "config.json",
    ),
    Case(
        "config-number-overflows-to-infinity",
        lambda f: (f / "config.json").write_text(
            '{"model_type": "llama", "rope_theta": 1e999}'
        ),
        "json-nonfinite-number",
        "config.json",
    ),
    Case(
        "config-too-large",
        lambda f: make_sparse(f / "config.json", DEFAULT_POLICY.max_header_bytes + 1),
        "json-too-large",
        "config.json",
    ),
    Case(
        "symlink-absolute",
        lambda f: os.symlink("/etc/passwd", f / "tokenizer.model"),
        "symlink-escapes",
        "tokenizer.model",
    ),
    Case(
        "symlink-parent",
        lambda f: os.symlink("../../outside.safetensors", f / "extra.safetensors"),
        "symlink-escapes",
        "extra.safetensors",
    ),
    Case(
        "symlink-internal",
        lambda f: os.symlink("config.json", f / "config2.json"),
        "symlink",
        "config2.json",
    ),
    Case("fifo", lambda f: os.mkfifo(f / "pipe"), "special-file", "pipe"),
    Case(
        "config-not-json",
        lambda f: (f / "config.json").write_text("{'a': 1}"),
        "json-invalid",
        "config.json",
    ),
    Case(
        "pickle-in-subfolder",
        lambda f: (
            (f / "sub").mkdir()
            or (f / "sub" / "opt.state").write_bytes(
                pickle.dumps({"step": 1}, protocol=5)
            )
        ),
        "pickle-protocol",
        "sub/opt.state",
    ),
    Case(
        "stray-weights-beside-index",
        lambda f: (
            sharded(f, {"a": "model-1.safetensors"}, {"model-1.safetensors": ["a"]})
            or shard(f, "model.safetensors", ["a"])
        ),
        "index-unreferenced-shard",
        "model.safetensors",
    ),
]


def test_it_has_at_least_thirty_named_cases():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_it_rejects_malformed_input_for_the_right_reason(tmp_path, case):
    folder = write_model(tmp_path / "model")
    case.build(folder)

    with pytest.raises(ModelRejectedError) as info:
        # The policy names the data files the cases plant: a file refused by
        # name is never read, and these are refused for their content.
        inspect_model(folder, DATA_FILES)

    report = info.value.report
    rejected = {
        f.path: {x.code for x in f.findings} for f in report.files if f.findings
    }
    assert case.code in rejected.get(case.path, set()), rejected
    assert isinstance(info.value, IntegrityError)
    assert case.path in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["duplicate-tensor-name", "leading-spaces", "unknown-entry-field"],
)
def test_it_rejects_files_the_safetensors_library_accepts(tmp_path, name):
    case = next(c for c in CASES if c.name == name)
    folder = write_model(tmp_path / "model")
    case.build(folder)
    content = (folder / "model.safetensors").read_bytes()

    loaded = safetensors.numpy.load(content)  # the library takes it...

    assert "a" in loaded
    with pytest.raises(ModelRejectedError):  # ...the gate does not
        inspect_model(folder)


def test_it_reports_every_file_of_a_clean_folder(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "ok.npy").write_bytes(npy_bytes(np.arange(4, dtype=np.float32)))

    report = inspect_model(folder, DATA_FILES)  # the policy names *.npy

    assert report.ok
    assert {f.path: f.verdict for f in report.files} == {
        "config.json": "ok",
        "model.safetensors": "ok",
        "ok.npy": "ok",
        "tokenizer.json": "ok",
    }
    assert {f.path: f.kind for f in report.files}["model.safetensors"] == "safetensors"


def test_it_accepts_a_clean_sharded_folder(tmp_path):
    folder = write_model(tmp_path / "model", sharded=True)

    report = inspect_model(folder)

    assert report.ok
    assert "model.safetensors.index.json" in [f.path for f in report.files]


def test_it_accepts_zero_sized_tensors_and_metadata(tmp_path):
    folder = write_model(tmp_path / "model")
    arrays = {"empty": np.zeros((0, 4), np.float32), "w": np.ones(3, np.float16)}
    (folder / "model.safetensors").write_bytes(save(arrays, metadata={"format": "np"}))

    assert inspect_model(folder).ok


def test_it_reports_every_rejected_file_not_only_the_first(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "a.py").write_text("")
    (folder / "b.pkl").write_bytes(pickle.dumps(1))

    with pytest.raises(ModelRejectedError) as info:
        inspect_model(folder)

    rejected = sorted(f.path for f in info.value.report.files if f.findings)
    assert rejected == ["a.py", "b.pkl"]


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [("F32", np.float32(np.nan)), ("F16", np.float16(np.inf)), ("F64", -np.inf)],
)
def test_it_finds_nonfinite_weights_when_asked(tmp_path, dtype, bad):
    folder = write_model(tmp_path / "model")
    array = np.ones(
        1000, dtype={"F32": np.float32, "F16": np.float16, "F64": np.float64}[dtype]
    )
    array[777] = bad
    (folder / "model.safetensors").write_bytes(save({"w": array}))

    assert inspect_model(folder).ok  # not scanned by default
    with pytest.raises(ModelRejectedError) as info:
        inspect_model(folder, DEFAULT_POLICY.replace(scan_nonfinite=True))

    assert "nonfinite-weights" in info.value.report.codes()
    assert "1 NaN/Inf" in str(info.value)


def test_it_finds_nonfinite_bf16_weights_by_bit_pattern(tmp_path):
    folder = write_model(tmp_path / "model")
    bits = np.full(64, 0x3F80, dtype=np.uint16)  # bf16 1.0
    bits[5], bits[9] = 0x7F80, 0xFFC1  # +Inf, a NaN
    header = {"w": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 128]}}
    (folder / "model.safetensors").write_bytes(raw_safetensors(header, bits.tobytes()))

    with pytest.raises(ModelRejectedError) as info:
        inspect_model(folder, DEFAULT_POLICY.replace(scan_nonfinite=True))

    assert "w: 2 NaN/Inf" in str(info.value)


def test_it_refuses_a_missing_folder_with_a_typed_error(tmp_path):
    with pytest.raises(IntegrityError, match="does not exist"):
        inspect_model(tmp_path / "nope")


def test_it_accepts_the_demo_model_that_ships_with_the_engine():
    demo = Path(__file__).resolve().parents[3] / "gpuagent" / "engine" / "demo_model"

    report = inspect_model(demo, DEFAULT_POLICY.replace(scan_nonfinite=True))

    assert report.ok
    assert "model.safetensors" in [f.path for f in report.files]


def test_it_never_raises_anything_but_its_own_error_on_mutated_headers(tmp_path):
    folder = write_model(tmp_path / "model")
    original = (folder / "model.safetensors").read_bytes()
    rng = np.random.default_rng(1234)
    outcomes = set()
    for _ in range(300):
        data = bytearray(original)
        for position in rng.integers(0, 8 + 200, size=rng.integers(1, 4)):
            data[position] = int(rng.integers(0, 256))
        (folder / "model.safetensors").write_bytes(bytes(data))
        try:
            inspect_model(folder)
            outcomes.add("ok")
        except ModelRejectedError as e:
            outcomes.update(e.report.codes())

    assert len(outcomes) >= 5  # the mutations hit many different checks


def library_file_with_header_length(length: int) -> bytes:
    """A file safetensors itself writes, its metadata padded so that the header
    is exactly `length` bytes (the library pads headers to a multiple of 8)."""
    arrays = {"w": np.arange(4, dtype=np.float32)}
    bare = save(arrays, metadata={"pad": ""})
    text = bare[8 : 8 + int.from_bytes(bare[:8], "little")].rstrip(b" ")
    for pad in range(max(length - len(text) - 8, 0), length - len(text) + 1):
        data = save(arrays, metadata={"pad": "x" * pad})
        if int.from_bytes(data[:8], "little") == length:
            return data
    raise AssertionError(f"no padding gives a {length}-byte header")


def spaced_header_file(length: int, metadata: dict | None = None) -> bytes:
    """A hand-made valid file whose header is `length` bytes, space-padded."""
    header = {"w": entry(0, 16)}
    if metadata is not None:
        header = {"__metadata__": metadata, **header}
    text = json.dumps(header)
    return raw_safetensors(text + " " * (length - len(text)), b"\0" * 16)


USTAR_PAD = 257 - 8 - len('{"__metadata__": {"k": "')


@pytest.mark.parametrize(
    ("name", "build", "looks_like"),
    [
        ("length-640", lambda: library_file_with_header_length(640), b"\x80\x02"),
        ("length-66176", lambda: library_file_with_header_length(66176), b"\x80\x02"),
        ("length-35615", lambda: spaced_header_file(35615), b"\x1f\x8b"),
        (
            "ustar-at-257",
            lambda: spaced_header_file(400, {"k": "u" * USTAR_PAD + "ustar"}),
            None,
        ),
    ],
    ids=["length-640", "length-66176", "length-35615", "ustar-at-257"],
)
def test_it_does_not_sniff_magic_in_a_valid_safetensors_file(
    tmp_path, name, build, looks_like
):
    # The 8-byte header length reads as a pickle protocol 2 header (640 =
    # b"\x80\x02...") or a gzip magic (0x8b1f); header text can put "ustar" at
    # 257, where tar has its magic.
    content = build()
    if looks_like is not None:
        assert content.startswith(looks_like)
    else:
        assert content[257:262] == b"ustar"
    folder = write_model(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(content)

    assert set(safetensors.numpy.load(content)) == {"w"}  # the library takes it
    assert inspect_model(folder).ok


def test_it_does_not_take_tensor_bytes_for_a_zip_end_record(tmp_path):
    # The data buffer is numbers; a ZIP end record in it is no archive.
    data = np.frombuffer(b"PK\x05\x06" + b"\0" * 28, dtype=np.uint8)
    content = save({"w": data.copy()})
    folder = write_model(tmp_path / "model")
    (folder / "model.safetensors").write_bytes(content)

    assert b"PK\x05\x06" in content[-64:]
    assert inspect_model(folder).ok


def test_it_reads_only_the_ends_of_a_large_file_that_is_no_pickle(
    tmp_path, monkeypatch
):
    folder = write_model(tmp_path / "model")
    big = folder / "notes.dat"  # named by the policy: not read whole as text
    line = b"Format: https://example.org/spec\nFiles: *\n"
    big.write_bytes(line * ((64 << 20) // len(line)))  # dense: a sparse one is refused
    read = []
    real_pread = os.pread

    def spy(fd, size, offset):
        data = real_pread(fd, size, offset)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", spy)

    assert inspect_model(folder, DATA_FILES).ok
    assert sum(read) < 256 << 10  # head, a little of the opcode scan, ZIP tail


@pytest.mark.parametrize(
    "payload",
    [LONG_TEXT_ARGUMENT, LONG_BINARY_ARGUMENT, HEX_INT_FIRST, FRAME_SPLIT],
    ids=["long-text", "long-binary", "hex-int", "frame-split"],
)
def test_the_hidden_pickles_of_the_corpus_really_call_code(payload):
    # Reading from a file object, as torch.load does; the stream is not valid
    # read straight through for FRAME_SPLIT, only the way the C unpickler
    # reads a file.
    calls = RecordingUnpickler(io.BytesIO(payload)).calls_made()

    assert calls == ["os.getcwd"]


def test_it_looks_for_auto_map_below_the_top_only_in_configs(tmp_path):
    # A vocabulary is data: a token spelled "auto_map" is no remote code.
    folder = write_model(tmp_path / "model")
    tokenizer = {"model": {"type": "WordLevel", "vocab": {"auto_map": 0}}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))

    assert inspect_model(folder).ok


# --- indexes: every loader's, and what they point at ----------------------------

INDEX_NAMES = [
    "pytorch_model.bin.index.json",
    "tf_model.h5.index.json",
    "consolidated.safetensors.index.json",
    "model.safetensors.index.json",
]


@pytest.mark.parametrize("index_name", INDEX_NAMES)
@pytest.mark.parametrize(
    ("reference", "code"),
    [
        ("../outside.safetensors", "index-path-traversal"),
        ("{absolute}", "index-path-traversal"),
        ("link.safetensors", "index-missing-shard"),
    ],
    ids=["parent", "absolute", "symlink"],
)
def test_it_refuses_any_index_that_points_outside_the_folder(
    tmp_path, index_name, reference, code
):
    # transformers joins the folder and the shard name: "../x" and "/x" leave it.
    folder = write_model(tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(save({"w": np.zeros(2, dtype=np.float32)}))
    os.symlink(outside, folder / "link.safetensors")
    reference = str(outside) if reference == "{absolute}" else reference
    index(folder, {"w": reference}, name=index_name)

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder)

    [finding] = [
        x for f in caught.value.report.files if f.path == index_name for x in f.findings
    ]
    assert finding.code == code
    assert reference in finding.detail


def test_it_refuses_an_index_naming_a_shard_a_signature_may_leave_out(tmp_path):
    folder = write_model(tmp_path / "model", sharded=True)
    left_out = shard_under_extras(folder)
    assert inspect_model(folder).ok
    # A policy that lets a signature leave out extras/: those weights would load
    # unverified.
    policy = DEFAULT_POLICY.replace(extra_ignorable_paths=("extras",))

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder, policy)

    found = {f.path: {x.code for x in f.findings} for f in caught.value.report.files}
    assert found["model.safetensors.index.json"] == {"index-shard-not-signed"}
    assert left_out in str(caught.value)


# --- refused before reading: by name, by size, by holes --------------------------


def sparse_weights(path: Path) -> None:
    """A safetensors file with a valid header for a 64 GiB tensor, the data a
    hole: it takes no disk, and a reader of it would take hours."""
    size = 64 << 30
    header = {"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}
    path.write_bytes(raw_safetensors(header))
    make_sparse(path, path.stat().st_size + size)


@pytest.mark.parametrize(
    ("name", "build"),
    [
        ("model.safetensors", sparse_weights),
        ("notes.dat", lambda p: make_sparse(p, 64 << 30)),
        ("config.json", lambda p: make_sparse(p, 1 << 20)),  # under its limit
    ],
    ids=["weights", "data-file", "config"],
)
def test_it_refuses_a_sparse_file_without_reading_it(
    tmp_path, monkeypatch, name, build
):
    folder = write_model(tmp_path / "model")
    build(folder / name)
    refuse_reads(monkeypatch, folder / name)

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder, DATA_FILES)

    [verdict] = [f for f in caught.value.report.files if f.findings]
    assert verdict.path == name
    assert [x.code for x in verdict.findings] == ["sparse-file"]


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("pytorch_model.bin", "pickle-extension"),
        ("weights.xyz", "file-not-allowed"),
        ("modeling_llama.py", "python-file"),
        ("tokenizer.json", "json-too-large"),
        ("README.md", "text-too-large"),
    ],
)
def test_it_never_reads_a_file_refused_by_name_or_size(
    tmp_path, monkeypatch, name, code
):
    folder = write_model(tmp_path / "model")
    make_sparse(folder / name, 64 << 30)  # read to the end, it would take hours
    refuse_reads(monkeypatch, folder / name)

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder)

    assert caught.value.report.codes() == {code}


def test_it_refuses_a_bom_in_json_as_transformers_does(tmp_path):
    from transformers import PretrainedConfig

    folder = write_model(tmp_path / "model")
    config = folder / "config.json"
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())

    with pytest.raises(ValueError, match="BOM"):  # what it opens configs with
        PretrainedConfig._dict_from_json_file(config)
    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder)

    assert caught.value.report.codes() == {"json-utf8-bom"}
    assert "byte-order mark" in str(caught.value)
