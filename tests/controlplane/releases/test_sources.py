import os

import pytest

from controlplane.releases.sources import SourceRefused, resolve_source, source_path


@pytest.fixture
def root(tmp_path):
    (tmp_path / "root" / "team" / "model").mkdir(parents=True)
    return tmp_path / "root"


def test_it_resolves_a_folder_inside_a_root(root):
    folder = root / "team" / "model"

    assert resolve_source(folder.as_uri(), [root]) == (root, folder)
    assert resolve_source(str(folder), [root]) == (root, folder)
    assert resolve_source(f"file://localhost{folder}", [root]) == (root, folder)


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("s3://bucket/model", "scheme 's3' is not supported"),
        ("file://fileserver/srv/model", "names host 'fileserver'"),
        ("file:///srv/model?x=1", "query or a fragment"),
        ("models/llama", "must be an absolute path"),
        ("/srv/a/../b", "'..' segments"),
        ("file:///srv/a/%2e%2e/b", "'..' segments"),
        ("/srv/./b", "'..' segments"),
    ],
)
def test_it_names_what_is_wrong_with_the_uri(uri, problem):
    with pytest.raises(SourceRefused, match=problem.replace("?", r"\?")):
        source_path(uri)


def test_it_refuses_a_folder_outside_the_roots_without_looking_at_it(root, tmp_path):
    with pytest.raises(SourceRefused, match="outside your team's source roots"):
        resolve_source("file:///etc/ssl", [root])
    # The same answer whether or not the folder exists: nothing leaks about it.
    with pytest.raises(SourceRefused, match="outside your team's source roots"):
        resolve_source(str(tmp_path / "no-such-folder"), [root])


def test_it_refuses_a_root_name_prefix_that_is_another_folder(root, tmp_path):
    (tmp_path / "root-other").mkdir()

    with pytest.raises(SourceRefused, match="outside"):
        resolve_source(str(tmp_path / "root-other"), [root])


def test_it_refuses_a_symlink_anywhere_below_the_root(root, tmp_path):
    outside = tmp_path / "elsewhere"
    (outside / "model").mkdir(parents=True)
    os.symlink(outside, root / "team" / "link")
    os.symlink(outside / "model", root / "team" / "model-link")

    for uri in (root / "team" / "link" / "model", root / "team" / "model-link"):
        with pytest.raises(SourceRefused, match="is a symlink"):
            resolve_source(str(uri), [root])


def test_it_refuses_a_missing_folder_and_a_file(root):
    (root / "team" / "file").write_text("x")

    with pytest.raises(SourceRefused, match="team/missing does not exist"):
        resolve_source(str(root / "team" / "missing"), [root])
    with pytest.raises(SourceRefused, match="team/file in .* is not a folder"):
        resolve_source(str(root / "team" / "file"), [root])


def test_it_refuses_everything_when_no_root_is_configured(root):
    with pytest.raises(SourceRefused, match="none configured"):
        resolve_source(str(root / "team" / "model"), [])
