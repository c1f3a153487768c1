"""scan_pickle against both of CPython's unpicklers: any byte stream either
would import from is refused. The unpicklers run for real, with find_class
recording the import instead of doing it (persistent ids go to a loader's own
hook, not an import: they get a placeholder)."""

import io
import os
import pickle
import tempfile

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuagent.integrity._fs import FileRange
from gpuagent.integrity.pickle_scan import scan_pickle


class Imported(Exception):
    """Raised by the recording hook: nothing is imported or called."""


def _record(self, module, name):
    raise Imported(f"{module}.{name}")


def _placeholder(self, pid):
    return ("persistent", pid)


class CUnpickler(pickle.Unpickler):
    find_class = _record
    persistent_load = _placeholder


class PyUnpickler(pickle._Unpickler):  # joblib's
    find_class = _record
    persistent_load = _placeholder


def imports(data: bytes) -> list[str]:
    """Which readers import from `data`: each unpickler, reading a buffered
    file (as torch.load and joblib do) and the C one from bytes too, calling
    load() again after each complete pickle (torch's legacy format)."""
    found = []
    readers = {
        "C, file": lambda: CUnpickler(io.BufferedReader(io.BytesIO(data))),
        "C, bytes": lambda: CUnpickler(io.BytesIO(data)),
        "Python, file": lambda: PyUnpickler(io.BufferedReader(io.BytesIO(data))),
    }
    for name, make in readers.items():
        unpickler = make()
        try:
            for _ in range(8):
                unpickler.load()
        except Imported:
            found.append(name)
        except Exception:  # noqa: BLE001 - a stream that fails first is fine
            pass
    return found


def scanned(data: bytes):
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        return scan_pickle(FileRange(f.fileno(), len(data)))


# Pieces of pickle streams: data opcodes with plausible and broken arguments,
# marks, memo, frames, imports by every route (with lines cut short), calls.
DATA = [
    b"N", b"\x88", b"K\x05", b"J\x01\x00\x00\x00", b"M\x02\x00", b"I12\n",
    b"I0x10\n", b"L5L\n", b"F1.5\n", b"S'a'\n", b"V\xc3\xa9\n", b"U\x01a",
    b"\x8c\x01a", b"X\x01\x00\x00\x00b", b"C\x01z", b"]", b")", b"}", b"(",
    b"t", b"l", b"d", b"a", b"e", b"s", b"u", b"\x85", b"\x86", b"\x87", b"0",
    b"1", b"2", b"p0\n", b"q\x00", b"h\x00", b"g0\n", b"\x94", b"\x80\x02",
    b"\x80\x04", b"\x95\x05\x00\x00\x00\x00\x00\x00\x00", b".", b"\x8f", b"\x90",
]  # fmt: skip
IMPORTS = [
    b"cos\ngetcwd\n", b"cos\ngetcwd", b"cos\n", b"cos", b"(ios\ngetcwd\n",
    b"ios\ngetcwd\n", b"ios\ngetcwd", b"\x8c\x02os\x8c\x06getcwd\x93",
    b"\x82\x01", b"Pid\n", b"\x8c\x02id\x94Q",
]  # fmt: skip
CALLS = [b"R", b"o", b"b", b"\x81", b"\x92"]
piece = st.sampled_from(DATA + IMPORTS + CALLS)
# Real pickles of values holding globals (protocols 0-5), to mutate.
REAL = [
    pickle.dumps([os.getcwd, {"k": (1, 2.5, "s")}], protocol=p)
    for p in range(pickle.HIGHEST_PROTOCOL + 1)
]


@st.composite
def streams(draw) -> bytes:
    if draw(st.booleans()):
        return b"".join(draw(st.lists(piece, max_size=12)))
    data = bytearray(draw(st.sampled_from(REAL)))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["cut", "flip", "insert"]))
        if action == "cut":
            del data[at:]
        elif action == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(piece)
    return bytes(data)


@settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(streams())
@example(b"cos\ngetcwd")  # GLOBAL's name line cut by the end of the file
@example(b"cos")  # even its module line: the Python one imports "o"
@example(b"ios\ngetcwd\n")  # INST before any MARK
@example(b"\x80\x02cos\ngetcwd\n)R.")
def test_it_refuses_every_stream_either_unpickler_imports_from(data):
    importers = imports(data)
    if importers:
        assert scanned(data) is not None, (data, importers)


@pytest.mark.parametrize(
    ("data", "importers"),
    [
        (b"N0cos\ngetcwd", ["Python, file"]),
        (b"ios\ngetcwd\n", ["Python, file"]),
    ],
    ids=["global-on-a-final-line-without-newline", "inst-before-its-mark"],
)
def test_it_refuses_what_only_the_pure_python_unpickler_imports(data, importers):
    assert imports(data) == importers  # the C unpickler refuses these first

    code, detail = scanned(data)

    assert code == "pickle-protocol"
    assert "imports a module" in detail


def test_it_lets_through_streams_that_neither_unpickler_imports_from():
    # (Protocol 4+ pickles are refused by their frames whatever they hold.)
    for data in [b"N.", pickle.dumps({"a": [1, 2.5]}, protocol=2)[2:], b"# notes\n"]:
        assert imports(data) == []
        assert scanned(data) is None
