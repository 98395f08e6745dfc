"""Suffix decoding through the engine: greedy identity, the cross-request cache, and the
sampled distribution (q is one-hot, so the shared harness checks the deterministic-drafter path).
"""

from __future__ import annotations

import pytest

from distribution import PROMPT as DIST_PROMPT
from distribution import SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, prompt_ids
from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
LONG_PROMPT = [(5 * i * i + 3) % 48 for i in range(70)] + PROMPT


def suffix_engine(model, k: int, max_model_len: int = 512, **options) -> Engine:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=k, adaptive=False, **options)
    return Engine(loaded(model), config, max_model_len=max_model_len)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("k", [1, 6])
def test_greedy_output_identical_to_plain(target, prompt, k):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = Engine(loaded(target), max_model_len=512).generate(prompt, params)
    engine = suffix_engine(target, k, suffix_decoding_max_spec_factor=2.0)
    for _ in range(2):  # the second run also drafts from the first one's cached output
        spec = engine.generate(prompt, params)
        assert spec.output_ids == plain.output_ids
        assert spec.text == plain.text
    assert engine.metrics.num_draft_tokens > 0


@pytest.mark.parametrize("follow_up", ["repeat", "extend"])
def test_follow_up_request_drafts_from_the_global_cache(target, follow_up):
    """A repeated request, or one that extends the first with part of its answer (an agentic
    turn), continues with tokens only the first request's output holds."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    first = Engine(loaded(target), max_model_len=512).generate(PROMPT, params).output_ids
    second = PROMPT if follow_up == "repeat" else PROMPT + first[:8]
    plain = Engine(loaded(target), max_model_len=512).generate(second, params)

    def accepted_on_second(max_cached_requests: int) -> int:
        engine = suffix_engine(target, 6, suffix_decoding_max_cached_requests=max_cached_requests)
        assert engine.generate(PROMPT, params).output_ids == first
        seq = engine.generate(second, params)
        assert seq.output_ids == plain.output_ids
        return seq.metrics.num_accepted_tokens

    with_cache, without_cache = accepted_on_second(10), accepted_on_second(0)
    print(f"{follow_up}: accepted {with_cache} drafts with the global cache, {without_cache} without")
    assert with_cache >= 20 and with_cache > 4 * without_cache


@pytest.fixture(scope="module")
def dist_target():
    return target_and_draft()[0]


def test_sampled_distribution_matches_plain(dist_target):
    name = "temperature=1.0"
    params = SETTINGS[name]
    # min_token_prob 0: draft whatever was seen, so drafts are frequent and often rejected.
    engine = suffix_engine(dist_target, 2, max_model_len=64, suffix_decoding_min_token_prob=0.0,
                           suffix_decoding_max_spec_factor=2.0)
    counts = sample_counts(lambda p: engine.generate(DIST_PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(dist_target, params))
    m = engine.metrics
    print(f"{name}: {m.num_draft_tokens} drafts, acceptance {m.acceptance_rate:.3f}, "
          f"chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert m.num_draft_tokens > 1000 and 0 < m.acceptance_rate < 0.9  # both verdicts are exercised
    assert passes(pvalue, tv)


@pytest.mark.slow
def test_qwen_coder_1_5b_suffix_identical(qwen_target, qwen_plain):
    engine = Engine(qwen_target, SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=False),
                    max_model_len=MAX_MODEL_LEN)
    for text in PROMPTS:
        spec = engine.generate(prompt_ids(qwen_target, text), GREEDY)
        assert spec.output_ids == qwen_plain[text], text
    assert engine.metrics.num_accepted_tokens > 0
