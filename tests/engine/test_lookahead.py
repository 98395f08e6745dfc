"""Lookahead decoding through the engine: greedy identity with plain decoding (the lookahead
branch rides in the verify pass and must not change the verified rows), and the sampled
distribution at T=1 (the draft is fixed before the round, so q is one-hot).
"""

from __future__ import annotations

import pytest

from controllers import AlwaysDrafts
from distribution import PROMPT as DIST_PROMPT
from distribution import SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, prompt_ids
from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
LONG_PROMPT = [(5 * i * i + 3) % 48 for i in range(70)] + PROMPT


def lookahead_engine(model, k: int, window: int, ngram: int, guess: int = 4, max_model_len: int = 512) -> Engine:
    config = SpeculativeConfig(method="lookahead", num_speculative_tokens=k, adaptive=False, lookahead_window_size=window,
                               lookahead_ngram_size=ngram, lookahead_guess_set_size=guess)
    return Engine(loaded(model), config, max_model_len=max_model_len)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("window,ngram,k", [(3, 3, 2), (2, 2, 1)])
def test_greedy_output_identical_to_plain(target, prompt, window, ngram, k):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = Engine(loaded(target), max_model_len=512).generate(prompt, params)
    spec = lookahead_engine(target, k, window, ngram).generate(prompt, params)
    assert spec.output_ids == plain.output_ids
    assert spec.text == plain.text
    assert spec.metrics.num_draft_tokens > 0


@pytest.mark.parametrize("price,expected", [(0.0, {True}), (1e9, {True, False})], ids=["pays", "does-not-pay"])
def test_adaptive_lookahead_prices_its_window_and_stays_identical(target, price, expected):
    """With the adaptive controller the engine hands the drafter its cost model and the gate
    judges the window (its price pinned and every round drafting, so nothing hangs on timings): a window
    that pays stays on, one that does not goes off after its probe. The output is plain decoding's
    either way."""
    params = SamplingParams(temperature=0.0, max_tokens=80)
    plain = Engine(loaded(target), max_model_len=512).generate(LONG_PROMPT, params)
    config = SpeculativeConfig(method="lookahead", num_speculative_tokens=6, lookahead_window_size=3,
                               lookahead_ngram_size=3, lookahead_guess_set_size=2)
    engine = Engine(loaded(target), config, max_model_len=512, controller=AlwaysDrafts())
    gate = engine.drafter.gate
    assert gate.costs is engine.controller.costs
    gate.probe, gate.rest = 4, 1000
    gate.cost = lambda num_drafts, window_tokens: price
    used: list[bool] = []
    use = gate.use
    gate.use = lambda: used.append(use()) or used[-1]
    spec = engine.generate(LONG_PROMPT, params)
    assert spec.output_ids == plain.output_ids
    assert set(used) == expected
    if False in used:
        assert used.index(False) >= gate.probe  # not before the probe's rounds
    # Without the controller the window is the user's fixed choice.
    assert lookahead_engine(target, 2, 3, 3).drafter.gate.costs is None


def test_batched_lookahead_requests_stay_identical_to_plain(target):
    """Several requests in one batch share the drafter's gate; each keeps its own window and
    pool (a freed slot's included), and each output stays what plain decoding gives it alone."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = [PROMPT, LONG_PROMPT, [1, 2], PROMPT[::-1]]
    alone = [Engine(loaded(target), max_model_len=512).generate(p, params).output_ids for p in prompts]
    config = SpeculativeConfig(method="lookahead", num_speculative_tokens=5, lookahead_window_size=2,
                               lookahead_ngram_size=3, lookahead_guess_set_size=2)
    engine = Engine(loaded(target), config, max_model_len=512, max_num_seqs=3, controller=AlwaysDrafts())
    engine.drafter.gate.probe, engine.drafter.gate.rest = 3, 5
    seqs = [engine.add_request(p, params) for p in prompts[:3]]
    while engine.running:
        engine.step()
        if len(seqs) < len(prompts) and engine.free_slots:  # the fourth takes a freed slot
            seqs.append(engine.add_request(prompts[3], params))
    assert [s.output_ids for s in seqs] == alone
    assert engine.metrics.num_draft_tokens > 0


def test_full_context_skips_the_branch_and_ends_with_length(target):
    engine = lookahead_engine(target, 3, 4, 4, max_model_len=30)
    seq = engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=100))
    plain = Engine(loaded(target), max_model_len=30).generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=100))
    assert seq.finish_reason == "length" and seq.output_ids == plain.output_ids


def test_sampled_distribution_matches_plain():
    target = target_and_draft()[0]
    params = SETTINGS["temperature=1.0"]
    # Bigrams (N = 2) and k = 2: the second draft is chained through the pool. Four tokens, so
    # that the first round has room for both drafts (with three, for one).
    engine = lookahead_engine(target, 2, 4, 2, guess=2, max_model_len=64)
    counts = sample_counts(lambda p: engine.generate(DIST_PROMPT, p).output_ids, params, tokens=4)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params, tokens=4))
    m = engine.metrics
    print(f"lookahead: {m.num_draft_tokens} drafts, acceptance {m.acceptance_rate:.3f}, "
          f"chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert m.num_draft_tokens > 500 and 0 < m.acceptance_rate < 0.9  # both verdicts are exercised
    assert passes(pvalue, tv)


@pytest.mark.slow
def test_qwen_coder_1_5b_lookahead_identical(qwen_target, qwen_plain):
    config = SpeculativeConfig(method="lookahead", num_speculative_tokens=2, adaptive=False, lookahead_window_size=2,
                               lookahead_ngram_size=3)
    engine = Engine(qwen_target, config, max_model_len=MAX_MODEL_LEN)
    for text in PROMPTS:
        spec = engine.generate(prompt_ids(qwen_target, text), GREEDY)
        assert spec.output_ids == qwen_plain[text], text
    assert engine.metrics.num_draft_tokens > 0
