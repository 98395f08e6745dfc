import pytest

from tiny import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1)


@pytest.fixture(scope="module")
def draft(target):
    # Close to the target so drafts are often (not always) accepted.
    return tiny_model(seed=2, noise_from=target, noise=0.15)
