"""Fixtures for the server tests: one live server shared by the package."""

from __future__ import annotations

import pytest

from liveserver import make_server
from tiny import torch_threads


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="package")
def server(one_torch_thread):
    with make_server() as live:
        yield live
