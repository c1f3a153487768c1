"""The demo model's corpus: text the machine already has, read offline, split into
train and held-out, and as token ids under the byte tokenizer.

- code: the Python standard library's own `.py` files;
- english: the Python reference docs that ship in `pydoc_data.topics`;
- korean: the Korean (`ko`) gettext catalogs of Django and of the system
  (`/usr/share/locale/ko`); half of the training entries are rendered as chat turns
  (English msgid -> Korean msgstr) so the chat template means something.

Every unit (a file, a doc topic, a catalog message) goes to train or held-out by a hash
of its name, not by chance, so the split is the same on any machine that has the unit.

That text, though, is not the same on every machine: the code and English parts come
from the running Python (its standard library and `pydoc_data`), the Korean part from
whichever catalogs Django and the OS packages installed (80 of the shipped model's 93
are the OS's; its corpus is reproduced by Python 3.11.7 with 13 Django and 80 OS
catalogs, `SHIPPED_CORPUS_SOURCES`). `build_corpus` records what it read
(`Corpus.sources`) and `corpus_digests` hashes each part, for `train_demo` to compare
with the shipped model's report before it trains. The training side also calibrates
the compressor (`gpuagent.compress.calibration`).
"""

from __future__ import annotations

import gettext
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import re
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpuagent.engine.tokenizer import SPECIAL_TOKENS

DOMAINS = ("code", "english", "korean")
HELDOUT_PERCENT = 10
SYSTEM_KOREAN_GLOBS = (
    "/usr/share/locale/ko/LC_MESSAGES/*.mo",
    "/usr/share/vim/*/lang/ko/LC_MESSAGES/*.mo",
)
CODE_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "pydoc_data"}
CODE_SKIP_PARTS |= {"encodings", "__pycache__"}  # codec tables are not code to learn


def is_heldout(key: str) -> bool:
    """Stable split: about HELDOUT_PERCENT% of keys are held out, on any machine."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def code_files() -> list[tuple[str, Path]]:
    """(name relative to the stdlib, path) of stdlib modules, sorted."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if CODE_SKIP_PARTS.isdisjoint(rel.parts):
            found.append((rel.as_posix(), path))
    return sorted(found)


def code_docs(heldout: bool) -> list[str]:
    """Stdlib source files on one side of the split."""
    docs = []
    for name, path in code_files():
        if is_heldout(name) == heldout:
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
    return docs


def english_docs(heldout: bool) -> list[str]:
    """Python reference-doc topics (English prose) on one side of the split."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics) if is_heldout(key) == heldout]


def django_korean_catalogs() -> list[Path]:
    """Django's Korean .po catalogs (Django is a project dependency)."""
    # Located, not imported: the agent side never imports Django (layering rule).
    spec = importlib.util.find_spec("django")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(root.rglob("locale/ko/LC_MESSAGES/*.po"))


def system_korean_catalogs() -> list[Path]:
    """Korean .mo catalogs installed by the OS (absent on some machines)."""
    return sorted(
        p for pattern in SYSTEM_KOREAN_GLOBS for p in Path("/").glob(pattern[1:])
    )


def korean_pairs(catalogs: Iterable[Path], heldout: bool) -> list[tuple[str, str]]:
    """(english msgid, korean msgstr) entries of the catalogs on one side of the split.

    Split by msgid so a message translated in two catalogs stays on one side.
    """
    pairs = []
    for path in catalogs:
        entries = _read_po(path) if path.suffix == ".po" else _read_mo(path)
        for msgid, msgstr in entries:
            if msgid and msgstr and is_heldout(msgid) == heldout:
                pairs.append((msgid, msgstr))
    return pairs


def _read_mo(path: Path) -> list[tuple[str, str]]:
    with path.open("rb") as f:
        try:
            catalog = gettext.GNUTranslations(f)._catalog
        except (OSError, UnicodeDecodeError):
            return []
    # plural forms are keyed (msgid, n); keep singular strings only
    entries = [(k, v) for k, v in catalog.items() if isinstance(k, str)]
    return sorted(entries)


def _read_po(path: Path) -> list[tuple[str, str]]:
    # Minimal .po reader: msgid/msgstr with continuation lines; plurals use msgstr[0].
    entries, msgid, msgstr, field = [], None, None, None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("msgid "):
            if msgid is not None and msgstr is not None:
                entries.append((msgid, msgstr))
            msgid, msgstr, field = _po_string(line[6:]), None, "id"
        elif line.startswith("msgstr ") or line.startswith("msgstr[0] "):
            msgstr, field = _po_string(line.split(" ", 1)[1]), "str"
        elif line.startswith('"') and field == "id" and msgid is not None:
            msgid += _po_string(line)
        elif line.startswith('"') and field == "str" and msgstr is not None:
            msgstr += _po_string(line)
        else:
            field = None if not line.startswith('"') else field
    if msgid is not None and msgstr is not None:
        entries.append((msgid, msgstr))
    return entries


def _po_string(quoted: str) -> str:
    return json.loads(quoted) if quoted.startswith('"') else ""


def korean_plain_text(pairs: list[tuple[str, str]]) -> str:
    """The Korean side only, one message per line (what held-out bpb is measured on)."""
    return "\n".join(msgstr for _, msgstr in pairs) + "\n"


def korean_training_text(pairs: list[tuple[str, str]]) -> str:
    # Half the messages as plain Korean lines, half as translation chat turns; which
    # half is decided by the msgid hash, so it is part of the deterministic corpus.
    parts = []
    for msgid, msgstr in pairs:
        if hashlib.sha256(b"chat" + msgid.encode()).digest()[0] % 2:
            parts.append(
                "<|bos|><|user|>\n" + msgid + "<|eos|>\n<|assistant|>\n"
                f"{msgstr}<|eos|>\n"
            )
        else:
            parts.append(msgstr + "\n")
    return "".join(parts)


def heldout_texts(korean_catalogs: Iterable[Path] | None = None) -> dict[str, str]:
    """Held-out text per domain. Korean defaults to Django's + the system catalogs."""
    if korean_catalogs is None:
        korean_catalogs = django_korean_catalogs() + system_korean_catalogs()
    return {
        "code": "\n".join(code_docs(heldout=True)),
        "english": "\n\n".join(english_docs(heldout=True)),
        "korean": korean_plain_text(korean_pairs(korean_catalogs, heldout=True)),
    }


_SPECIAL_BYTES = re.compile(b"|".join(re.escape(t.encode()) for t in SPECIAL_TOKENS))
_SPECIAL_IDS = {t.encode(): 256 + i for i, t in enumerate(SPECIAL_TOKENS)}


def encode_bytes(text: str) -> torch.Tensor:
    """Token ids [N] int64 of `text` under the byte tokenizer: one id per UTF-8 byte
    (id == byte), each special-token string as its special id.

    The ids `build_byte_tokenizer().encode(text, add_special_tokens=False)` gives (the
    tests check both on edge cases and the whole corpus against its recorded digest),
    at a small fraction of its time on the 9 MB code corpus. The special tokens are
    ASCII, so matching them in the UTF-8 bytes matches them in the text.
    """
    data = text.encode("utf-8")
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    matches = list(_SPECIAL_BYTES.finditer(data))
    if matches:
        starts = np.array([m.start() for m in matches], dtype=np.int64)
        ends = np.array([m.end() for m in matches], dtype=np.int64)
        ids[starts] = [_SPECIAL_IDS[m.group()] for m in matches]
        # drop every byte of a match but its first: +1 after its start, -1 at its end
        inside = np.zeros(len(ids) + 1, dtype=np.int64)
        np.add.at(inside, starts + 1, 1)
        np.add.at(inside, ends, -1)
        ids = ids[np.cumsum(inside[:-1]) == 0]
    return torch.from_numpy(ids)


def training_ids(korean_catalogs: list[Path]) -> dict[str, torch.Tensor]:
    """Token ids [N] int64 per domain of the training split."""
    texts = {
        "code": "\n".join(code_docs(heldout=False)),
        "english": "\n\n".join(english_docs(heldout=False)),
        "korean": korean_training_text(korean_pairs(korean_catalogs, heldout=False)),
    }
    return {name: encode_bytes(text) for name, text in texts.items()}


@dataclass
class Corpus:
    """The training split as token ids per domain, and what it was read from."""

    ids: dict[str, torch.Tensor]  # domain -> [N] int64
    korean_catalogs: list[Path]
    sources: dict  # recorded in the report as `corpus_sources`
    stdlib: Path


def build_corpus() -> Corpus:
    """The training corpus of this machine (this Python, these catalogs)."""
    from pydoc_data.topics import topics

    django = django_korean_catalogs()
    system = system_korean_catalogs()
    try:
        django_version = importlib.metadata.version("django")
    except importlib.metadata.PackageNotFoundError:
        django_version = None
    sources = {
        "python": platform.python_version(),
        "code_files": len(code_files()),
        "english_topics": len(topics),
        "django": django_version,
        "korean_catalogs": {"django": len(django), "system": len(system)},
    }
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return Corpus(training_ids(django + system), django + system, sources, stdlib)


def corpus_digests(ids: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each domain's token ids as little-endian int64 bytes."""
    return {
        d: hashlib.sha256(ids[d].numpy().astype("<i8").tobytes()).hexdigest()
        for d in DOMAINS
    }


# What each domain is read from, i.e. what makes it differ between machines.
CORPUS_DEPENDS_ON = {
    "code": "the Python version (its standard library's .py files)",
    "english": "the Python version (its pydoc_data.topics)",
    "korean": "which Korean catalogs are installed: Django's and the OS packages' ("
    + ", ".join(SYSTEM_KOREAN_GLOBS)
    + ")",
}
# The shipped report predates `corpus_sources`; these sources reproduced its digests.
SHIPPED_CORPUS_SOURCES = {
    "python": "3.11.7",
    "code_files": 610,
    "english_topics": 79,
    "django": "5.2.19",
    "korean_catalogs": {"django": 13, "system": 80},
}


def describe_sources(domain: str, sources: dict) -> str:
    """One domain's sources in words, from a `corpus_sources` record."""
    if domain == "code":
        return f"Python {sources['python']}, {sources['code_files']} stdlib .py files"
    if domain == "english":
        return f"Python {sources['python']}, {sources['english_topics']} doc topics"
    found = sources["korean_catalogs"]
    return (
        f"{found['django'] + found['system']} catalogs, {found['django']} from "
        f"Django {sources['django']} and {found['system']} from the OS"
    )
