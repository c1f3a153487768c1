"""Pickles inside containers, found by content whatever the file's name: one
named case per container the readers of model files unpack, each refused for
its reason, and the limits that bound the look inside."""

import bz2
import gzip
import io
import lzma
import pickle
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import lz4.frame
import pytest
import zstandard

from gpuagent.integrity import DEFAULT_POLICY, AllowedFile, ModelRejectedError
from gpuagent.integrity import inspect_model as inspect
from tests.gpuagent.integrity.builders import write_model

# Imports os.getcwd and calls it: what an unpickler runs from these bytes.
PICKLE = b"cos\ngetcwd\n)R."
BENIGN = b"plain text, no pickle here\n" * 50
# The file's name says nothing: every case hides behind the same one.
NAME = "weights.blob"
# Named by the policy, so read (a file refused by name is never read).
NAMED = DEFAULT_POLICY.replace(extra_allowed_files=(AllowedFile(NAME, "data"),))
CONTAINERS = DEFAULT_POLICY.replace(
    extra_allowed_files=(AllowedFile(NAME, "archived data", containers=True),)
)


def tar_bytes(payload: bytes, *, ustar: bool = True, name: str = "pickle") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        t.addfile(info, io.BytesIO(payload))
    data = bytearray(buf.getvalue())
    if not ustar:  # a v7 header, as torch's legacy format may be: no magic
        data[257:265] = b"\0" * 8
        block = data[:512]
        block[148:156] = b" " * 8
        data[148:156] = b"%06o\0 " % sum(block)
    return bytes(data)


def zip_bytes(payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", payload)
    return buf.getvalue()


def joblib_zf(payload: bytes) -> bytes:
    """joblib < 0.10's zlib file: "ZF", the length in hex padded to 19 bytes."""
    return b"ZF" + hex(len(payload)).encode().ljust(19) + zlib.compress(payload)


@dataclass(frozen=True)
class Case:
    name: str
    pack: Callable[[bytes], bytes]
    container_code: str
    where: str  # how the pickle's report names its place


CASES = [
    Case("zlib", zlib.compress, "archive-other", "zlib stream"),
    Case("joblib-zf-zlib", joblib_zf, "archive-other", "joblib ZF zlib stream"),
    Case("gzip", gzip.compress, "archive-gzip", "gzip stream"),
    Case("bzip2", bz2.compress, "archive-other", "bzip2 stream"),
    Case("xz", lzma.compress, "archive-other", "xz stream"),
    Case(
        "lzma-alone",
        lambda d: lzma.compress(d, format=lzma.FORMAT_ALONE),
        "archive-other",
        "LZMA-alone stream",
    ),
    Case("lz4-frame", lz4.frame.compress, "archive-other", "lz4 frame"),
    Case(
        "zstd",
        lambda d: zstandard.ZstdCompressor().compress(d),
        "archive-other",
        "zstd frame",
    ),
    Case("tar-ustar", tar_bytes, "archive-other", "tar member 'pickle'"),
    Case(
        "tar-without-ustar-magic",
        lambda d: tar_bytes(d, ustar=False),
        "archive-other",
        "tar member 'pickle'",
    ),
    Case("zip", zip_bytes, "pickle-zip", "ZIP member 'archive/data.pkl'"),
    Case(
        "tar-in-gzip-holding-zlib",
        lambda d: gzip.compress(tar_bytes(zlib.compress(d), ustar=False)),
        "archive-gzip",
        "gzip stream > tar member 'pickle' > zlib stream",
    ),
    Case(  # the gzip module reads on across members, NUL padding between
        "gzip-members-concatenated",
        lambda d: gzip.compress(d[:5]) + b"\0" * 8 + gzip.compress(d[5:]),
        "archive-gzip",
        "gzip stream",
    ),
    Case(  # LZMA readers go on too, through empty streams (18 NULs each)
        "lzma-alone-after-empty-streams",
        lambda d: b"\0" * (18 * 100_000) + lzma.compress(d, format=lzma.FORMAT_ALONE),
        "archive-other",
        "LZMA-alone stream",
    ),
]


def reasons(folder, policy=NAMED) -> dict[str, str]:
    with pytest.raises(ModelRejectedError) as refused:
        inspect(folder, policy)
    [verdict] = [f for f in refused.value.report.files if f.findings]
    assert verdict.path == NAME
    return {x.code: x.detail for x in verdict.findings}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_it_refuses_a_pickle_inside_the_container_and_says_where(tmp_path, case):
    folder = write_model(tmp_path / "model")
    (folder / NAME).write_bytes(case.pack(PICKLE))

    found = reasons(folder)

    assert found["pickle-protocol"].startswith(case.where + ": pickle opcode"), found
    assert case.container_code in found
    # Containers allowed: the pickle is still refused (and
    # a ZIP, torch's format, whatever it holds).
    zip_code = {"pickle-zip"} & {case.container_code}
    assert set(reasons(folder, CONTAINERS)) == {"pickle-protocol"} | zip_code


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_it_lets_a_container_of_plain_data_through_where_the_policy_allows(
    tmp_path, case
):
    folder = write_model(tmp_path / "model")
    (folder / NAME).write_bytes(case.pack(BENIGN))

    assert case.container_code in reasons(folder)  # not unless the policy says
    if case.container_code != "pickle-zip":  # a ZIP is torch's format: never
        assert inspect(folder, CONTAINERS).ok


@pytest.mark.parametrize("offset", [0, 512, 4096, 1 << 20])
def test_it_finds_hdf5_at_every_power_of_two_offset(tmp_path, offset):
    folder = write_model(tmp_path / "model")
    signature = b"\x89HDF\r\n\x1a\n"
    (folder / NAME).write_bytes(b"\0" * offset + signature + b"\0" * 64)

    assert "hdf5" in reasons(folder, CONTAINERS)


def test_it_refuses_a_decompression_bomb_past_the_limit_unread(tmp_path):
    folder = write_model(tmp_path / "model")
    # An 8 MiB bytes value (BINBYTES8), popped, then the pickle: an unpickler
    # reaches it past a 1 MiB budget.
    padding = b"\x8e" + (8 << 20).to_bytes(8, "little") + b"\0" * (8 << 20) + b"0"
    (folder / NAME).write_bytes(gzip.compress(padding + PICKLE))
    policy = CONTAINERS.replace(max_decompressed_bytes=1 << 20)

    assert set(reasons(folder, policy)) == {"archive-too-large"}
    within = CONTAINERS.replace(max_decompressed_bytes=16 << 20)
    assert set(reasons(folder, within)) == {"pickle-protocol"}


def test_it_refuses_containers_nested_past_the_depth_limit(tmp_path):
    folder = write_model(tmp_path / "model")
    data = BENIGN
    for _ in range(4):
        data = gzip.compress(data)
    (folder / NAME).write_bytes(data)

    assert set(reasons(folder, CONTAINERS.replace(max_container_depth=3))) == {
        "archive-too-deep"
    }
    assert inspect(folder, CONTAINERS.replace(max_container_depth=4)).ok


def test_it_refuses_an_archive_with_more_members_than_the_limit(tmp_path):
    folder = write_model(tmp_path / "model")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for i in range(20):
            info = tarfile.TarInfo(f"m{i}")
            info.size = len(BENIGN)
            t.addfile(info, io.BytesIO(BENIGN))
    (folder / NAME).write_bytes(buf.getvalue())

    assert set(reasons(folder, CONTAINERS.replace(max_archive_members=10))) == {
        "archive-too-many-members"
    }
    assert inspect(folder, CONTAINERS).ok


def test_it_refuses_a_tar_long_name_header_of_hostile_length(tmp_path):
    # A GNU long-name header claiming 1 GiB: tarfile would read it whole.
    folder = write_model(tmp_path / "model")
    header = tarfile.TarInfo("././@LongLink")
    header.type = tarfile.GNUTYPE_LONGNAME
    header.size = 1 << 30
    block = header.tobuf(format=tarfile.GNU_FORMAT)
    with open(folder / NAME, "wb") as f:  # past the 16 MiB a reader may ask
        f.write(block + b"\1" * (20 << 20))

    assert "archive-too-large" in reasons(folder, CONTAINERS)


def test_the_containers_really_hold_what_their_readers_return():
    # The cases are what readers unpack: gzip/bz2/lzma/lz4/zstd and tarfile
    # return the pickle from them.
    for case in CASES[2:8]:
        packed = case.pack(PICKLE)
        opened = {
            "gzip": gzip.decompress,
            "bzip2": bz2.decompress,
            "xz": lzma.decompress,
            "lzma-alone": lzma.decompress,
            "lz4-frame": lz4.frame.decompress,
            "zstd": lambda d: zstandard.ZstdDecompressor().decompress(d),
        }[case.name](packed)
        assert opened == PICKLE, case.name
    raw = tar_bytes(PICKLE, ustar=False)
    assert raw[257:262] != b"ustar"
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as t:
        assert t.extractfile("pickle").read() == PICKLE
    assert pickle.loads(zlib.decompress(joblib_zf(PICKLE)[21:])) is not None
