"""hash_model / hash_folder: agreement with model-signing, golden manifests,
and a manifest digest that covers names and hash parameters."""

import json
import os
from pathlib import Path

import pytest
from model_signing import hashing as ms_hashing

from gpuagent.integrity import (
    HashingError,
    HashSpec,
    IntegrityError,
    Manifest,
    SparseFileError,
    UnsafePathError,
    hash_model,
)
from gpuagent.integrity.manifest import hash_folder
from tests.gpuagent.integrity.builders import ReadFromFile, make_sparse, write_model

GOLDEN = Path(__file__).parent / "golden"
# Golden cases: (file name, algorithm, shard size). Regenerate with
# RG_WRITE_GOLDEN=1 only when the format changes on purpose.
GOLDEN_CASES = [
    ("manifest_sha256.json", "sha256", None),
    ("manifest_sha256_sharded.json", "sha256", 100),
    ("manifest_blake3.json", "blake3", None),
]


def golden_folder(tmp_path: Path) -> Path:
    folder = write_model(tmp_path / "golden-model", sharded=True)
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_bytes(bytes(range(256)) * 3)
    (folder / "empty.txt").write_bytes(b"")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    return folder


@pytest.mark.parametrize(("name", "algorithm", "shard_size"), GOLDEN_CASES)
def test_it_matches_the_golden_manifest(tmp_path, name, algorithm, shard_size):
    manifest = hash_model(golden_folder(tmp_path), algorithm, shard_size=shard_size)

    if os.environ.get("RG_WRITE_GOLDEN"):
        (GOLDEN / name).write_text(json.dumps(manifest.to_dict(), indent=2) + "\n")
    assert manifest.to_dict() == json.loads((GOLDEN / name).read_text())


@pytest.mark.parametrize(
    ("spec", "ms_config"),
    [
        (HashSpec("files", "sha256"), {"hashing_algorithm": "sha256"}),
        (
            HashSpec("shards", "sha256", 100),
            {"hashing_algorithm": "sha256", "shard_size": 100},
        ),
        (HashSpec("files", "blake3"), {"hashing_algorithm": "blake3"}),
    ],
    ids=["sha256", "sha256-sharded", "blake3"],
)
def test_it_hashes_exactly_like_model_signing(tmp_path, spec, ms_config):
    folder = golden_folder(tmp_path)
    config = ms_hashing.Config()
    if spec.method == "shards":
        config.use_shard_serialization(**ms_config)
    else:
        config.use_file_serialization(**ms_config)

    upstream = Manifest.from_model_signing(config.hash(folder))
    ours = hash_folder(
        folder, spec, [".gitattributes", ".git", ".github", ".gitignore"]
    )

    assert ours.resources == upstream.resources
    assert ours.root_digest == upstream.root_digest
    assert len(ours.resources) >= 6


def test_it_changes_the_manifest_digest_when_a_file_is_renamed(tmp_path):
    folder = golden_folder(tmp_path)
    before = hash_model(folder)
    (folder / "sub" / "notes.txt").rename(folder / "sub" / "notes2.txt")

    after = hash_model(folder)

    # model-signing's root digest covers digests only, so it misses a rename.
    assert after.root_digest == before.root_digest
    assert after.digest != before.digest


def test_it_names_every_hash_parameter_in_the_digest(tmp_path):
    folder = golden_folder(tmp_path)

    sharded = hash_model(folder, shard_size=4096)

    assert sharded.digest.startswith("sha256-sharded-4096:")
    assert {r.algorithm for r in sharded.resources} == {"sha256-sharded-4096"}
    assert HashSpec.from_digest_name("sha256-sharded-4096") == sharded.spec
    assert hash_model(folder, "blake3").digest.startswith("blake3:")


def test_it_round_trips_a_manifest_and_catches_an_edited_one(tmp_path):
    manifest = hash_model(golden_folder(tmp_path))
    data = json.loads(json.dumps(manifest.to_dict()))

    assert Manifest.from_dict(data) == manifest
    data["resources"][0]["digest"] = "00" * 32
    with pytest.raises(IntegrityError, match="does not match its content"):
        Manifest.from_dict(data)


def test_it_converts_to_the_model_signing_manifest(tmp_path):
    folder = golden_folder(tmp_path)
    manifest = hash_model(folder, shard_size=100)

    upstream = ms_hashing.Config().use_shard_serialization(shard_size=100).hash(folder)

    assert manifest.to_model_signing() == upstream


def test_it_refuses_symlinks_and_special_files(tmp_path):
    folder = golden_folder(tmp_path)
    os.symlink(folder / "config.json", folder / "link.json")
    with pytest.raises(UnsafePathError):
        hash_model(folder)
    with pytest.raises(UnsafePathError):
        hash_model(folder, "blake3")
    (folder / "link.json").unlink()
    os.mkfifo(folder / "pipe")
    with pytest.raises(UnsafePathError):
        hash_folder(folder, HashSpec(), [])


def test_it_refuses_bad_arguments_with_typed_errors(tmp_path):
    with pytest.raises(HashingError):
        hash_model(tmp_path / "missing")
    with pytest.raises(HashingError):
        hash_model(golden_folder(tmp_path), "md5")
    with pytest.raises(HashingError):
        HashSpec.from_digest_name("sha1")


@pytest.mark.parametrize(
    ("sizes", "cpus", "threaded"),
    [
        ([500, 500, 500, 500], 2, False),  # files keep both cores busy
        ([1900, 50, 25, 25], 2, True),  # one file holds most bytes
        ([2000], 2, True),  # a single file
        ([10, 10], 4, True),  # fewer files than cores
    ],
)
def test_it_gives_blake3_its_own_threads_only_where_files_cannot(sizes, cpus, threaded):
    from gpuagent.integrity.manifest import _blake3_threads

    assert (_blake3_threads(sizes, cpus) != 1) is threaded


def test_it_hashes_blake3_the_same_with_or_without_its_threads(tmp_path):
    import blake3

    from gpuagent.integrity.manifest import _new_hasher

    data = os.urandom(3 << 20)
    digests = set()
    for threads in (1, blake3.blake3.AUTO):
        hasher = _new_hasher("blake3", threads)
        hasher.update(data)
        digests.add(hasher.hexdigest())

    assert digests == {blake3.blake3(data).hexdigest()}


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_it_refuses_a_sparse_file_before_hashing_anything(
    tmp_path, monkeypatch, algorithm
):
    folder = write_model(tmp_path / "model")
    make_sparse(folder / "model.safetensors", 64 << 30)  # its tail: one hole
    from gpuagent.integrity import manifest

    def hashed(*args, **kwargs):
        raise ReadFromFile("hashing started")

    monkeypatch.setattr(manifest, "_hash_range", hashed)
    monkeypatch.setattr(ms_hashing.Config, "hash", hashed)

    with pytest.raises(SparseFileError) as caught:
        hash_model(folder, algorithm)

    assert list(caught.value.paths) == ["model.safetensors"]
    assert "hole" in caught.value.paths["model.safetensors"]
