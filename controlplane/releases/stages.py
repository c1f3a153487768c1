"""The work behind each pipeline stage, as far as it exists today.

Each returns (result dict, error message or ""). Stages whose agent work is not built
yet say so in their result, so the job rows still carry real start/finish times and
the pipeline already has its final shape.

verify_source and sign run `gpuagent.integrity` (torch-free) in the control-plane
worker on a local folder (file:// URI or path). Until compression exists the
candidate is the source folder itself, so its manifest is the one approvals bind to.
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from controlplane.releases import actions
from gpuagent.protocol import FileDigest

NOT_BUILT = "no agent work for this stage yet"


def local_path(source_uri: str) -> Path | None:
    """The folder behind a file:// URI or a plain path; None for remote schemes."""
    parsed = urlparse(source_uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and source_uri:
        return Path(source_uri)
    return None


def verify_source(release) -> tuple[dict, str]:
    from gpuagent.integrity import IntegrityError, inspect_model

    path = local_path(release.source_uri)
    if path is None:
        return {"skipped": f"no verifier for {release.source_uri!r} yet"}, ""
    if not path.is_dir():
        return {}, f"source folder {path} does not exist"
    try:
        report = inspect_model(path)
    except IntegrityError as exc:
        report = getattr(exc, "report", None)
        return ({"report": report.to_dict()} if report else {}), str(exc)
    return {"report": report.to_dict()}, ""


def compress(release) -> tuple[dict, str]:
    return {"skipped": NOT_BUILT, "recipe": release.recipe}, ""


def _file_digests(path: Path):
    """(manifest, [FileDigest]) for a local folder, through gpuagent.integrity."""
    from gpuagent.integrity import hash_model

    manifest = hash_model(path)
    files = []
    for relpath, resources in manifest.files().items():
        digest = (
            f"{resources[0].algorithm}:{resources[0].digest}"
            if len(resources) == 1
            else f"shards:{len(resources)}"
        )
        size = os.stat(path / relpath).st_size
        files.append(FileDigest(path=relpath, size_bytes=size, digest=digest))
    return manifest, files


def sign(release) -> tuple[dict, str]:
    """Hash the candidate and record its manifest (signing keys: later issue)."""
    from gpuagent.integrity import IntegrityError

    path = local_path(release.source_uri)
    if path is None:
        return {"skipped": f"no hasher for {release.source_uri!r} yet"}, ""
    try:
        manifest, files = _file_digests(path)
    except IntegrityError as exc:
        return {}, str(exc)
    actions.do_record_manifest(release, manifest_digest=manifest.digest, files=files)
    return {
        "manifest_digest": manifest.digest,
        "files": len(files),
        "size_bytes": sum(f.size_bytes for f in files),
        "signature": "skipped: no signing key configured yet",
    }, ""


def reverify(release) -> tuple[dict, str]:
    """Re-hash the deployed copy and compare it with the approved artifacts; the
    error names every missing, extra and changed file."""
    from gpuagent.integrity import IntegrityError
    from gpuagent.integrity.manifest import diff_files

    path = local_path(release.source_uri)
    if path is None or not release.manifest_digest:
        return {"skipped": "no local copy with a recorded manifest"}, ""
    try:
        manifest, files = _file_digests(path)
    except IntegrityError as exc:
        return {}, str(exc)
    missing, extra, changed = diff_files(
        {a.path: a.digest for a in release.artifacts.all()},
        {f.path: f.digest for f in files},
    )
    result = {
        "expected_manifest_digest": release.manifest_digest,
        "manifest_digest": manifest.digest,
        "missing": missing,
        "extra": extra,
        "changed": changed,
    }
    if manifest.digest == release.manifest_digest:
        return result, ""
    problems = [
        f"{label}: {', '.join(result[label])}"
        for label in ("missing", "extra", "changed")
        if result[label]
    ]
    return result, "manifest digest mismatch; " + ("; ".join(problems) or "?")


def evaluate(release) -> tuple[dict, str]:
    return {"skipped": NOT_BUILT}, ""


def deploy(release, deployment) -> tuple[dict, str]:
    return {"skipped": NOT_BUILT, "environment": deployment.environment.name}, ""
