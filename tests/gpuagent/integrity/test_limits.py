"""The folder's limits and names, one set for every reader: what inspect
refuses by name, length, depth, count and size, hashing and verification refuse
the same way, before reading anything."""

import os
from pathlib import Path

import pytest

from gpuagent.integrity import (
    DEFAULT_POLICY,
    UnsafePathError,
    hash_model,
    inspect_model,
    read_verified_files,
    sign_model,
    verify_model,
)
from gpuagent.integrity.limits import FolderLimits
from tests.gpuagent.integrity.builders import RELEASE, rejected_files, write_model


def plant_git(folder: Path) -> None:
    """A git folder whose config runs a command on `git status` there."""
    (folder / ".git" / "objects").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".git" / "config").write_text(
        "[core]\n\trepositoryformatversion = 0\n\tfsmonitor = touch /tmp/pwned\n"
    )


VCS = {
    ".git": plant_git,
    ".git-file": lambda f: (f / ".git").write_text("gitdir: /elsewhere/.git\n"),
    ".hg": lambda f: (f / ".hg").mkdir() or (f / ".hg" / "hgrc").write_text("[x]"),
    ".svn": lambda f: (f / ".svn").mkdir() or (f / ".svn" / "wc.db").write_bytes(b""),
    ".bzr": lambda f: (f / ".bzr").mkdir(),
    "CVS": lambda f: (f / "sub" / "CVS").mkdir(parents=True),
}


@pytest.mark.parametrize("plant", VCS.values(), ids=list(VCS))
def test_it_refuses_version_control_metadata_without_entering_it(tmp_path, plant):
    folder = write_model(tmp_path / "model")
    plant(folder)

    found = rejected_files(folder)

    [(path, codes)] = found.items()
    assert codes == {"vcs-metadata"}
    assert path.rsplit("/", 1)[-1] in (".git", ".hg", ".svn", ".bzr", "CVS")
    with pytest.raises(UnsafePathError, match="version-control metadata"):
        hash_model(folder)


def test_it_refuses_a_git_folder_planted_in_a_signed_folder_it_would_ignore(
    tmp_path, keys
):
    # model-signing's ignore list leaves .git out of the manifest: refused anyway.
    folder = write_model(tmp_path / "model")
    sign_model(folder, folder / "model.sig", release=RELEASE, private_key=keys.private)
    digest = hash_model(folder, ignore_paths=("model.sig",)).digest
    plant_git(folder)

    with pytest.raises(UnsafePathError, match=r"\.git: version-control"):
        verify_model(folder, folder / "model.sig", keys.policy())
    with pytest.raises(UnsafePathError, match=r"\.git: version-control"):
        read_verified_files(
            folder, digest, signature_path=folder / "model.sig", policy=keys.policy()
        )
    with pytest.raises(UnsafePathError, match=r"\.git: version-control"):
        sign_model(
            folder, tmp_path / "again.sig", release=RELEASE, private_key=keys.private
        )


@pytest.mark.parametrize(
    "path",
    [
        ".cache/huggingface/download/model.safetensors.metadata",
        ".github/workflows/release.yml",
        ".env",
        "sub/.gitattributes",
        "original/.DS_Store",
    ],
)
def test_it_refuses_hidden_files_and_folders_but_a_hub_repos_git_files(tmp_path, path):
    folder = write_model(tmp_path / "model")
    (folder / path).parent.mkdir(parents=True, exist_ok=True)
    (folder / path).write_text("x\n")
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (folder / ".gitignore").write_text("*.tmp\n")
    hidden = next(
        "/".join(path.split("/")[: i + 1])
        for i, part in enumerate(path.split("/"))
        if part.startswith(".")
    )

    assert rejected_files(folder) == {hidden: {"hidden-path"}}
    with pytest.raises(UnsafePathError, match="hidden files and folders"):
        hash_model(folder, "blake3")


def nest_long(folder: Path, levels: int, name_bytes: int) -> str:
    """`levels` folders of `name_bytes`-byte names one inside the other and a
    file at the bottom, made through dir fds (the whole path is past PATH_MAX);
    returns the file's relative path."""
    name = "d" * name_bytes
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=dir_fd)
            sub = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = sub
        fd = os.open("notes.txt", os.O_CREAT | os.O_WRONLY, dir_fd=dir_fd)
        os.write(fd, b"deep\n")
        os.close(fd)
    finally:
        os.close(dir_fd)
    return f"{name}/" * levels + "notes.txt"


def test_it_refuses_a_path_past_path_max_before_hashing_it(tmp_path):
    folder = write_model(tmp_path / "model")
    deep = nest_long(folder, 20, 250)  # 5,029 bytes, 21 levels
    assert len(deep) > 4096

    found = rejected_files(folder)

    assert list(found.values()) == [{"path-too-long"}]
    # Named where the path first passes the limit, and not entered below it.
    assert len(found) == 1 and deep.startswith(next(iter(found)))
    with pytest.raises(UnsafePathError, match="more than the limit of 1024"):
        hash_model(folder)  # was: OSError "File name too long" from model-signing


def test_it_refuses_a_path_that_passes_path_max_with_the_folders_own_path(
    tmp_path,
):
    # The path is under the limit of 1,024 bytes inside the folder, but the
    # folder lies 3,700 bytes deep: a loader opening folder/path would fail.
    base = tmp_path
    while len(os.fsencode(base)) < 3500:
        base = base / ("b" * 200)
    base = base / ("b" * (3700 - len(os.fsencode(base)) - 1))
    folder = write_model(base / "model")
    (folder / ("c" * 250)).mkdir()  # under PATH_MAX; the file in it is not
    inner = "c" * 250 + "/" + "n" * 240 + ".txt"
    fd = os.open(folder / ("c" * 250), os.O_RDONLY)
    try:
        os.close(os.open("n" * 240 + ".txt", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)

    found = rejected_files(folder)

    assert found == {inner: {"path-too-long"}}
    with pytest.raises(UnsafePathError, match="PATH_MAX"):
        hash_model(folder)


@pytest.mark.parametrize(
    ("limits", "plant", "code", "path"),
    [
        (
            FolderLimits(max_name_bytes=20),
            lambda f: (f / ("n" * 20 + ".txt")).write_text("x\n"),
            "name-too-long",
            "n" * 20 + ".txt",
        ),
        (
            FolderLimits(max_depth=2),
            lambda f: (f / "a" / "b" / "c").mkdir(parents=True),
            "folder-too-deep",
            "a/b/c",
        ),
        (
            FolderLimits(max_entries=5),
            lambda f: [(f / f"n{i}.txt").write_text("x\n") for i in range(3)],
            "folder-too-many-files",
            ".",
        ),
        (
            FolderLimits(max_total_bytes=10_000),
            lambda f: (f / "notes.txt").write_text("x" * 10_000),
            "folder-too-large",
            "notes.txt",
        ),
    ],
    ids=["name", "depth", "entries", "total-size"],
)
def test_it_applies_the_policys_folder_limits_to_inspect_and_hash_alike(
    tmp_path, limits, plant, code, path
):
    folder = write_model(tmp_path / "model")
    assert inspect_model(folder).ok
    plant(folder)
    policy = DEFAULT_POLICY.replace(limits=limits)

    assert rejected_files(folder, policy) == {path: {code}}
    with pytest.raises(UnsafePathError):
        hash_model(folder, limits=limits)
    assert hash_model(folder).files()  # within the default limits


def test_it_names_every_refused_path_in_one_error(tmp_path):
    folder = write_model(tmp_path / "model")
    os.symlink("/etc/passwd", folder / "vocab.txt")
    plant_git(folder)
    os.mkfifo(folder / "pipe")

    with pytest.raises(UnsafePathError) as caught:
        hash_model(folder)

    message = str(caught.value)
    assert message.startswith("3 paths refused:")
    for path in (".git: version-control", "pipe is a special", "vocab.txt is a sym"):
        assert path in message
