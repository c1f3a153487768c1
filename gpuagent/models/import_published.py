"""`python -m gpuagent.models.import_published SRC DST`: a code-free copy of a
published model folder whose architecture the engine implements natively
(Kimi K2, DeepSeek-V3, GLM-4.5, Llama), for folders the integrity gate refuses
only for the code they ship.

Published Kimi K2 and DeepSeek-V3 folders carry `*.py` (configuration_deepseek,
modeling_deepseek, Kimi's tokenization_kimi) and name it with `auto_map` in
config.json and tokenizer_config.json. The gate refuses both, rightly: nothing
in a folder that could run code is loaded. The engine needs none of it, so the
import makes DST without it:

- the gate inspects SRC first; every file it admits is carried (safetensors
  weights and their index hard-linked where SRC and DST share a filesystem, else
  copied as a stream and read back against the digest; the rest copied);
- `*.py` (and .pyc...) files are dropped, never read; files refused only by name
  (images...) and hidden folders (`.cache/huggingface`, `.git`) are dropped too,
  unread; any other refusal (a pickle, a native library, a
  symlink, bad content) refuses the import, naming the file, as the gate does;
- JSON with `auto_map` is rewritten without it, every other key as published;
- a tokenizer defined by code (Kimi's tiktoken) becomes tokenizer.json, built
  from its tiktoken.model by `tiktoken_to_hf` for a reviewed tokenizer
  (`tiktoken_patterns`), with tokenizer_class PreTrainedTokenizerFast so
  transformers loads it without remote code; any other one is refused by name;
- `imported_from.json` records the source, each file's sha256, and what was
  dropped, rewritten or produced and why.

DST is written in a temporary folder beside it, must pass `inspect_model` with
the default policy, and is then renamed into place: an error leaves nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuagent.engine.loader import ModelLoadError, check_supported_config
from gpuagent.integrity import ModelRejectedError, inspect_model
from gpuagent.integrity.inspection import FileVerdict, InspectionReport
from gpuagent.models.carry_file import copy_checked, link_or_copy
from gpuagent.models.tiktoken_file import TiktokenFileError
from gpuagent.models.tiktoken_patterns import (
    UnknownTokenizerError,
    custom_tokenizer_named,
    spec_for,
)
from gpuagent.models.tiktoken_to_hf import ConversionError, convert

PROVENANCE_FILE = "imported_from.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# gate findings this import resolves: code files are dropped (never read), files
# refused by name alone are dropped, auto_map is removed from JSON
DROPPED_CODES = {
    "python-file": "Python code: never loaded nor run",
    "file-not-allowed": "not a file a model folder may hold (refused by name, unread)",
    # a download tool's state (.cache/huggingface), version control: never entered
    "hidden-path": "a hidden path: another tool's state, never entered",
    "vcs-metadata": "version-control metadata, never entered",
}
REWRITTEN_CODE = "remote-code-auto_map"
WEIGHT_KINDS = ("safetensors", "index")


class PublishedImportError(ValueError):
    """SRC cannot be imported; the message says which file and why."""


@dataclass
class Provenance:
    source: str
    carried: dict[str, dict[str, str]] = field(default_factory=dict)
    rewritten: dict[str, dict[str, Any]] = field(default_factory=dict)
    produced: dict[str, dict[str, str]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        value = {
            "tool": "gpuagent.models.import_published",
            "source": self.source,
            "carried": self.carried,
            "rewritten": self.rewritten,
            "produced": self.produced,
            "dropped": self.dropped,
        }
        return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def import_published(src: str | Path, dst: str | Path) -> Provenance:
    """Make DST, the code-free import of the published folder SRC (see above)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise PublishedImportError(f"{src} is not a folder")
    if dst.exists() or dst.is_symlink():
        raise PublishedImportError(f"{dst} exists; the import makes a new folder")
    if dst.resolve().is_relative_to(src.resolve()):
        raise PublishedImportError(f"{dst} is inside the source {src}")
    plan = _plan(src, _inspect(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.import-", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would keep a server out
        provenance = _write(src, tmp, plan)
        try:
            inspect_model(tmp)
        except ModelRejectedError as e:  # a bug here, or SRC changed under us
            raise PublishedImportError(f"the import fails the gate: {e}") from None
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return provenance


def _inspect(src: Path) -> InspectionReport:
    try:
        return inspect_model(src)
    except ModelRejectedError as e:
        return e.report


@dataclass
class _Plan:
    carry: list[FileVerdict]
    rewrite: list[str]
    dropped: dict[str, str]
    tokenizer_config: dict[str, Any] | None


def _plan(src: Path, report: InspectionReport) -> _Plan:
    carry, rewrite, dropped, refused = [], [], {}, []
    for verdict in report.files:
        codes = {f.code for f in verdict.findings}
        if verdict.kind == "dir" and not codes:
            continue
        if not codes:
            carry.append(verdict)
        elif len(codes) == 1 and codes <= set(DROPPED_CODES):
            dropped[verdict.path] = DROPPED_CODES[codes.pop()]
        elif codes == {REWRITTEN_CODE} and verdict.kind == "json":
            rewrite.append(verdict.path)
        else:
            refused.extend(
                f"{verdict.path}: [{f.code}] {f.detail}" for f in verdict.findings
            )
    if refused:
        raise PublishedImportError(
            f"{src} holds what the integrity gate refuses and the import does not "
            "drop:\n  " + "\n  ".join(refused)
        )
    for verdict in carry:
        if verdict.kind == "signature":  # it signs SRC's files, not DST's
            dropped[verdict.path] = "a signature of the source's files"
    carry = [v for v in carry if v.kind != "signature"]
    config = _read_json(src, "config.json")  # checked as the engine will read it
    _strip_auto_map(config, nested=True)
    try:
        check_supported_config(config)
    except ModelLoadError as e:
        raise PublishedImportError(f"{src}: {e}") from None
    names = {v.path for v in carry} | set(rewrite)
    tokenizer_config = (
        _read_json(src, TOKENIZER_CONFIG) if TOKENIZER_CONFIG in names else None
    )
    return _Plan(carry, rewrite, dropped, tokenizer_config)


def _read_json(src: Path, name: str) -> dict[str, Any]:
    path = src / name
    if not path.is_file():
        raise PublishedImportError(f"{src} has no {name}")
    value = json.loads(path.read_bytes().decode("utf-8"))  # the gate parsed it
    if not isinstance(value, dict):
        raise PublishedImportError(f"{name} is not a JSON object")
    return value


def _strip_auto_map(value: Any, *, nested: bool, path: str = "$") -> list[str]:
    """Remove every `auto_map` key where the gate looks for one (at any depth in a
    config, at the top elsewhere); the paths removed."""
    removed = []
    if isinstance(value, dict):
        if "auto_map" in value:
            del value["auto_map"]
            removed.append(f"{path}.auto_map")
        children = value.items() if nested else ()
    elif isinstance(value, list) and nested:
        children = ((str(i), v) for i, v in enumerate(value))
    else:
        children = ()
    for key, child in children:
        removed += _strip_auto_map(child, nested=True, path=f"{path}.{key}")
    return removed


def _write(src: Path, tmp: Path, plan: _Plan) -> Provenance:
    provenance = Provenance(source=str(src.resolve()), dropped=dict(plan.dropped))
    for verdict in plan.carry:
        target = tmp / verdict.path
        target.parent.mkdir(parents=True, exist_ok=True)
        if verdict.kind in WEIGHT_KINDS:
            how, digest = link_or_copy(src / verdict.path, target)
        else:
            how, digest = "copied", copy_checked(src / verdict.path, target)
        provenance.carried[verdict.path] = {"sha256": digest, "how": how}
    tokenizer_config = plan.tokenizer_config
    if tokenizer_config is not None and custom_tokenizer_named(tokenizer_config):
        _convert_tokenizer(src, tmp, tokenizer_config, provenance)
    for name in plan.rewrite:
        original = (src / name).read_bytes()
        value = json.loads(original.decode("utf-8"))
        is_config = name.rsplit("/", 1)[-1].endswith("config.json")
        removed = _strip_auto_map(value, nested=is_config)
        why = [
            f"removed {p}: it names code in the folder, which is dropped"
            for p in removed
        ]
        if name == TOKENIZER_CONFIG and TOKENIZER_JSON in provenance.produced:
            value["tokenizer_class"] = FAST_TOKENIZER_CLASS
            why.append(
                f"tokenizer_class {FAST_TOKENIZER_CLASS}: the tokenizer is "
                f"{TOKENIZER_JSON}, made from the tiktoken ranks"
            )
        data = (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        provenance.rewritten[name] = {
            "source_sha256": hashlib.sha256(original).hexdigest(),
            "sha256": hashlib.sha256(data).hexdigest(),
            "why": why,
        }
    (tmp / PROVENANCE_FILE).write_text(provenance.to_json())
    return provenance


def _convert_tokenizer(
    src: Path, tmp: Path, config: dict[str, Any], provenance: Provenance
) -> None:
    try:
        spec = spec_for(config)
    except UnknownTokenizerError as e:
        raise PublishedImportError(f"{TOKENIZER_CONFIG}: {e}") from None
    if TOKENIZER_JSON in provenance.carried:
        raise PublishedImportError(
            f"{src} has {TOKENIZER_JSON} and a {spec.name} tokenizer: which one its "
            "code uses cannot be told without running it"
        )
    if spec.vocab_file not in provenance.carried:
        raise PublishedImportError(f"{src} has no {spec.vocab_file} for {spec.name}")
    ranks = (tmp / spec.vocab_file).read_bytes()
    try:
        tokenizer = convert(ranks, config)
    except (TiktokenFileError, ConversionError, UnknownTokenizerError) as e:
        raise PublishedImportError(f"{spec.vocab_file}: {e}") from None
    data = tokenizer.to_str().encode()
    (tmp / TOKENIZER_JSON).write_bytes(data)
    provenance.produced[TOKENIZER_JSON] = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "from": spec.vocab_file,
        "tokenizer": spec.name,
        "why": "the published tokenizer is code (never run); this is its data",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuagent.models.import_published",
        description="Make a code-free folder from a published Kimi K2 / "
        "DeepSeek-V3 / GLM-4.5 / Llama folder (drops *.py, removes auto_map, "
        "converts a tiktoken tokenizer to tokenizer.json).",
    )
    parser.add_argument("src", type=Path, help="the published folder")
    parser.add_argument("dst", type=Path, help="the folder to make (must not exist)")
    args = parser.parse_args(argv)
    try:
        provenance = import_published(args.src, args.dst)
    except PublishedImportError as e:
        print(f"import refused: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # reading SRC, writing DST (nothing is left of it)
        print(f"import failed: {e}", file=sys.stderr)
        return 1
    print(
        f"imported {args.src} -> {args.dst}: {len(provenance.carried)} carried, "
        f"{len(provenance.rewritten)} rewritten, {len(provenance.produced)} "
        f"produced, {len(provenance.dropped)} dropped (see {PROVENANCE_FILE})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
