"""Fixtures for the server tests: one live server shared by the package."""

from __future__ import annotations

import pytest
import torch

from liveserver import make_server


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one thread, and far faster on a busy machine (two threads
    spinning against other processes cost 40x here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def server(one_torch_thread):
    with make_server() as live:
        yield live
