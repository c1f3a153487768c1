"""Typed errors of the integrity gate.

Every failure the gate can hit -- ours or one raised inside `model_signing`,
`cryptography`, `OpenSSL` or `sigstore` -- reaches the caller as a subclass of
`IntegrityError` with a message a person can act on.
"""

from __future__ import annotations

from typing import Any

from gpuagent.integrity._text import printable, printable_lines


class IntegrityError(Exception):
    """Base class: the folder, manifest or signature is not what was approved.

    Messages quote names from model folders and signatures: `str(error)` and
    `to_dict()` escape every control and bidirectional character in them (our
    own line breaks kept), so no report line can be forged."""

    code = "integrity-error"

    def __str__(self) -> str:
        return printable_lines(super().__str__())

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.code, "message": str(self)}


class ModelRejectedError(IntegrityError):
    """`inspect_model` rejected at least one file; `report` lists every file."""

    code = "model-rejected"

    def __init__(self, report: Any):
        self.report = report
        rejected = [f for f in report.files if f.verdict == "rejected"]
        lines = [f"{len(rejected)} file(s) rejected in {report.folder}:"]
        for verdict in rejected:
            for finding in verdict.findings:
                lines.append(f"  {verdict.path}: [{finding.code}] {finding.detail}")
        super().__init__("\n".join(lines))

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "report": self.report.to_dict()}


class UnsafePathError(IntegrityError):
    """A symlink, special file or path escaping the folder was met while reading."""

    code = "unsafe-path"


class HashingError(IntegrityError):
    """A file could not be read or hashed."""

    code = "hashing-failed"


class SparseFileError(HashingError):
    """Files with holes were found before hashing; `paths` maps each to why."""

    code = "sparse-file"

    def __init__(self, paths: dict[str, str]):
        self.paths = {printable(p): d for p, d in sorted(paths.items())}
        super().__init__(
            f"{len(paths)} sparse file(s) refused before reading:\n"
            + "\n".join(f"  {p}: {d}" for p, d in self.paths.items())
        )

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "paths": self.paths}


class PolicyError(IntegrityError):
    """A manifest or signature uses a setting the policy does not allow."""

    code = "policy-violation"


class IgnoreListError(PolicyError):
    """The signed ignore list leaves out files the policy says must be covered."""

    code = "ignore-list-rejected"

    def __init__(self, message: str, paths: list[str]):
        self.paths = [printable(p) for p in paths]
        super().__init__(message)


class SigningError(IntegrityError):
    """Signing failed (bad key, certificate not matching the key, I/O)."""

    code = "signing-failed"


class SignatureError(IntegrityError):
    """The signature file is unreadable or its signature does not verify."""

    code = "signature-invalid"


class SignerNotTrustedError(SignatureError):
    """The signature verifies, but not with a signer the policy trusts."""

    code = "signer-not-trusted"


class BindingMismatchError(IntegrityError):
    """The signed release binding differs from the release being verified."""

    code = "binding-mismatch"

    def __init__(self, message: str, mismatches: dict[str, tuple[Any, Any]]):
        self.mismatches = mismatches
        super().__init__(message)


class ManifestMismatchError(IntegrityError):
    """The files on disk differ from the signed manifest.

    `missing`: signed but absent; `extra`: present but not signed; `changed`:
    present with a different digest. All three are sorted lists of paths.
    """

    code = "manifest-mismatch"

    def __init__(self, missing: list[str], extra: list[str], changed: list[str]):
        # Signed names can hold anything: kept printable (see IntegrityError).
        self.missing = [printable(p) for p in missing]
        self.extra = [printable(p) for p in extra]
        self.changed = [printable(p) for p in changed]
        missing, extra, changed = self.missing, self.extra, self.changed
        parts = []
        if missing:
            parts.append(f"missing files: {', '.join(missing)}")
        if extra:
            parts.append(f"extra files: {', '.join(extra)}")
        if changed:
            parts.append(f"changed files: {', '.join(changed)}")
        super().__init__(
            "model folder does not match the manifest: " + "; ".join(parts)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "missing": self.missing,
            "extra": self.extra,
            "changed": self.changed,
        }


class ManifestDigestMismatchError(IntegrityError):
    """The manifest computed from the files is not the expected manifest digest."""

    code = "manifest-digest-mismatch"

    def __init__(self, expected: str, actual: str):
        self.expected, self.actual = expected, actual
        super().__init__(
            f"manifest digest mismatch: expected {expected}, files hash to {actual}"
        )
