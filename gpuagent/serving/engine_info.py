"""Which engine a running server is, as evidence names it: the name and version it
reports over its OpenAI-compatible API (`/v1/models` owned_by, `/version`: what
vLLM and the project's engine both answer) and the command line the agent started
it with (secrets already replaced by `templates.redacted_command`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath
from typing import Literal

import httpx

from gpuagent.protocol import ServingEngine


def program_name(command: Sequence[str]) -> str:
    """The program a command line runs: `python -m pkg` -> pkg, `python x.py` ->
    x.py, else argv[0]'s file name ("" for an empty command)."""
    if not command:
        return ""
    program = PurePath(command[0]).name
    if program.startswith("python") and len(command) >= 2:
        if command[1] == "-m" and len(command) >= 3:
            return command[2]
        if not command[1].startswith("-"):
            return PurePath(command[1]).name
    return program


def describe_server(
    base_url: str,
    backend: Literal["engine", "external"],
    command: Sequence[str],
    model: str | None = None,
    timeout_s: float = 10.0,
) -> ServingEngine:
    """The ServingEngine of the server at `base_url`: the name its model card
    gives (`owned_by` of `model`, else of the first card; the program's name when
    it gives none) and the version `/version` reports ("" where it has none)."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    name, version = "", ""
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        try:
            cards = client.get("/v1/models").json().get("data") or []
            card = next((c for c in cards if c.get("id") == model), None)
            card = card or (cards[0] if cards else {})
            name = str(card.get("owned_by") or "")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        try:
            reply = client.get("/version")
            if reply.status_code == 200:
                version = str(reply.json().get("version") or "")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    return ServingEngine(
        name=name or program_name(command) or "unknown",
        version=version,
        backend=backend,
        command=list(command),
    )
