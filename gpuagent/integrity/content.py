"""What a file holds, by content, whatever its name says.

`scan_content` reports pickle-capable content (pickle opcode streams, ZIP
archives: torch's format, HDF5, numpy object arrays, 7z) and looks inside the
containers a loader could unpack on the way to a pickle, the way their readers
do: zlib (joblib's "zlib" and its older "ZF" files), gzip, bzip2, xz and
LZMA-alone (joblib's "lzma"), lz4 frames, zstd, tar (torch's legacy format, with
or without the `ustar` magic) and ZIP members. Each container's content is
decompressed in bounded chunks into a temporary file and scanned the same way,
nested up to `Policy.max_container_depth`, with at most
`Policy.max_decompressed_bytes` decompressed per file and
`Policy.max_archive_members` members: content past a limit is unchecked, so the
file is refused with that limit named.

Every reading of the bytes is tried, not the first that fits: a file may be a
tar whose first member name is a gzip magic and a pickle stream at once.
"""

from __future__ import annotations

import bz2
import io
import lzma
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lz4.frame
import numpy as np
import zstandard

from gpuagent.integrity._fs import FileRange
from gpuagent.integrity.pickle_scan import scan_pickle

HEAD_BYTES = 4096
NPY_MAGIC = b"\x93NUMPY"
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22
# One read a container's reader asks for (a tar's long-name or pax header, a ZIP
# central directory, a .npy header): past this, the request is a hostile length.
_MAX_READ_BYTES = 16 << 20
_CHUNK_BYTES = 1 << 20
# Compressed input fed at a time: what follows a stream's end is copied into the
# next decoder, so small (a file can hold many streams).
_INPUT_BYTES = 64 << 10
_ZEROS = bytes(_INPUT_BYTES)
_TAR_BLOCK = 512

Finding = tuple[str, str]  # (code, detail)


class _LimitReached(Exception):
    """A container is bigger or deeper than the policy lets the scan go."""

    def __init__(self, code: str, detail: str):
        self.code, self.detail = code, detail
        super().__init__(detail)


@dataclass
class _Budget:
    decompressed_bytes: int
    members: int
    max_depth: int


@dataclass
class _Scan:
    """Findings of one file, the first detail kept per code."""

    allow_containers: bool
    budget: _Budget
    findings: dict[str, str] = field(default_factory=dict)

    def add(self, where: str, code: str, detail: str) -> None:
        self.findings.setdefault(code, f"{where}: {detail}" if where else detail)

    def container(self, where: str, code: str, what: str) -> None:
        if not self.allow_containers:
            self.add(where, code, what)


def scan_content(
    source: FileRange,
    *,
    max_decompressed_bytes: int,
    max_depth: int,
    max_members: int,
    allow_containers: bool = False,
) -> list[Finding]:
    """(code, detail) for everything pickle-capable in `source`, at any depth of
    containers. Containers themselves are findings too (archive-gzip,
    archive-other...) unless `allow_containers`; what is inside them always is.
    """
    scan = _Scan(
        allow_containers, _Budget(max_decompressed_bytes, max_members, max_depth)
    )
    _scan(source, "", 0, scan)
    return sorted(scan.findings.items())


def _scan(source: FileRange, where: str, depth: int, scan: _Scan) -> None:
    try:
        _scan_unbounded(source, where, depth, scan)
    except _LimitReached as e:
        scan.add(where, e.code, e.detail)


def _scan_unbounded(source: FileRange, where: str, depth: int, scan: _Scan) -> None:
    head = source.read_at(HEAD_BYTES, 0)
    if head.startswith((_ZIP_LOCAL, _ZIP_END)):
        scan.add(where, "pickle-zip", "ZIP archive (torch .bin/.pt format)")
    if head.startswith(b"7z\xbc\xaf\x27\x1c"):
        scan.add(where, "archive-7z", "7z archive (not inspectable)")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        scan.add(where, "pickle-protocol", f"pickle protocol {head[1]} stream")
    if head.startswith(NPY_MAGIC):
        _check_npy(source, where, scan)
    else:
        found = scan_pickle(source)
        if found is not None:
            scan.add(where, *found)
    for offset in _hdf5_offsets(source.size):
        if source.read_at(len(HDF5_MAGIC), offset) == HDF5_MAGIC:
            scan.add(where, "hdf5", f"HDF5 file (Keras .h5), signature at {offset}")
            break
    zip_end = _zip_end_record(source)
    if zip_end is not None:
        scan.add(
            where,
            "pickle-zip",
            f"ZIP archive (end-of-central-directory record at offset {zip_end})",
        )
        _scan_zip_members(source, where, depth, scan)
    if _is_tar(head):
        scan.container(where, "archive-other", "tar archive")
        _scan_tar_members(source, where, depth, scan)
    for kind in _stream_kinds(head):
        _scan_stream(source, kind, where, depth, scan)


def _hdf5_offsets(size: int) -> Iterator[int]:
    """Where an HDF5 superblock may start: 0, then every power of two from 512
    (the format's user block sizes), while a signature still fits."""
    yield 0
    offset = 512
    while offset + len(HDF5_MAGIC) <= size:
        yield offset
        offset *= 2


def _zip_end_record(source: FileRange) -> int | None:
    """Offset of a ZIP end-of-central-directory record, as zipfile finds one:
    the signature with a whole 22-byte record after it, in the last 64 KiB + 22
    bytes (a comment may follow it), so bytes in front of the archive do not
    hide it. zipfile does not check the comment length against the file's end,
    so neither does this."""
    start = max(source.size - (1 << 16) - _ZIP_END_SIZE, 0)
    tail = source.read_at(source.size - start, start)
    found = tail.rfind(_ZIP_END, 0, max(len(tail) - _ZIP_END_SIZE + len(_ZIP_END), 0))
    return None if found < 0 else start + found


def _check_npy(source: FileRange, where: str, scan: _Scan) -> None:
    # numpy's own header reader uses a safe literal parser, never pickle.
    f = _RangeReader(source)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            _, _, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            _, _, dtype = np.lib.format.read_array_header_2_0(f)
    except Exception as e:  # noqa: BLE001
        scan.add(where, "numpy-invalid", f"unreadable .npy header: {e}")
        return
    if dtype.hasobject:
        scan.add(where, "numpy-object-array", f"numpy array of dtype {dtype}")


# --- archives ------------------------------------------------------------------


def _is_tar(head: bytes) -> bool:
    """Whether tarfile takes the first 512 bytes as a member header: its
    checksum is all it asks (the `ustar` magic is optional: v7 archives and
    torch's legacy format have none)."""
    try:
        tarfile.TarInfo.frombuf(head[:_TAR_BLOCK], "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


def _member(where: str, kind: str, name: str) -> str:
    inside = f"{kind} member {name!r}"
    return f"{where} > {inside}" if where else inside


def _count_member(scan: _Scan) -> None:
    scan.budget.members -= 1
    if scan.budget.members < 0:
        raise _LimitReached(
            "archive-too-many-members",
            "more archive members than the policy's max_archive_members; the "
            "rest is unchecked",
        )


def _deeper(depth: int, scan: _Scan) -> None:
    if depth + 1 > scan.budget.max_depth:
        raise _LimitReached(
            "archive-too-deep",
            f"containers nested deeper than {scan.budget.max_depth}; the inner "
            "content is unchecked",
        )


def _scan_tar_members(source: FileRange, where: str, depth: int, scan: _Scan) -> None:
    """Every member as tarfile reads them (pax and GNU headers included), until
    the archive ends or turns invalid, as it does for its readers."""
    _deeper(depth, scan)
    try:
        archive = tarfile.open(fileobj=_RangeReader(source), mode="r:")
    except tarfile.TarError:
        return
    while True:
        try:
            member = archive.next()
        except (tarfile.TarError, EOFError, UnicodeError):
            return
        if member is None:
            return
        _count_member(scan)
        inside = _member(where, "tar", member.name)
        if not member.isreg() or member.size == 0:
            continue
        if member.sparse is None:
            _scan(source.sub(member.offset_data, member.size), inside, depth + 1, scan)
            continue
        with _spilled(lambda m=member: archive.extractfile(m), scan) as (spill, _):
            _scan(spill, inside, depth + 1, scan)


def _scan_zip_members(source: FileRange, where: str, depth: int, scan: _Scan) -> None:
    _deeper(depth, scan)
    try:
        archive = zipfile.ZipFile(_RangeReader(source))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        return
    with archive:
        for info in archive.infolist():
            _count_member(scan)
            if info.is_dir() or info.file_size == 0:
                continue
            inside = _member(where, "ZIP", info.filename)
            with _spilled(lambda info=info: archive.open(info), scan) as (spill, _):
                _scan(spill, inside, depth + 1, scan)


# --- compressed streams ----------------------------------------------------------


@dataclass(frozen=True)
class _StreamKind:
    name: str
    code: str
    offset: int  # where the stream starts (joblib's "ZF" files have a prefix)
    new_decoder: Callable[[], Any] | None  # None: zstd (see _ZstdReader)
    strong: bool  # a magic no text or data has by chance
    # Whether readers go on to a next stream after one ends, and the runs of
    # NUL bytes they pass between streams, in units of this many bytes (0:
    # none). gzip skips NULs; 18 NULs are an empty LZMA-alone stream, so a run
    # of zeros is passed in bulk rather than one decoder per 18 bytes.
    concatenated: bool = True
    nul_unit: int = 0

    def open(self, source: FileRange, scan: _Scan) -> Any:
        """A reader of the decompressed bytes: `read(n)` and `ended`. Each
        stream after the first counts as an archive member."""
        stream = source.sub(self.offset, source.size)
        if self.new_decoder is None:
            return _ZstdReader(stream)
        return _DecodedReader(stream, self, lambda: _count_member(scan))


class _ZlibDecoder:
    """zlib's decompressobj with the interface of bz2's and lzma's decoders."""

    def __init__(self, wbits: int):
        self._inner = zlib.decompressobj(wbits)
        self._tail = b""

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._inner.decompress(self._tail + data, max_length)
        self._tail = self._inner.unconsumed_tail
        return out

    @property
    def eof(self) -> bool:
        return self._inner.eof

    @property
    def unused_data(self) -> bytes:
        return self._inner.unused_data


def _stream_kinds(head: bytes) -> list[_StreamKind]:
    """Every compressed-stream reading the first bytes allow. Strong magics are
    containers whatever follows; a weak one (a zlib header, LZMA-alone's
    properties byte, a skippable frame) only once its stream decodes."""
    kinds = []
    other = "archive-other"
    if head.startswith(b"\x1f\x8b"):
        # The gzip module skips NULs between members.
        gzip = _StreamKind(
            "gzip stream",
            "archive-gzip",
            0,
            lambda: _ZlibDecoder(31),
            True,
            nul_unit=1,
        )
        kinds.append(gzip)
    if _is_zlib_header(head):
        kinds.append(
            _StreamKind("zlib stream", other, 0, lambda: _ZlibDecoder(15), False)
        )
    # joblib before 0.10: "ZF", the length in hex padded to 19 bytes, then zlib.
    if head.startswith(b"ZF") and _is_zlib_header(head[21:]):
        kinds.append(
            _StreamKind(
                "joblib ZF zlib stream",
                other,
                21,
                lambda: _ZlibDecoder(15),
                False,
                concatenated=False,
            )
        )
    if head.startswith(b"BZh"):
        kinds.append(_StreamKind("bzip2 stream", other, 0, bz2.BZ2Decompressor, True))
    if head.startswith(b"\xfd7zXZ\x00"):
        xz = lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ)  # noqa: E731
        kinds.append(_StreamKind("xz stream", other, 0, xz, True))
    # LZMA-alone (.lzma, joblib's "lzma"): a properties byte below 225, and the
    # range coder's first byte, at 13, is 0 (no text has a NUL there). Its
    # dictionary (up to 4 GiB) is allocated lazily: memory follows the output.
    if len(head) > 13 and head[0] < 225 and head[13] == 0:
        alone = lambda: lzma.LZMADecompressor(lzma.FORMAT_ALONE)  # noqa: E731
        lzma_alone = _StreamKind(
            "LZMA-alone stream", other, 0, alone, False, nul_unit=18
        )
        kinds.append(lzma_alone)
    # lz4 and zstd frames may follow a skippable frame (magic 0x184D2A5?).
    skippable = len(head) >= 4 and head[1:4] == b"\x2a\x4d\x18" and head[0] >> 4 == 5
    if head.startswith(b"\x04\x22\x4d\x18") or skippable:
        lz4_frame = lz4.frame.LZ4FrameDecompressor
        kinds.append(_StreamKind("lz4 frame", other, 0, lz4_frame, not skippable))
    if head.startswith(b"\x28\xb5\x2f\xfd") or skippable:
        kinds.append(_StreamKind("zstd frame", other, 0, None, not skippable))
    return kinds


def _is_zlib_header(head: bytes) -> bool:
    """RFC 1950: deflate with a window of at most 32 KiB, no preset dictionary,
    and a header checksum that divides by 31."""
    if len(head) < 2:
        return False
    cmf, flg = head[0], head[1]
    checksum_ok = (cmf << 8 | flg) % 31 == 0
    return cmf & 0x0F == 8 and cmf >> 4 <= 7 and not flg & 0x20 and checksum_ok


def _scan_stream(
    source: FileRange, kind: _StreamKind, where: str, depth: int, scan: _Scan
) -> None:
    inside = f"{where} > {kind.name}" if where else kind.name
    if depth + 1 > scan.budget.max_depth:
        if kind.strong or kind.open(source, scan).read(1):
            _deeper(depth, scan)
        return
    with _spilled(lambda: kind.open(source, scan), scan) as (spill, ended):
        if not kind.strong and spill.size == 0:
            return  # not this kind of stream after all
        if kind.strong or ended:
            scan.container(where, kind.code, kind.name)
        _scan(spill, inside, depth + 1, scan)


class _DecodedReader:
    """The decompressed bytes of a stream, and of the streams concatenated after
    it as its readers go on to them, in bounded chunks. Decoding stops at the
    first error, as readers do: what came before it is what they returned.
    `ended` tells whether a stream came to its proper end."""

    def __init__(
        self, source: FileRange, kind: _StreamKind, next_stream: Callable[[], None]
    ):
        self._source, self._kind, self._count_stream = source, kind, next_stream
        self._pos = 0
        self._decoder = kind.new_decoder()
        self._feed = b""
        self._done = False
        self.ended = False

    def read(self, max_length: int) -> bytes:
        while not self._done:
            if self._decoder.eof:
                self.ended = True
                if not self._next_stream():
                    break
            try:
                out = self._decoder.decompress(self._feed, max_length)
            except Exception:  # noqa: BLE001 - corrupt: readers raise here
                break
            self._feed = b""
            if out:
                return out
            if self._decoder.eof:
                continue
            self._feed = self._source.read_at(_INPUT_BYTES, self._pos)
            self._pos += len(self._feed)
            if not self._feed:
                break  # truncated: readers fail here, after what they returned
        self._done = True
        return b""

    def _next_stream(self) -> bool:
        if not self._kind.concatenated:
            return False
        rest = self._decoder.unused_data + self._feed
        unit, zeros = self._kind.nul_unit, 0
        while True:
            if unit:
                # A chunk of zeros (all of an all-zero file) compares as memcmp;
                # lstrip walks it byte by byte, 80 times slower.
                zero = len(rest) <= len(_ZEROS) and rest == _ZEROS[: len(rest)]
                stripped = b"" if zero else rest.lstrip(b"\0")
                zeros += len(rest) - len(stripped)
                rest = stripped
            if rest:
                break
            rest = self._source.read_at(_INPUT_BYTES, self._pos)
            self._pos += len(rest)
            if not rest:
                return False
        if unit:
            rest = b"\0" * (zeros % unit) + rest
        # Other streams count as members: a reader decodes each in turn.
        self._count_stream()
        self._decoder = self._kind.new_decoder()
        self._feed = rest
        return True


class _ZstdReader:
    """zstd frames, across frames as zstandard's reader goes. Its decompressobj
    decodes a whole input chunk at once (a 64 KiB chunk of RLE blocks is
    gigabytes), so the bounded stream reader pulls the input itself."""

    def __init__(self, source: FileRange):
        decompressor = zstandard.ZstdDecompressor(max_window_size=1 << 27)
        self._reader = decompressor.stream_reader(
            _RangeReader(source), read_across_frames=True
        )
        self._done = False
        self.ended = False

    def read(self, max_length: int) -> bytes:
        if self._done:
            return b""
        try:
            out = self._reader.read(max_length)
        except zstandard.ZstdError:
            out = b""
        else:
            self.ended = not out
        self._done = not out
        return out


@contextmanager
def _spilled(open_stream: Callable[[], Any], scan: _Scan):
    """(FileRange, ended) of a stream's bytes copied into an anonymous temporary
    file in bounded chunks, counted against the file's decompression budget.
    `ended`: the stream came to its proper end (for decoders that tell)."""
    with tempfile.TemporaryFile(prefix="rg-scan-") as spill:
        try:
            stream = open_stream()
        except _LimitReached:
            raise
        except Exception:  # noqa: BLE001 - a member or stream its reader refuses
            stream = None
        while stream is not None:
            want = min(_CHUNK_BYTES, scan.budget.decompressed_bytes + 1)
            try:
                data = stream.read(want)
            except _LimitReached:
                raise
            except Exception:  # noqa: BLE001 - corrupt content ends the stream
                break
            if not data:
                break
            if len(data) > scan.budget.decompressed_bytes:
                raise _LimitReached(
                    "archive-too-large",
                    "decompresses past the policy's max_decompressed_bytes; the "
                    "rest is unchecked",
                )
            scan.budget.decompressed_bytes -= len(data)
            spill.write(data)
        spill.flush()
        ended = bool(getattr(stream, "ended", False))
        yield FileRange(spill.fileno(), spill.tell()), ended


class _RangeReader(io.RawIOBase):
    """A seekable read-only file over a FileRange, for the stdlib's archive and
    .npy readers; a single read longer than _MAX_READ_BYTES is a hostile length
    (a tar long-name, a ZIP central directory) and a limit reached."""

    def __init__(self, source: FileRange):
        self._source, self._pos = source, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._source.size}
        self._pos = max(base[whence] + offset, 0)
        return self._pos

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._source.size - self._pos
        if size > _MAX_READ_BYTES and self._source.size - self._pos > _MAX_READ_BYTES:
            raise _LimitReached(
                "archive-too-large",
                f"a container's reader asks for {size} bytes at once",
            )
        data = self._source.read_at(size, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
