"""Typed errors raised by actions; each carries an http-ish `code` that the API and the
dashboard map to a 4xx response without knowing which action raised it."""

from datetime import datetime

from pydantic import ValidationError


class ControlPlaneError(Exception):
    code: int = 400
    slug: str = "bad_request"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict:
        body = {"error": self.slug, "detail": self.message}
        if self.field:
            body["field"] = self.field
        return body


class ValidationFailed(ControlPlaneError):
    code = 422
    slug = "validation_failed"


def validation_failed(exc: ValidationError, prefix: str) -> ValidationFailed:
    """The first error of a pydantic ValidationError, named by its dotted field
    under `prefix` ("recipe.weights"; "" for a field at the top of a body)."""
    first = exc.errors()[0]
    where = ".".join([*([prefix] if prefix else []), *(str(p) for p in first["loc"])])
    return ValidationFailed(f"{where}: {first['msg']}", field=where)


class Forbidden(ControlPlaneError):
    code = 403
    slug = "forbidden"


class SeparationOfDuties(Forbidden):
    slug = "separation_of_duties"


class NotFound(ControlPlaneError):
    code = 404
    slug = "not_found"


class Conflict(ControlPlaneError):
    code = 409
    slug = "conflict"


class IllegalTransition(Conflict):
    slug = "illegal_transition"

    def __init__(
        self, from_state: str, to_state: str, legal_targets: tuple[str, ...]
    ) -> None:
        targets = ", ".join(legal_targets) or "none"
        super().__init__(
            f"illegal release transition {from_state} -> {to_state}; "
            f"legal targets from {from_state}: {targets}"
        )
        self.from_state = from_state
        self.to_state = to_state
        self.legal_targets = legal_targets


class ConflictingRegistration(Conflict):
    slug = "conflicting_registration"


class DigestMismatch(Conflict):
    slug = "manifest_digest_mismatch"


class GatesNoLongerPass(Conflict):
    """An approval found the release's evidence failing the gate policy in force
    (it changed since the gate ran)."""

    slug = "gates_no_longer_pass"


class JobLeaseHeld(Conflict):
    """A job of this kind is running and its worker still holds the lease: another
    task must not start the same work. Tasks catch it and step aside."""

    slug = "job_lease_held"

    def __init__(self, job_id: int, kind: str, lease_expires: datetime) -> None:
        super().__init__(
            f"{kind} job {job_id} is running; its lease expires at "
            f"{lease_expires.isoformat()}"
        )
        self.job_id = job_id
        self.kind = kind
        self.lease_expires = lease_expires
