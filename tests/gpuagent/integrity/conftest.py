"""Fixtures: one publisher key and one intruder key per session."""

import pytest

from tests.gpuagent.integrity.builders import Keys


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"), "publisher")


@pytest.fixture(scope="session")
def other_keys(tmp_path_factory) -> Keys:
    return Keys(tmp_path_factory.mktemp("keys"), "intruder")
