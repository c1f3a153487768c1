"""Attacks found in review: folders and files the gate used to let through (or
choke on), each refused now for its own reason."""

import io
import json
import os
import pickle
import pickletools
import random
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from safetensors.numpy import save

from gpuagent.integrity import (
    DEFAULT_POLICY,
    ManifestMismatchError,
    ModelRejectedError,
    UnsafePathError,
    hash_model,
    inspect_model,
    pickle_scan,
    read_verified_files,
    sign_model,
    verified_load,
)
from gpuagent.integrity._fs import FileRange
from tests.gpuagent.integrity.builders import (
    DATA_FILES,
    RELEASE,
    raw_safetensors,
    write_model,
)

F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def rejected_codes(folder: Path, policy=DEFAULT_POLICY) -> set[str]:
    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder, policy)
    return caught.value.report.codes()


def plant_non_utf8_name(folder: Path) -> None:
    fd = os.open(os.fsencode(folder) + b"/weights\xff.dat", os.O_CREAT | os.O_WRONLY)
    os.close(fd)


# --- file names --------------------------------------------------------------


def test_it_rejects_a_file_name_that_is_not_utf8_and_still_reports_it(tmp_path):
    folder = write_model(tmp_path / "model")
    plant_non_utf8_name(folder)

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder)

    assert caught.value.report.codes() == {"path-name-invalid"}
    # The report goes into protocol messages and the database: it must encode.
    json.dumps(caught.value.to_dict(), ensure_ascii=False).encode("utf-8")
    str(caught.value).encode("utf-8")


def test_it_rejects_a_file_name_that_could_forge_report_lines(tmp_path):
    folder = write_model(tmp_path / "model")
    (folder / "notes\n  ok       safetensors model.safetensors").write_text("x")

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder)

    assert caught.value.report.codes() == {"path-name-invalid"}
    lines = caught.value.report.to_text().splitlines()
    assert lines.count("  ok       safetensors model.safetensors") == 1  # the real one


def test_it_refuses_to_hash_or_load_a_folder_with_a_non_utf8_name(tmp_path):
    folder = write_model(tmp_path / "model")
    digest = hash_model(folder).digest
    plant_non_utf8_name(folder)

    with pytest.raises(UnsafePathError, match="UTF-8"):
        hash_model(folder)
    with pytest.raises(UnsafePathError, match="UTF-8"):
        read_verified_files(folder, digest)


# --- safetensors headers -----------------------------------------------------


def test_it_rejects_a_tensor_name_with_a_lone_surrogate(tmp_path):
    folder = write_model(tmp_path / "model")
    lone_surrogate = '"\\ud800"'  # a JSON escape, not a Python one
    content = raw_safetensors(f"{{{lone_surrogate}: {json.dumps(F32_2)}}}", b"\0" * 8)
    (folder / "model.safetensors").write_bytes(content)

    assert rejected_codes(folder) == {"string-not-unicode"}
    with pytest.raises(Exception, match="hex escape"):  # the engine's parser agrees
        safetensors.numpy.load(content)


@pytest.mark.parametrize("shape", [[2**64, 0], [2**32, 2**32, 0], [0, 2**63]])
def test_it_rejects_a_zero_sized_shape_that_overflows_64_bits(tmp_path, shape):
    folder = write_model(tmp_path / "model")
    huge = {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
    content = raw_safetensors({"huge": huge, "w": F32_2}, b"\0" * 8)
    (folder / "model.safetensors").write_bytes(content)

    assert rejected_codes(folder) == {"shape-overflow"}
    with pytest.raises(Exception):  # noqa: B017 - the engine's parser agrees
        safetensors.numpy.load(content)


# --- pickles without a protocol header ---------------------------------------


@pytest.mark.parametrize("protocol", [0, 1])
@pytest.mark.parametrize(
    "payload",
    [os.system, np.zeros(5000, dtype=np.float32)],
    ids=["callable", "large-array"],
)
def test_it_rejects_protocol_0_and_1_pickles_under_any_name(
    tmp_path, protocol, payload
):
    folder = write_model(tmp_path / "model")
    (folder / "optimizer.dat").write_bytes(pickle.dumps(payload, protocol=protocol))

    assert rejected_codes(folder, DATA_FILES) == {"pickle-protocol"}
    assert rejected_codes(folder) == {"file-not-allowed"}  # by name: not read


DEBIAN_COPYRIGHT = (  # FLOAT, then SHORT_BINSTRING: only a checked float stops it
    b"Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
    b"Upstream-Name: sodium\nUpstream-Contact: Frank Denis <j at pureftpd dot org>\n"
    b"Source: https://github.com/jedisct1/libsodium\n\nFiles: *\n"
    b"Copyright: 2013-2017 Frank Denis <j at pureftpd dot org>\nLicense: ISC\n"
    b" Permission to use, copy, modify, and/or distribute this software for any\n"
)
PNG_START = (  # NEWFALSE, then PERSID "NG\r": an import-like opcode, then invalid
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10\x00\x00\x00\x10"
    b"\x08\x06\x00\x00\x00\x1f\xf3\xffa"
)


@pytest.mark.parametrize(
    "text",
    [
        b".. -*- rest -*-\n\nAPI changes\n" * 10,  # "." alone is a pickle STOP
        b"1.5e-01 8.9e-01 1.4e-02\n" * 200,
        DEBIAN_COPYRIGHT,
        PNG_START,
        random.Random(7).randbytes(1 << 20),
    ],
    ids=["rest", "floats", "copyright", "png", "random"],
)
def test_it_lets_text_through_that_merely_starts_like_pickle_opcodes(tmp_path, text):
    folder = write_model(tmp_path / "model")
    (folder / "notes.dat").write_bytes(text)

    assert inspect_model(folder, DATA_FILES).ok


@pytest.mark.parametrize(
    "stream",
    [
        # os.environ["PYTHONWARNINGS"] = "x"*4000 happens before the bad byte "!".
        b"cos\nenviron\nS'PYTHONWARNINGS'\nX\xa0\x0f\x00\x00" + b"x" * 4000 + b"s!",
        b"cthis\nlove\n!",  # importing `this` prints the Zen of Python
        b"cat\ndog\nsome more words here\n" * 200,  # at.dog: refused, to be safe
    ],
    ids=["import-then-setitem", "import-only", "text-read-as-global"],
)
def test_it_refuses_a_stream_that_imports_even_if_it_never_completes(tmp_path, stream):
    folder = write_model(tmp_path / "model")
    (folder / "optimizer.state").write_bytes(stream)

    with pytest.raises(ModelRejectedError) as refused:
        inspect_model(folder, DATA_FILES)

    assert refused.value.report.codes() == {"pickle-protocol"}


def test_an_import_then_setitem_stream_really_changes_the_imported_object():
    # Why the refusal above is needed: the unpickler acts before it fails.
    stream = b"cos\nenviron\nS'RG_TEST_PICKLE'\nS'set'\ns!"
    os.environ.pop("RG_TEST_PICKLE", None)
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(stream)
    assert os.environ.pop("RG_TEST_PICKLE") == "set"


def test_its_opcode_table_covers_every_pickle_opcode():
    known = {op.code: op.name for op in pickletools.opcodes}

    assert {chr(c): spec[0] for c, spec in pickle_scan._PICKLE_OPS.items()} == known


class RecordingUnpickler(pickle.Unpickler):
    """Imports resolve to a recorder: loading shows what would be called."""

    def find_class(self, module, name):
        return self.record

    def persistent_load(self, pid):
        return self.record

    def record(self, *args, **kwargs):
        raise CallMade


class PyRecordingUnpickler(pickle._Unpickler):  # the pure-Python unpickler
    find_class = RecordingUnpickler.find_class
    persistent_load = RecordingUnpickler.persistent_load
    record = RecordingUnpickler.record


class CallMade(Exception):
    pass


# Tails that call os.getcwd by every route; a prefix decides if they run.
CALL_TAILS = [
    b"cos\ngetcwd\n)R.",
    b"\x8c\x02os\x8c\x06getcwd\x93)R.",
    b"(cos\ngetcwd\no.",
    b"(ios\ngetcwd\n.",
    b"Pid\n)R.",
]
LINES = [b"1", b"0x10", b"010", b"5\x00z", b"\x00a", b"1_000", b"0o7", b" 7 ", b"+ 5"]
LINES += [b"inf", b"1e5", b"1.5\x00z", b"5L", b"'a'", b'"b"', b"'\\x4'", b"\\u12"]
LINES += [b"abc", b"", b"00", b"\xff", b"\xc3\xa9"]


def random_opcode(rng: random.Random) -> bytes:
    """One opcode with a plausible or broken argument; no imports or calls."""
    code = rng.choice(list(pickle_scan._PICKLE_OPS))
    name, arg, _, kind = pickle_scan._PICKLE_OPS[code]
    if kind is not None or name == "STOP":
        return b""
    out = bytes([code])
    if isinstance(arg, int):
        small = name in ("BINGET", "BINPUT", "LONG_BINGET", "LONG_BINPUT", "PROTO")
        small = small or (name == "FRAME" and rng.random() < 0.5)
        out += bytes([rng.randrange(6)]) + b"\0" * (arg - 1) if small else b""
        out += rng.randbytes(arg) if not small else b""
    elif arg in ("line", "line2"):
        lines = 2 if arg == "line2" else 1
        out += b"".join(rng.choice(LINES) + b"\n" for _ in range(lines))
    else:
        _, width, signed = arg
        n = -1 if signed and rng.random() < 0.1 else rng.randrange(6)
        out += n.to_bytes(width, "little", signed=signed)
        payload = [b"x" * 6, b"\xed\xa0\x80\xff\xc3\xa9", rng.randbytes(6)]
        out += rng.choice(payload)[: max(n, 0)]
    return out


def data_pickle_prefix(rng: random.Random) -> bytes:
    """A real data pickle (protocol 0-3, no framing) without its STOP."""
    value = [rng.choice([None, True, 1, -5, 2**70, 1.5, "s", "\u00fc", (1, 2)])]
    value.append({"k": value[:], "t": (value[0],)})
    return pickle.dumps(value, protocol=rng.randrange(4))[:-1]


def test_it_rejects_every_stream_that_an_unpickler_would_call_code_from(tmp_path):
    # The scan must never call a stream invalid that CPython's unpicklers (C
    # and pure Python) still execute: random prefixes, then a call.
    rng = random.Random(2024)
    path = tmp_path / "stream"
    called = 0
    for i in range(3000):
        if i % 3:
            prefix = b"".join(random_opcode(rng) for _ in range(rng.randrange(8)))
        else:
            prefix = data_pickle_prefix(rng)
        data = prefix + rng.choice(CALL_TAILS)
        made = False
        for unpickler in (RecordingUnpickler, PyRecordingUnpickler):
            try:
                unpickler(io.BytesIO(data)).load()
            except CallMade:
                made = True
            except Exception:  # noqa: BLE001 - a stream that fails first is fine
                pass
        if not made:
            continue
        called += 1
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            found = pickle_scan.scan_pickle(FileRange(fd, len(data)))
        finally:
            os.close(fd)
        assert found is not None, data
    assert called > 500  # the prefixes were often valid, and tested


# --- symlinks ------------------------------------------------------------------


def test_it_rejects_an_internal_looking_symlink_that_resolves_outside(tmp_path):
    folder = write_model(tmp_path / "model")
    os.symlink(".", folder / "here")
    # Lexically "here/here/../.." is ".", but "here" is the folder itself.
    os.symlink("here/here/../..", folder / "up")
    policy = DEFAULT_POLICY.replace(allow_internal_symlinks=True)

    with pytest.raises(ModelRejectedError) as caught:
        inspect_model(folder, policy)

    rejected = {f.path for f in caught.value.report.files if f.verdict == "rejected"}
    assert rejected == {"up"}
    assert caught.value.report.codes() == {"symlink-escapes"}


# --- verify-on-load ------------------------------------------------------------


def test_it_refuses_a_planted_file_before_reading_it(tmp_path, keys, monkeypatch):
    folder = write_model(tmp_path / "model")
    result = sign_model(
        folder, folder / "model.sig", release=RELEASE, private_key=keys.private
    )
    (folder / "planted.dat").write_bytes(b"\0" * 4096)  # could be a sparse 1 TB
    read = []
    real_read = verified_load._read_file

    def spy(root_fd, path):
        read.append(path)
        return real_read(root_fd, path)

    monkeypatch.setattr(verified_load, "_read_file", spy)

    with pytest.raises(ManifestMismatchError) as caught:
        read_verified_files(
            folder,
            result.manifest.digest,
            signature_path=folder / "model.sig",
            policy=keys.policy(),
        )

    assert caught.value.extra == ["planted.dat"]
    assert read == []


def test_it_inspects_the_bytes_it_returns_not_only_the_folder_once(tmp_path):
    folder = write_model(tmp_path / "model")
    assert inspect_model(folder).ok
    # Swapped in after inspection, before the approved digest was taken: the
    # safetensors library loads it (last duplicate wins), our parser does not.
    arrays = {"w": np.zeros(2, dtype=np.float32)}
    good = save(arrays)
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])
    entry = json.dumps(header["w"])
    duplicated = raw_safetensors(f'{{"w": {entry}, "w": {entry}}}', good[8 + n :])
    assert set(safetensors.numpy.load(duplicated)) == {"w"}
    (folder / "model.safetensors").write_bytes(duplicated)
    digest = hash_model(folder).digest

    with pytest.raises(ModelRejectedError) as caught:
        read_verified_files(folder, digest)

    assert caught.value.report.codes() == {"duplicate-key"}


# --- command line --------------------------------------------------------------


def test_it_does_not_let_a_signature_named_like_a_config_unsign_that_config(
    tmp_path, keys, capsys
):
    from gpuagent.integrity.__main__ import EXIT_REJECTED, main

    folder = write_model(tmp_path / "model")
    signature = tmp_path / "sigs" / "config.json"
    signature.parent.mkdir()
    # A signer's slip: config.json left out of the manifest.
    sign_model(
        folder,
        signature,
        release=RELEASE,
        private_key=keys.private,
        ignore_paths=("config.json",),
    )
    (folder / "config.json").write_text('{"model_type": "llama", "auto_map": {}}')

    code = main(
        ["verify", str(folder), "--signature", str(signature)]
        + ["--public-key", str(keys.public), "--model", RELEASE.model]
        + ["--version", RELEASE.version, "--recipe", RELEASE.recipe]
    )

    assert code == EXIT_REJECTED
    assert "[ignore-list-rejected]" in capsys.readouterr().err


def test_it_reports_an_unwritable_manifest_output_as_bad_usage(tmp_path, capsys):
    from gpuagent.integrity.__main__ import EXIT_USAGE, main

    folder = write_model(tmp_path / "model")
    output = tmp_path / "no-such-folder" / "manifest.json"

    assert main(["hash", str(folder), "--output", str(output)]) == EXIT_USAGE
    assert "cannot write" in capsys.readouterr().err


# --- folder depth --------------------------------------------------------------


def nest(folder: Path, levels: int) -> None:
    """`levels` folders one inside the other, a file at the bottom (made through
    dir fds: the full path may be longer than PATH_MAX)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=dir_fd)
            sub = os.open("d", os.O_RDONLY, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = sub
        os.close(os.open("x.txt", os.O_CREAT | os.O_WRONLY, dir_fd=dir_fd))
    finally:
        os.close(dir_fd)


def unnest(folder: Path, levels: int) -> None:
    """Removes what `nest` made, bottom up (shutil.rmtree recurses per level)."""
    fds = [os.open(folder, os.O_RDONLY)]
    try:
        for _ in range(levels):
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        os.unlink("x.txt", dir_fd=fds[-1])
        for parent in reversed(fds[:-1]):
            os.close(fds.pop())
            os.rmdir("d", dir_fd=parent)
    finally:
        for fd in fds:
            os.close(fd)


@pytest.fixture
def deep_folder(tmp_path):
    folder = write_model(tmp_path / "model")
    digest = hash_model(folder).digest
    nest(folder, 1500)  # past Python's recursion limit
    yield folder, digest
    unnest(folder, 1500)


def test_it_refuses_a_folder_nested_thousands_deep_with_its_own_error(deep_folder):
    folder, digest = deep_folder

    assert rejected_codes(folder) == {"folder-too-deep"}
    with pytest.raises(UnsafePathError, match="nested deeper"):
        hash_model(folder)
    with pytest.raises(UnsafePathError, match="nested deeper"):
        read_verified_files(folder, digest)


def test_it_accepts_folders_nested_up_to_the_limit(tmp_path):
    depth = DEFAULT_POLICY.limits.max_depth
    folder = write_model(tmp_path / "model")
    nest(folder, depth)

    assert inspect_model(folder).ok
    assert f"{'d/' * depth}x.txt" in hash_model(folder).files()
