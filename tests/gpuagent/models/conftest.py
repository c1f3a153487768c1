"""Shared by the demo model's corpus and training tests: this machine's corpus and
the committed demo model's training report, each read once per session."""

from __future__ import annotations

import pytest

from gpuagent.models import corpus as demo_corpus
from gpuagent.models import train_demo


@pytest.fixture(scope="session")
def corpus() -> demo_corpus.Corpus:
    return demo_corpus.build_corpus()


@pytest.fixture(scope="session")
def committed_report() -> dict:
    report = train_demo.read_committed_report()
    assert report is not None
    return report
