"""Speculative sampling leaves the output distribution exactly the target's.

A tiny target with a 16-token vocabulary and a deliberately mismatched draft model (so that
rejections are frequent) generate 3 tokens many times. The exact distribution of those 3 tokens
under plain sampling is computed by enumerating all 16 x 16 two-token prefixes in one batched
forward. A chi-square goodness-of-fit test (p > 0.001) and a total-variation bound on each
position's marginal must pass; a negative control with a wrong recovery rule must fail them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import verispec.spec.verify as verify_module
from tiny import loaded, tiny_model
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.sampling import logits_to_probs
from verispec.spec.draft_model import DraftModelDrafter

VOCAB = 16
PROMPT = [1, 2, 3]
DRAWS = 6000
K = 2


@pytest.fixture(scope="module")
def models():
    target = tiny_model(vocab=VOCAB, seed=11, layers=1, dtype=torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # flatter distributions: every token matters
    draft = tiny_model(vocab=VOCAB, seed=12, layers=1, dtype=torch.float32, noise_from=target, noise=0.25)
    return target, draft


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) under plain sampling, shape [V, V, V]."""
    pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))  # [V*V, 2]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], dim=1)  # [V*V, P+2]
    cache = target.new_cache(len(PROMPT) + 2, num_slots=len(pairs))
    positions = torch.arange(ids.shape[1]).expand(len(pairs), -1)
    logits = target(ids, positions, cache, num_logits=3)  # [V*V, 3, V]
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p).double()
    p1 = probs[0, 0]  # [V]
    p2 = probs[:, 1].view(VOCAB, VOCAB, VOCAB)[:, 0]  # [t1, t2]
    p3 = probs[:, 2].view(VOCAB, VOCAB, VOCAB)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def sampled_joint(target, draft, params: SamplingParams) -> tuple[np.ndarray, float]:
    drafter = DraftModelDrafter(loaded(draft), VOCAB, 64)
    engine = Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=K),
                    max_model_len=64, drafter=drafter)
    counts = np.zeros((VOCAB,) * 3)
    for i in range(DRAWS):
        seq = engine.generate(PROMPT, SamplingParams(**{**params.__dict__, "seed": 10_000 + i}))
        counts[tuple(seq.output_ids)] += 1
    return counts, engine.metrics.acceptance_rate


def goodness_of_fit(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, float]:
    """Chi-square p-value (cells with expected count < 5 pooled) and max marginal TV distance."""
    expected = expected_p.ravel() * counts.sum()
    observed = counts.ravel()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    pvalue = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    emp = counts / counts.sum()
    tv = max(
        0.5 * np.abs(emp.sum(axis=tuple(a for a in range(3) if a != axis))
                     - expected_p.sum(axis=tuple(a for a in range(3) if a != axis))).sum()
        for axis in range(3)
    )
    return pvalue, tv


SETTINGS = {
    "temperature=1.0": SamplingParams(temperature=1.0, max_tokens=3),
    "temperature=0.7": SamplingParams(temperature=0.7, max_tokens=3),
    "top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3),
    "top_k=5": SamplingParams(temperature=1.0, top_k=5, max_tokens=3),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculative_sampling_matches_plain_distribution(models, name):
    target, draft = models
    params = SETTINGS[name]
    counts, acceptance = sampled_joint(target, draft, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    print(f"{name}: acceptance {acceptance:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert 0.2 < acceptance < 0.9  # rejections are frequent, so the residual path is exercised
    assert pvalue > 0.001
    assert tv < 0.03


def test_wrong_recovery_rule_fails_the_same_test(models, monkeypatch):
    """Negative control: recovering from p instead of normalize(max(p - q, 0)) is biased."""
    target, draft = models
    monkeypatch.setattr(verify_module, "_recovery_distribution", lambda p, q: p)
    params = SETTINGS["temperature=1.0"]
    counts, _ = sampled_joint(target, draft, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    print(f"negative control: chi2 p={pvalue:.2e}, max marginal TV={tv:.4f}")
    assert pvalue < 1e-6
