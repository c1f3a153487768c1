"""Quick re-verification: digests reused by stat key, re-hashed on any change."""

import json
import os

import pytest

from gpuagent.integrity import ManifestMismatchError, sign_model, verify_model
from gpuagent.integrity import digest_cache as cache_module
from gpuagent.integrity import manifest as manifest_module
from tests.gpuagent.integrity.builders import RELEASE, write_model


@pytest.fixture
def signed(tmp_path, keys, monkeypatch):
    # Files written a moment ago are "racy" (see digest_cache): no window here,
    # the racy rule has its own test.
    monkeypatch.setattr(cache_module, "RACY_WINDOW_S", 0.0)
    folder = write_model(tmp_path / "model", sharded=True)
    sign_model(folder, folder / "model.sig", release=RELEASE, private_key=keys.private)
    return folder


@pytest.fixture
def hashed(monkeypatch):
    """The paths verify reads to hash."""
    paths = []
    real = manifest_module._hash_item

    def spy(root_fd, spec, path, *args):
        paths.append(path)
        return real(root_fd, spec, path, *args)

    monkeypatch.setattr(manifest_module, "_hash_item", spy)
    return paths


def test_it_reuses_every_digest_of_an_unchanged_folder(signed, keys, tmp_path, hashed):
    cache = tmp_path / "cache" / "digests.json"
    first = verify_model(
        signed, signed / "model.sig", keys.policy(), digest_cache=cache
    )
    hashed.clear()

    again = verify_model(
        signed, signed / "model.sig", keys.policy(), digest_cache=cache
    )

    assert first.reused_digests == 0
    assert again.reused_digests == len(again.files) == 5
    assert hashed == []
    assert again.manifest_digest == first.manifest_digest
    assert "5 by digest cache" in again.to_text()


def test_it_rehashes_a_file_edited_in_place_with_its_mtime_put_back(
    signed, keys, tmp_path, hashed
):
    cache = tmp_path / "digests.json"
    verify_model(signed, signed / "model.sig", keys.policy(), digest_cache=cache)
    config = signed / "config.json"
    before = os.stat(config)
    data = bytearray(config.read_bytes())
    data[2] ^= 1  # same size
    config.write_bytes(bytes(data))
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))  # ctime moves
    hashed.clear()

    with pytest.raises(ManifestMismatchError) as caught:
        verify_model(signed, signed / "model.sig", keys.policy(), digest_cache=cache)

    assert caught.value.changed == ["config.json"]
    assert sorted(set(hashed)) == ["config.json"]


def test_it_rehashes_a_file_swapped_for_another_of_the_same_size(
    signed, keys, tmp_path
):
    cache = tmp_path / "digests.json"
    verify_model(signed, signed / "model.sig", keys.policy(), digest_cache=cache)
    tokenizer = signed / "tokenizer.json"
    swapped = signed / "swap.tmp"
    swapped.write_bytes(tokenizer.read_bytes().replace(b"1.0", b"2.0"))
    os.replace(swapped, tokenizer)  # a new inode

    with pytest.raises(ManifestMismatchError) as caught:
        verify_model(signed, signed / "model.sig", keys.policy(), digest_cache=cache)

    assert caught.value.changed == ["tokenizer.json"]


def test_it_does_not_keep_a_file_changed_within_the_racy_window(
    signed, keys, tmp_path, monkeypatch, hashed
):
    monkeypatch.setattr(cache_module, "RACY_WINDOW_S", 3600.0)
    cache = tmp_path / "digests.json"
    verify_model(signed, signed / "model.sig", keys.policy(), digest_cache=cache)
    hashed.clear()

    report = verify_model(
        signed, signed / "model.sig", keys.policy(), digest_cache=cache
    )

    assert report.reused_digests == 0
    assert len(set(hashed)) == 5


def test_it_rehashes_everything_without_a_cache_or_with_a_broken_one(
    signed, keys, tmp_path, hashed
):
    broken = tmp_path / "digests.json"
    broken.write_text('{"format": "releasegate-digest-cache/v1", "entries": [1]}')

    full = verify_model(signed, signed / "model.sig", keys.policy())
    quick = verify_model(
        signed, signed / "model.sig", keys.policy(), digest_cache=broken
    )

    assert full.reused_digests == quick.reused_digests == 0
    assert json.loads(broken.read_text())["entries"]  # rewritten, usable
