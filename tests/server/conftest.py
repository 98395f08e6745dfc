"""Fixtures for the server tests: one live server shared by the package."""

from __future__ import annotations

import pytest

from liveserver import make_server


@pytest.fixture(scope="package")
def server():
    with make_server() as live:
        yield live
