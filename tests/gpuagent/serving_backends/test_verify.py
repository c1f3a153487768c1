"""Re-verification of a deployed copy and the rollback-target check: re-hashed now
through gpuagent.integrity, the differing files named."""

import os
import time

from gpuagent.integrity import ReleaseBinding, sign_model
from gpuagent.serving import (
    check_rollback_target,
    deploy,
    reverify,
    reverify_deployment,
)
from tests.gpuagent.integrity.builders import Keys
from tests.gpuagent.serving_backends.conftest import (
    new_marker,
    spec_for,
    stand_in_backend,
)
from tests.gpuagent.serving_backends.test_deploy import flip_a_byte, plant_a_file


def test_it_passes_an_intact_copy(approved):
    result = reverify(approved.folder, approved.digest, approved_files=approved.files)

    assert result.ok and result.manifest_digest == approved.digest
    assert (result.missing, result.extra, result.changed) == ([], [], [])


def test_it_names_a_flipped_byte_and_a_planted_file(approved):
    flip_a_byte(approved.folder)
    plant_a_file(approved.folder)

    result = reverify(approved.folder, approved.digest, approved_files=approved.files)

    assert not result.ok and result.manifest_digest != approved.digest
    assert result.changed == ["model.safetensors"]
    assert result.extra == ["notes.txt"] and result.missing == []


def test_it_fails_without_a_file_list_rather_than_pass(approved):
    flip_a_byte(approved.folder)

    result = reverify(approved.folder, approved.digest)

    assert not result.ok and result.changed == ["*"]


def test_it_takes_the_file_list_from_the_signed_manifest(approved, tmp_path):
    keys = Keys(tmp_path, "publisher")
    release = ReleaseBinding("demo", "1", "weights=bf16,kv=int8")
    signature = approved.folder / "model.sig"
    sign_model(approved.folder, signature, release=release, private_key=keys.private)
    flip_a_byte(approved.folder)
    from gpuagent.integrity.policy import policy_from_flags

    policy = policy_from_flags(
        public_keys_pem=[keys.public_pem], release=release, signature_name="model.sig"
    )

    result = reverify(
        approved.folder, approved.digest, signature_path=signature, policy=policy
    )

    assert not result.ok and result.changed == ["model.safetensors"]


def test_it_fails_for_a_folder_that_is_gone(approved, tmp_path):
    result = reverify(tmp_path / "nowhere", approved.digest)

    assert not result.ok and result.missing == ["*"] and result.error


def test_it_fails_with_the_reason_for_a_planted_symlink(approved):
    (approved.folder / "extra.json").symlink_to("/etc/hostname")

    result = reverify(approved.folder, approved.digest, approved_files=approved.files)

    assert not result.ok and "[unsafe-path]" in result.error
    assert "extra.json" in result.error


def test_it_checks_a_rollback_target_by_rehash_and_health(approved, registry):
    deployed = deploy(
        approved.folder,
        spec_for(approved, stand_in_backend(), served_model_name=new_marker()),
        registry=registry,
    )
    assert deployed.ok, deployed.error
    good = check_rollback_target(deployed.deployment_id, registry=registry)

    flip_a_byte(approved.folder)
    live = reverify_deployment(deployed.deployment_id, registry=registry)
    tampered = check_rollback_target(deployed.deployment_id, registry=registry)
    os.kill(registry.get(deployed.deployment_id).info.pid, 9)
    time.sleep(0.5)
    dead = check_rollback_target(deployed.deployment_id, registry=registry)

    assert good.ok and good.healthy and good.verify.ok
    assert live.changed == ["model.safetensors"]  # from the digests taken at deploy
    assert not tampered.ok and tampered.healthy
    assert "model.safetensors" in tampered.reason
    assert not dead.ok and "not running" in dead.reason


def test_it_passes_an_intact_signed_copy_and_refuses_another_releases_digest(
    approved, tmp_path
):
    keys = Keys(tmp_path, "publisher")
    release = ReleaseBinding("demo", "1", "weights=bf16,kv=int8")
    signature = approved.folder / "model.sig"
    sign_model(approved.folder, signature, release=release, private_key=keys.private)
    from gpuagent.integrity.policy import policy_from_flags

    policy = policy_from_flags(
        public_keys_pem=[keys.public_pem], release=release, signature_name="model.sig"
    )

    intact = reverify(
        approved.folder, approved.digest, signature_path=signature, policy=policy
    )
    other = reverify(
        approved.folder, "sha256:" + "0" * 64, signature_path=signature, policy=policy
    )

    assert intact.ok and intact.manifest_digest == approved.digest
    assert not other.ok and other.manifest_digest == approved.digest
