"""What a model folder may hold: each file's kind by its name, and the format
checks for the kinds no other module parses (text, tokenizer models).

Built in, in this order: safetensors weights and their indexes (any
`*.index.json`: `model.safetensors.index.json`, `pytorch_model.bin.index.json`...,
whatever loader follows it), JSON (configs, tokenizer files, reports: strict,
bounded), tokenizer models by content (sentencepiece protobuf or tiktoken
ranks), text (README, LICENSE, merges.txt, vocab.txt, chat templates, `*.md`,
`*.txt`, the top `.gitattributes` and `.gitignore`) and the signature file. Then
the patterns `Policy.extra_allowed_files` names. Every other file is refused
("file-not-allowed") and, refused by name, never read; the content checks run
on every file admitted all the same (defence in depth). Hidden files and
version-control metadata are refused before this (see `limits`).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import posixpath
import re
import struct

from gpuagent.integrity.limits import ALLOWED_HIDDEN_PATHS
from gpuagent.integrity.policy import SIGNATURE_SUFFIXES, AllowedFile, Policy

# Every loader's index of shards (transformers: model.safetensors.index.json,
# pytorch_model.bin.index.json, tf_model.h5.index.json...): the gate checks
# each, whatever loader would follow it.
INDEX_SUFFIX = ".index.json"
# Tokenizer models in sentencepiece's protobuf format (tiktoken's base64 ranks
# under the same names for Llama 3's original checkpoints, and as tiktoken.model
# in Kimi K2's), checked by content as either.
TOKENIZER_MODEL_NAMES = frozenset(
    {
        "tokenizer.model",
        "tiktoken.model",
        "spiece.model",
        "sentencepiece.model",
        "sentencepiece.bpe.model",
    }
)
# Text a model folder carries: docs, licences, BPE merges and vocabularies,
# chat templates (transformers 5 writes chat_template.jinja and
# additional_chat_templates/*.jinja).
TEXT_PREFIXES = ("readme", "license", "licence", "notice", "copying", "use_policy")
TEXT_SUFFIXES = (".txt", ".md", ".jinja")


def file_kind(path: str, policy: Policy) -> tuple[str, AllowedFile | None]:
    """(kind, the policy's rule or None) of a regular file at `path` (relative,
    posix). Kinds: safetensors, index, json, tokenizer-model, text, signature,
    allowed (named by the policy) and "file" (not allowed)."""
    name = posixpath.basename(path)
    lower = name.lower()
    if name.endswith(".safetensors"):
        return "safetensors", None
    if name.endswith(INDEX_SUFFIX):
        return "index", None
    if path in ALLOWED_HIDDEN_PATHS:
        return "text", None
    if path in policy.signature_names or (
        "/" not in path and name.endswith(SIGNATURE_SUFFIXES)
    ):
        return "signature", None
    if name.endswith(".json"):
        return "json", None
    if name in TOKENIZER_MODEL_NAMES or lower.endswith(".tiktoken"):
        return "tokenizer-model", None
    if lower.startswith(TEXT_PREFIXES) or lower.endswith(TEXT_SUFFIXES):
        return "text", None
    for rule in policy.extra_allowed_files:
        if fnmatch.fnmatchcase(path, rule.pattern):
            return "allowed", rule
    return "file", None


def not_allowed_detail(path: str) -> str:
    return (
        f"{posixpath.basename(path)}: not a file a model folder may hold "
        "(safetensors, JSON, tokenizer models, text, the signature); name it in "
        "Policy.extra_allowed_files to allow it"
    )


# --- text ----------------------------------------------------------------------


def text_problem(data: bytes) -> str | None:
    """Why `data` is not text a person or tokenizer reads, or None: UTF-8 with
    no NUL (a BOM is fine)."""
    nul = data.find(b"\0")
    if nul >= 0:
        return f"NUL byte at offset {nul}: not text"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text: {e}"
    return None


# --- tokenizer models ------------------------------------------------------------

_TIKTOKEN_LINE = re.compile(rb"([A-Za-z0-9+/]*={0,2}) ([0-9]+)")


def tokenizer_model_problem(data: bytes) -> str | None:
    """Why `data` is neither a sentencepiece ModelProto nor a tiktoken rank
    file, or None."""
    sentencepiece = _sentencepiece_problem(data)
    if sentencepiece is None:
        return None
    tiktoken = _tiktoken_problem(data)
    if tiktoken is None:
        return None
    return f"not a sentencepiece model ({sentencepiece}) nor tiktoken ({tiktoken})"


def _tiktoken_problem(data: bytes) -> str | None:
    lines = data.splitlines()
    if not any(lines):
        return "empty"
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        match = _TIKTOKEN_LINE.fullmatch(line)
        if match is None:
            return f"line {number} is not '<base64 token> <rank>'"
        try:
            base64.b64decode(match.group(1), validate=True)
        except binascii.Error:
            return f"line {number}: token is not base64"
    return None


# sentencepiece_model.proto: ModelProto fields 1 pieces, 2 trainer_spec,
# 3 normalizer_spec, 4 self_test_data, 5 denormalizer_spec (all messages),
# extensions from 200; SentencePiece fields 1 piece (string), 2 score (float),
# 3 type (enum), extensions from 1000.
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_MODEL_FIELDS = {1: _LEN, 2: _LEN, 3: _LEN, 4: _LEN, 5: _LEN}
_PIECE_FIELDS = {1: _LEN, 2: _FIXED32, 3: _VARINT}


class _WireError(Exception):
    pass


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _WireError(f"bad varint at {pos}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes, start: int, end: int):
    """(field number, wire type, value start, value end) of a message."""
    pos = start
    while pos < end:
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _WireError(f"field number 0 at {pos}")
        if wire == _VARINT:
            _, value_end = _varint(data, pos)
        elif wire == _FIXED64:
            value_end = pos + 8
        elif wire == _FIXED32:
            value_end = pos + 4
        elif wire == _LEN:
            length, pos = _varint(data, pos)
            value_end = pos + length
        else:
            raise _WireError(f"wire type {wire} (groups) at {pos}")
        if value_end > end:
            raise _WireError(f"field {number} runs past the end")
        yield number, wire, pos, value_end
        pos = value_end


def _sentencepiece_problem(data: bytes) -> str | None:
    pieces = 0
    try:
        for number, wire, start, end in _fields(data, 0, len(data)):
            if number < 200 and _MODEL_FIELDS.get(number) != wire:
                raise _WireError(f"unknown field {number} (wire type {wire})")
            if number != 1:
                continue
            pieces += 1
            for inner, inner_wire, value_start, value_end in _fields(data, start, end):
                if inner < 1000 and _PIECE_FIELDS.get(inner) != inner_wire:
                    raise _WireError(f"piece {pieces}: unknown field {inner}")
                if inner == 1:
                    data[value_start:value_end].decode("utf-8")
                elif inner == 2:
                    struct.unpack("<f", data[value_start:value_end])
    except _WireError as e:
        return str(e)
    except UnicodeDecodeError:
        return f"piece {pieces} is not UTF-8"
    if pieces == 0:
        return "no pieces"
    return None
