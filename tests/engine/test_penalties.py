"""Penalties, logit_bias and min_tokens leave speculation lossless: greedy output is
token-identical to plain decoding with the same settings (chains of n-grams and of a draft model,
trees), and sampled output has plain sampling's distribution (the shared harness,
``tests/distribution.py``), which a rule counting only the committed tokens fails.

The greedy tests draft with the target itself: its chain, penalised as the target's rows are
(:func:`verispec.penalties.penalize_next`), is accepted whole, so every verified row of every
round is checked against plain decoding; its tree (whose q ignores the penalties) and n-grams are
accepted in part."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import verispec.penalties as penalties_module
from distribution import PROMPT as DIST_PROMPT, VOCAB as DIST_VOCAB, goodness_of_fit, passes, sample_counts, \
    target_and_draft
from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.sampling import logits_to_probs
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

# Repeats, so the n-gram drafter finds matches and the penalties have tokens to bite on.
PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
GREEDY = dict(temperature=0.0, max_tokens=40)
SETTINGS = {
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=0.3),
    "repetition_penalty": dict(repetition_penalty=1.6),
    "negative penalties": dict(presence_penalty=-1.0, frequency_penalty=-0.5, repetition_penalty=0.7),
    "logit_bias": dict(logit_bias={9: 3.0, 11: 2.0, 4: -100.0}),
}
K = 3


def engine(target, drafter=None, eos=-1) -> Engine:
    spec = SpeculativeConfig(method="given", num_speculative_tokens=K, adaptive=False) if drafter else None
    return Engine(loaded(target, eos=eos), spec, max_model_len=256, drafter=drafter)


def drafter(kind, draft):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    if kind == "tree":
        return TreeDraftModelDrafter(loaded(draft), draft.config.vocab_size, 256, depth=K, topk=2, budget=6)
    return DraftModelDrafter(loaded(draft), draft.config.vocab_size, 256)


@pytest.fixture(scope="module")
def unpenalized(target):
    return engine(target).generate(PROMPT, SamplingParams(**GREEDY)).output_ids


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "tree"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_output_with_penalties_identical_to_plain(target, unpenalized, kind, name):
    params = SamplingParams(**GREEDY, **SETTINGS[name])
    plain = engine(target).generate(PROMPT, params)
    assert plain.output_ids != unpenalized  # the setting bites
    spec = engine(target, drafter(kind, target)).generate(PROMPT, params)
    assert spec.output_ids == plain.output_ids
    m = spec.metrics
    assert m.num_accepted_tokens > 0  # drafts were verified under the penalties and kept
    if kind == "draft_model":
        assert m.num_accepted_tokens == m.num_draft_tokens  # a self-draft penalised alike: every draft kept


@pytest.mark.parametrize("kind", ["draft_model", "tree"])
def test_min_tokens_holds_eos_back_identically_with_speculation(target, unpenalized, kind):
    eos = unpenalized[3]  # a token that would end the output after 4 tokens
    params = SamplingParams(**GREEDY, min_tokens=12)
    plain = engine(target, eos=eos).generate(PROMPT, params)
    assert len(plain.output_ids) >= 12 and eos not in plain.output_ids[:11]
    assert engine(target, eos=eos).generate(PROMPT, SamplingParams(**GREEDY)).output_ids == unpenalized[:4]
    spec = engine(target, drafter(kind, target), eos=eos).generate(PROMPT, params)
    assert spec.output_ids == plain.output_ids
    assert spec.metrics.num_accepted_tokens > 0


# ---- the sampled distribution ----------------------------------------------------------------

TOKENS = 4  # the first round verifies both of its 2 drafts: the second counts the first
SAMPLED = SamplingParams(temperature=1.0, max_tokens=TOKENS, presence_penalty=0.5, frequency_penalty=1.5,
                         repetition_penalty=1.3, logit_bias={0: 1.0})


def exact_penalized_joint(target, params: SamplingParams) -> np.ndarray:
    """P(t1..t4) under plain sampling with ``params``' penalties, written out from their
    definitions: every 3-token prefix in one batched forward, and position i penalised by the
    prefix's first i tokens (and the prompt, for the repetition penalty)."""
    prefixes = torch.tensor(list(itertools.product(range(DIST_VOCAB), repeat=TOKENS - 1)))  # [V^3, 3]
    ids = torch.cat([torch.tensor(DIST_PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    cache = target.new_cache(ids.shape[1], num_slots=len(prefixes))
    positions = torch.arange(ids.shape[1]).expand(len(prefixes), -1)
    with torch.no_grad():
        logits = target(ids, positions, cache, num_logits=TOKENS).float()  # [V^3, 4, V]
    in_prompt = torch.zeros(DIST_VOCAB, dtype=torch.bool)
    in_prompt[DIST_PROMPT] = True
    rows = []
    for i in range(TOKENS):
        x = logits[:, i].clone()
        for token, bias in params.logit_bias:
            x[:, token] += bias
        c = torch.nn.functional.one_hot(prefixes[:, :i], DIST_VOCAB).sum(dim=1).float()  # [V^3, V]
        r = params.repetition_penalty
        x = torch.where((c > 0) | in_prompt, torch.where(x > 0, x / r, x * r), x)
        x = x - params.frequency_penalty * c - params.presence_penalty * (c > 0).float()
        rows.append(logits_to_probs(x, params.temperature).double())
    joint = torch.ones((), dtype=torch.float64)
    for i, probs in enumerate(rows):
        given = probs.view((DIST_VOCAB,) * TOKENS)[(slice(None),) * i + (0,) * (TOKENS - 1 - i)]
        joint = joint[..., None] * given
    return joint.numpy()


@pytest.fixture(scope="module")
def dist_models():
    return target_and_draft()


def sampled_engine(target, draft) -> Engine:
    drafter = DraftModelDrafter(loaded(draft), target.config.vocab_size, 64)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, adaptive=False)
    return Engine(loaded(target), spec, max_model_len=64, drafter=drafter)


def test_sampled_speculation_with_penalties_matches_plain_distribution(dist_models):
    target, draft = dist_models
    spec = sampled_engine(target, draft)
    counts = sample_counts(lambda p: spec.generate(DIST_PROMPT, p).output_ids, SAMPLED, tokens=TOKENS)
    pvalue, tv = goodness_of_fit(counts, exact_penalized_joint(target, SAMPLED))
    per_position = spec.metrics.per_position_acceptance
    print(f"per-position acceptance {per_position}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert len(per_position) == 2 and 0.05 < per_position[1] < 0.95  # second drafts accepted and rejected
    assert passes(pvalue, tv)


def test_counting_only_committed_tokens_fails_the_same_test(dist_models, monkeypatch):
    """Negative control: a row that ignores the round's earlier drafts is penalised as if they
    had not been generated, which biases the tokens after an accepted draft."""
    real = penalties_module.preceding_counts

    def committed_only(output_ids, drafts, parents, vocab, device="cpu"):
        counts, _ = real(output_ids, [], None, vocab, device)
        return counts.expand(len(drafts) + 1, -1), torch.arange(len(drafts) + 1)

    monkeypatch.setattr(penalties_module, "preceding_counts", committed_only)
    target, draft = dist_models
    spec = sampled_engine(target, draft)
    counts = sample_counts(lambda p: spec.generate(DIST_PROMPT, p).output_ids, SAMPLED, tokens=TOKENS)
    pvalue, tv = goodness_of_fit(counts, exact_penalized_joint(target, SAMPLED))
    print(f"negative control: chi2 p={pvalue:.2e}, max marginal TV={tv:.4f}")
    assert pvalue < 1e-6
    assert not passes(pvalue, tv)


@pytest.mark.long
def test_plain_sampling_with_penalties_matches_the_reference(dist_models):
    """The reference itself: plain sampling through the engine matches it (without speculation
    nothing counts drafts, so this checks the definitions, not the draft counting)."""
    target, _ = dist_models
    plain = Engine(loaded(target), max_model_len=64)
    counts = sample_counts(lambda p: plain.generate(DIST_PROMPT, p).output_ids, SAMPLED, tokens=TOKENS, draws=3000)
    pvalue, tv = goodness_of_fit(counts, exact_penalized_joint(target, SAMPLED))
    print(f"plain: chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert pvalue > 0.001 and tv < 0.05
