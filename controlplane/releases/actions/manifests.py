"""A release's signed manifest and its artifacts."""

from django.db import transaction

from controlplane.audit.actions import Actor, do_record_event
from controlplane.errors import Conflict
from controlplane.releases.models import (
    Artifact,
    Release,
)
from gpuagent.protocol import FileDigest


def do_record_manifest(
    release: Release,
    *,
    manifest_digest: str,
    files: list[FileDigest],
    signature: str = "",
    actor: Actor = "system:worker",
) -> Release:
    """Set the release's manifest digest (and signature) and replace its artifacts.
    Refused while an approval is in force (one made since the release was last
    reopened): approvals are bound to the digest."""
    with transaction.atomic():
        locked = Release.objects.select_for_update().get(pk=release.pk)
        approvals = locked.approvals.filter(decision="approve")
        if locked.reopened_at is not None:
            approvals = approvals.filter(created__gt=locked.reopened_at)
        if approvals.exists() and locked.manifest_digest != manifest_digest:
            raise Conflict(f"{locked} is approved for {locked.manifest_digest}")
        before = {"manifest_digest": locked.manifest_digest}
        locked.manifest_digest = manifest_digest
        locked.signature = signature
        locked.save(update_fields=["manifest_digest", "signature", "updated"])
        locked.artifacts.all().delete()
        Artifact.objects.bulk_create(
            Artifact(
                release=locked, path=f.path, size_bytes=f.size_bytes, digest=f.digest
            )
            for f in files
        )
        do_record_event(
            actor,
            "release.manifest_recorded",
            locked,
            before=before,
            after={"manifest_digest": manifest_digest, "files": len(files)},
            team=locked.model.team,
        )
    release.manifest_digest = manifest_digest
    release.signature = signature
    return release
