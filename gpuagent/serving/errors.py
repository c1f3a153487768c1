"""Errors of the serving layer. Each has a `code` for job results; integrity
refusals keep the missing/extra/changed lists of `gpuagent.integrity`."""

from __future__ import annotations


class ServingError(Exception):
    """A deployment could not be started, checked or stopped."""

    code = "serving-error"


class TemplateError(ServingError):
    """A command template that cannot be run: empty, unparseable, an unknown
    placeholder or preset, a value the preset has no flag for."""

    code = "bad-template"


class DeployRefusedError(ServingError):
    """The artifact is not what was approved (or is quarantined, or does not
    match the recipe): nothing was started. `missing`, `extra` and `changed`
    name files where the check could tell."""

    code = "deploy-refused"

    def __init__(
        self,
        message: str,
        *,
        code: str = "deploy-refused",
        missing: list[str] | None = None,
        extra: list[str] | None = None,
        changed: list[str] | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.missing = list(missing or [])
        self.extra = list(extra or [])
        self.changed = list(changed or [])


class StartError(ServingError):
    """The server process exited, never answered `/health` in time, or another
    server answers on its port; the process group was stopped."""

    code = "start-failed"


class PortTaken(StartError):
    """Another process bound the port between the agent's check and the server's
    bind (two agents or jobs on one host starting servers at once)."""
