import pytest

from controlplane.errors import Conflict
from controlplane.releases.actions.manifests import do_record_manifest
from controlplane.releases.actions.promotion import do_reopen_release
from controlplane.releases.actions.transitions import do_transition_release
from controlplane.releases.models import Approval, Release
from gpuagent.protocol import FileDigest
from tests.controlplane.releases.test_transition_release import erase_audit_log

FILES = [
    FileDigest(path="config.json", size_bytes=10, digest="sha256:" + "1" * 64),
    FileDigest(path="model.safetensors", size_bytes=99, digest="sha256:" + "2" * 64),
]


def test_it_records_the_manifest_and_artifacts(release):
    do_record_manifest(release, manifest_digest="sha256:" + "a" * 64, files=FILES)

    stored = Release.objects.get(pk=release.pk)
    assert stored.manifest_digest == "sha256:" + "a" * 64
    assert [a.path for a in stored.artifacts.all()] == [
        "config.json",
        "model.safetensors",
    ]


def test_it_replaces_artifacts_on_a_new_manifest(release):
    do_record_manifest(release, manifest_digest="sha256:" + "a" * 64, files=FILES)

    do_record_manifest(release, manifest_digest="sha256:" + "b" * 64, files=FILES[:1])

    assert release.artifacts.count() == 1


def test_it_refuses_to_change_an_approved_digest(release, teammate):
    do_record_manifest(release, manifest_digest="sha256:" + "a" * 64, files=FILES)
    Approval.objects.create(
        release=release,
        user=teammate,
        decision="approve",
        manifest_digest="sha256:" + "a" * 64,
    )

    with pytest.raises(Conflict):
        do_record_manifest(release, manifest_digest="sha256:" + "b" * 64, files=FILES)


def test_an_approval_from_before_a_reopen_binds_nothing_whatever_the_audit_log_says(
    release, owner, teammate
):
    do_record_manifest(release, manifest_digest="sha256:" + "a" * 64, files=FILES)
    Approval.objects.create(
        release=release,
        user=teammate,
        decision="approve",
        manifest_digest="sha256:" + "a" * 64,
    )
    do_transition_release(release, "failed", actor=owner, reason="deploy failed")
    do_reopen_release(release, owner, reason="rebuilt")
    erase_audit_log()

    do_record_manifest(release, manifest_digest="sha256:" + "b" * 64, files=FILES)

    assert Release.objects.get(pk=release.pk).manifest_digest == "sha256:" + "b" * 64
