"""Session-wide fixtures for the real-model tests: each bundled model loads once per session."""

from __future__ import annotations

import pytest

from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, prompt_ids


@pytest.fixture(scope="session")
def smollm():
    from verispec.models.loader import load_model

    return load_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen_target():
    from verispec.models.loader import load_model

    return load_model("qwen2.5-coder-1.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen_draft():
    from verispec.models.loader import load_model

    return load_model("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen_plain(qwen_target) -> dict[str, list[int]]:
    """Plain greedy output ids of the 1.5B target for each prompt in ``realmodels.PROMPTS``."""
    from verispec.engine.engine import Engine

    engine = Engine(qwen_target, max_model_len=MAX_MODEL_LEN)
    out = {text: engine.generate(prompt_ids(qwen_target, text), GREEDY).output_ids for text in PROMPTS}
    assert all(len(ids) > 16 for ids in out.values())
    return out
