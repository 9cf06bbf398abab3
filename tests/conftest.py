"""Fixtures shared by the suite: the default model, and pdflow servers started by `pdflow run`."""

from __future__ import annotations

import pytest

from pdflow.testing.server import PdflowServer


@pytest.fixture(scope="session")
def model_dir():
    from pdflow.models import resolve

    return resolve("smollm2", progress=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """One `pdflow run` of the default shape (tcp data plane) shared by a test module."""
    with PdflowServer(tmp_path_factory.mktemp("pdflow")) as running:
        yield running
