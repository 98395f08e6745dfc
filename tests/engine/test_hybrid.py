"""``enable_suffix_decoding``: suffix drafts first, the draft model otherwise, output unchanged."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import verispec.speculative.verify as verify_module
from distribution import PROMPT as DIST_PROMPT
from distribution import SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.base import Drafter, DrafterContext, Outcome, Proposal
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.hybrid import SuffixFirstDrafter
from verispec.speculative.registry import draft_model_drafter
from verispec.speculative.suffix import SuffixDraft

# Repeats, so the suffix trie has something to draft from; the draft model drafts the rest.
PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7, 9, 11, 5, 3]


def hybrid_config(k: int = 4, min_score: float = 1.0, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, enable_suffix_decoding=True,
                             suffix_decoding_min_score=min_score, **kw)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_output_identical_to_plain_with_both_drafters_used(target, draft, k, adaptive):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = Engine(loaded(target), max_model_len=256).generate(PROMPT, params)
    config = hybrid_config(k, adaptive=adaptive)
    drafter = draft_model_drafter(loaded(draft), config, DrafterContext(loaded(target), 256))
    assert isinstance(drafter, SuffixFirstDrafter) and isinstance(drafter.fallback, DraftModelDrafter)
    engine = Engine(loaded(target), config, max_model_len=256, drafter=drafter)
    for _ in range(2):  # the second request also drafts from the first one's output (the global trie)
        spec = engine.generate(PROMPT, params)
        assert spec.output_ids == plain.output_ids
    if not adaptive:  # (the adaptive controller may find that no drafting pays for a tiny model)
        assert drafter.suffix_rounds > 0 and drafter.fallback_rounds > 0
        assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


def test_a_suffix_draft_below_the_score_goes_to_the_draft_model(target, draft):
    """min_score decides: the same request drafts from the draft model alone when no suffix
    draft can reach it, and from the trie alone when every found draft does."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    counts = {}
    for min_score in (1e-6, 1e6):
        drafter = draft_model_drafter(loaded(draft), hybrid_config(4, min_score, adaptive=False),
                                      DrafterContext(loaded(target), 256))
        engine = Engine(loaded(target), hybrid_config(4, min_score, adaptive=False), max_model_len=256,
                        drafter=drafter)
        engine.generate(PROMPT, params)
        counts[min_score] = (drafter.suffix_rounds, drafter.fallback_rounds)
    assert counts[1e6][0] == 0 and counts[1e6][1] > 0
    assert counts[1e-6][0] > 0 and counts[1e-6][0] > counts[1e6][0]


def test_feedback_and_finish_reach_both_drafters(target, draft):
    drafter = draft_model_drafter(loaded(draft), hybrid_config(), DrafterContext(loaded(target), 256))
    calls = []
    for name in ("suffix", "fallback"):
        inner = getattr(drafter, name)
        for method in ("start", "feedback", "finish", "calibrate", "reads_prompts_as", "bind_costs", "bind_stop"):
            real = getattr(inner, method)
            setattr(inner, method, lambda *a, _r=real, _n=(name, method), **kw: calls.append(_n) or _r(*a, **kw))
    engine = Engine(loaded(target), hybrid_config(), max_model_len=256, drafter=drafter)
    engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=20))
    for method in ("start", "feedback", "finish"):
        assert calls.count(("suffix", method)) == calls.count(("fallback", method)) > 0
    # the draft model's own capabilities are the engine's to use (calibration, how to read
    # prompts, the cost model, the stop within a round): each reaches it once, and none the trie
    for method in ("calibrate", "reads_prompts_as", "bind_costs", "bind_stop"):
        assert calls.count(("fallback", method)) == 1 and ("suffix", method) not in calls, method
    assert drafter.hidden_layers is None and drafter.stops_within_round is DraftModelDrafter.stops_within_round


def test_a_draft_model_that_sat_out_rounds_catches_up(target, draft):
    """After suffix rounds the draft model's cache lags the sequence; its next draft reads the
    missed tokens first, so it proposes what it would have with no suffix rounds at all."""
    params = SamplingParams(temperature=0.0, max_tokens=30)
    alone = DraftModelDrafter(loaded(draft), target.config.vocab_size, 256)
    hybrid = draft_model_drafter(loaded(draft), hybrid_config(3, 1e-6, adaptive=False),
                                 DrafterContext(loaded(target), 256))
    engine = Engine(loaded(target), hybrid_config(3, 1e-6, adaptive=False), max_model_len=256, drafter=hybrid)
    seq = engine.add_request(PROMPT, params)
    while not seq.finished and hybrid.suffix_rounds < 3:
        engine.step()
    assert hybrid.suffix_rounds >= 3 and not seq.finished
    alone.start(seq)
    expected = alone.propose(seq, 3).tokens
    assert hybrid.fallback.propose(seq, 3).tokens == expected
    hybrid.fallback.feedback(seq, Outcome(3, 0, []))  # the round this test opened, closed unused
    engine.abort(seq)


class _Stub(Drafter):
    """A drafter that proposes ``tokens`` and counts its calls; as a suffix drafter, its drafts
    score ``score``."""

    def __init__(self, tokens, score=0.0):
        self.tokens, self.score, self.proposed = tokens, score, 0

    def draft(self, seq, k):
        return SuffixDraft(self.tokens[:k], self.score, 4)

    def propose(self, seq, k):
        self.proposed += 1
        return Proposal(self.tokens[:k])

    def start(self, seq):
        pass

    def feedback(self, seq, outcome):
        pass

    def finish(self, seq):
        pass


def test_a_request_whose_suffix_drafts_fail_hands_its_rounds_to_the_draft_model():
    suffix, model = _Stub([5, 6, 7], score=3.0), _Stub([9, 9, 9])
    drafter = SuffixFirstDrafter(suffix, model, min_score=2.0)
    seq, other = SimpleNamespace(slot=0), SimpleNamespace(slot=1)
    drafter.start(seq)
    drafter.start(other)
    rounds = []
    for _ in range(4):
        proposal = drafter.propose(seq, 3)
        rounds.append(proposal.tokens)
        drafter.feedback(seq, Outcome(3, 0, [1]))  # every draft rejected
    # score 3 x calibration: 1, then 0.7, then 0.49 (< 2/3): the draft model from the third round
    assert rounds == [[5, 6, 7], [5, 6, 7], [9, 9, 9], [9, 9, 9]]
    assert drafter.propose(other, 3).tokens == [5, 6, 7]  # another request keeps its own calibration
    drafter.feedback(other, Outcome(3, 3, [5, 6, 7, 8]))
    assert drafter.propose(other, 3).tokens == [5, 6, 7]
    drafter.finish(seq)
    drafter.start(seq)  # the slot's next request starts afresh
    assert drafter.propose(seq, 3).tokens == [5, 6, 7]


def test_config_checks():
    with pytest.raises(ValueError, match="enable_suffix_decoding combines suffix decoding"):
        SpeculativeConfig(method="ngram", enable_suffix_decoding=True)
    with pytest.raises(ValueError, match="enable_suffix_decoding must be true or false"):
        SpeculativeConfig(method="draft_model", enable_suffix_decoding="yes")
    with pytest.raises(ValueError, match="suffix_decoding_min_score must be > 0"):
        hybrid_config(min_score=0)
    assert SpeculativeConfig.from_json('{"method": "draft_model", "model": "m", "enable_suffix_decoding": true, '
                                       '"suffix_decoding_min_score": 1.5}').suffix_decoding_min_score == 1.5


# ---- the sampled distribution --------------------------------------------------------------

MIN_SCORE = 0.5  # low enough that the trie of earlier outputs drafts in many rounds


@pytest.fixture(scope="module")
def dist_models():
    return target_and_draft()


def dist_engine(target, draft):
    config = hybrid_config(2, MIN_SCORE, adaptive=False, suffix_decoding_max_cached_requests=200)
    drafter = draft_model_drafter(loaded(draft), config, DrafterContext(loaded(target), 64))
    return Engine(loaded(target), config, max_model_len=64, drafter=drafter), drafter


@pytest.mark.parametrize("wrong_recovery", [False, True], ids=["exact", "negative-control"])
def test_sampled_output_keeps_the_plain_distribution(dist_models, wrong_recovery, monkeypatch):
    """Suffix rounds (q one-hot) and draft-model rounds (q the draft's) in the same run; the
    negative control recovers from p instead of the residual and must fail the same test."""
    target, draft = dist_models
    if wrong_recovery:
        monkeypatch.setattr(verify_module, "_recovery_distribution", lambda p, q: p)
    params = SETTINGS["temperature=1.0"]
    engine, drafter = dist_engine(target, draft)
    with torch.inference_mode():
        counts = sample_counts(lambda p: engine.generate(DIST_PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    share = drafter.suffix_rounds / (drafter.suffix_rounds + drafter.fallback_rounds)
    print(f"suffix rounds {share:.2f}, acceptance {engine.metrics.acceptance_rate:.3f}, chi2 p={pvalue:.2e}, TV={tv:.4f}")
    assert 0.2 < share < 0.8  # both kinds of round are exercised
    if wrong_recovery:  # (p = 6e-7 and TV 0.043 here: most rounds' drafts are rejected either way)
        assert pvalue < 1e-4 and not passes(pvalue, tv)
    else:
        assert 0.1 < engine.metrics.acceptance_rate < 0.9  # drafts are kept and rejected
        assert passes(pvalue, tv)


def test_the_plain_config_is_unchanged(target, draft):
    config = dataclasses.replace(hybrid_config(), enable_suffix_decoding=False)
    assert isinstance(draft_model_drafter(loaded(draft), config, DrafterContext(loaded(target), 64)),
                      DraftModelDrafter)
