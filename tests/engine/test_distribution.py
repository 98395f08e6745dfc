"""Speculative sampling with a draft model leaves the output distribution exactly the target's.

Uses the shared harness in ``tests/distribution.py``: a chi-square test and a marginal TV bound
against the exact plain-sampling distribution; a negative control with a wrong recovery rule must
fail them.
"""

from __future__ import annotations

import copy

import pytest

import verispec.speculative.verify as verify_module
from distribution import PROMPT, SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from tiny import loaded
from verispec import kernels
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.quant import quantize_
from verispec.speculative.draft_model import DraftModelDrafter

K = 2


@pytest.fixture(scope="module")
def models():
    return target_and_draft()


def draft_model_engine(target, draft, draft_vocab_size=None, draft_head_quantization=None) -> Engine:
    vocab = target.config.vocab_size
    drafter = DraftModelDrafter(loaded(draft), vocab, 64, draft_vocab_size=draft_vocab_size,
                                draft_head_quantization=draft_head_quantization)
    return Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=K, adaptive=False),
                  max_model_len=64, drafter=drafter)


# temperature=1.0 and top_p=0.9 run in every suite; the other settings with `make test-long`.
CHAIN_CASES = [name if name in ("temperature=1.0", "top_p=0.9") else pytest.param(name, marks=pytest.mark.long)
               for name in SETTINGS]


@pytest.mark.parametrize("name", CHAIN_CASES)
def test_speculative_sampling_matches_plain_distribution(models, name):
    target, draft = models
    params = SETTINGS[name]
    engine = draft_model_engine(target, draft)
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    acceptance = engine.metrics.acceptance_rate
    print(f"{name}: acceptance {acceptance:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert 0.2 < acceptance < 0.9  # rejections are frequent, so the residual path is exercised
    assert passes(pvalue, tv)


@pytest.mark.parametrize("name", ["temperature=1.0", pytest.param("top_p=0.9", marks=pytest.mark.long)])
def test_chains_of_two_drafts_match_plain_distribution(models, name):
    """Four tokens, so that the first round verifies both of its K = 2 drafts (with three tokens
    a round has room for one): the second draft's test and the residual after it."""
    target, draft = models
    params = SETTINGS[name]
    engine = draft_model_engine(target, draft)
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params, tokens=4)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params, tokens=4))
    per_position = engine.metrics.per_position_acceptance
    print(f"{name}: per-position acceptance {per_position}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert len(per_position) == 2 and 0.05 < per_position[1] < 0.95  # second drafts accepted and rejected
    assert passes(pvalue, tv)


@pytest.fixture(scope="module")
def native_draft(models):
    """The draft on the native kernels (Q4_1 layers, a Q8_0 head), for draft_head_quantization."""
    if not kernels.available():
        pytest.skip("native kernels unavailable (no compiler)")
    return quantize_(copy.deepcopy(models[1]), "int4", native=True)


@pytest.mark.parametrize("head", [None, "int4"], ids=["cut-vocabulary", "int4-head"])
def test_a_cut_or_requantized_draft_head_keeps_the_plain_distribution(models, head, request):
    """``draft_vocab_size``: q is zero on ids 8..15, which the target often samples; those are
    never drafted and always come from the residual. ``draft_head_quantization="int4"``: q comes
    from a head whose weights differ from the draft's own (on the native kernels the cut is
    rounded out to a whole tile of 16 ids, so that draft keeps every id)."""
    target, draft = models
    if head is not None:
        draft = request.getfixturevalue("native_draft")
    params = SETTINGS["temperature=1.0"]
    engine = draft_model_engine(target, draft, draft_vocab_size=8, draft_head_quantization=head)
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    acceptance = engine.metrics.acceptance_rate
    print(f"{request.node.callspec.id}: acceptance {acceptance:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert 0.2 < acceptance < 0.9
    assert passes(pvalue, tv)


@pytest.mark.parametrize("draft_vocab_size,head", [(None, None), (8, None), (8, "int4")],
                         ids=["whole-vocabulary", "cut-vocabulary", "int4-head"])
def test_wrong_recovery_rule_fails_the_same_test(models, monkeypatch, draft_vocab_size, head, request):
    """Negative control: recovering from p instead of normalize(max(p - q, 0)) is biased."""
    target, draft = models
    if head is not None:
        draft = request.getfixturevalue("native_draft")
    monkeypatch.setattr(verify_module, "_recovery_distribution", lambda p, q: p)
    params = SETTINGS["temperature=1.0"]
    engine = draft_model_engine(target, draft, draft_vocab_size, head)
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    print(f"negative control: chi2 p={pvalue:.2e}, max marginal TV={tv:.4f}")
    assert pvalue < 1e-6
    assert not passes(pvalue, tv)


# ---- a chain that stops on its draft values (bind_stop) --------------------------------------

STOP_BELOW = 0.3  # the chain stops after a draft whose path value q(d1) * q(d2) ... falls below


def stopping_engine(target, draft, decisions: list[bool]) -> Engine:
    """k = 2 drafts asked for each round; after the first, the chain goes on only while the
    drawn draft's q is at least ``STOP_BELOW``: a stop that depends on the drawn token."""
    drafter = DraftModelDrafter(loaded(draft), target.config.vocab_size, 64)

    def keep(seq, drafted, value):
        decisions.append(value >= STOP_BELOW)
        return decisions[-1]

    drafter.bind_stop(keep)
    return Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=2, adaptive=False),
                  max_model_len=64, drafter=drafter)


def test_a_chain_that_stops_on_its_drawn_drafts_keeps_the_plain_distribution(models):
    target, draft = models
    params = SETTINGS["temperature=1.0"]
    decisions: list[bool] = []
    engine = stopping_engine(target, draft, decisions)
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params, tokens=4)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params, tokens=4))
    stopped = decisions.count(False) / len(decisions)
    print(f"stopped after the first draft in {stopped:.2f} of {len(decisions)} rounds, "
          f"acceptance {engine.metrics.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert 0.2 < stopped < 0.8  # both chain lengths are common
    assert passes(pvalue, tv)


def test_wrong_recovery_rule_fails_the_four_token_test(models, monkeypatch):
    """Negative control for the test above: the same stopping chain with a biased recovery."""
    target, draft = models
    monkeypatch.setattr(verify_module, "_recovery_distribution", lambda p, q: p)
    params = SETTINGS["temperature=1.0"]
    engine = stopping_engine(target, draft, [])
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params, tokens=4)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params, tokens=4))
    print(f"negative control: chi2 p={pvalue:.2e}, max marginal TV={tv:.4f}")
    assert pvalue < 1e-6
    assert not passes(pvalue, tv)
