"""The shared statistical harness for "speculation leaves the output distribution unchanged".

A tiny target with a 16-token vocabulary generates 3 tokens many times with some speculative
method. The exact distribution of those 3 tokens under plain sampling is computed by enumerating
all 16 x 16 two-token prefixes in one batched forward. A chi-square goodness-of-fit test and a
total-variation bound on each position's marginal must pass; every method's test uses the same
thresholds, and each has a negative control that must fail them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
from scipy.stats import chisquare

from tiny import tiny_model
from verispec.config import SamplingParams
from verispec.sampling import logits_to_probs

VOCAB = 16
PROMPT = [1, 2, 3]
DRAWS = 6000
P_VALUE_MIN = 0.001  # chi-square p-value a correct method must exceed
TV_MAX = 0.03  # max total-variation distance of any position's marginal

SETTINGS = {
    "temperature=1.0": SamplingParams(temperature=1.0, max_tokens=3),
    "temperature=0.7": SamplingParams(temperature=0.7, max_tokens=3),
    "top_p=0.9": SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3),
    "top_k=5": SamplingParams(temperature=1.0, top_k=5, max_tokens=3),
}


def target_and_draft():
    """A flat-ish tiny target and a deliberately mismatched draft model (frequent rejections)."""
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


def sample_counts(generate: Callable[[SamplingParams], list[int]], params: SamplingParams,
                  draws: int = DRAWS) -> np.ndarray:
    """Histogram of ``generate``'s 3-token outputs over ``draws`` seeds."""
    counts = np.zeros((VOCAB,) * 3)
    for i in range(draws):
        out = generate(SamplingParams(**{**params.__dict__, "seed": 10_000 + i}))
        counts[tuple(out)] += 1
    return counts


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


def passes(pvalue: float, tv: float) -> bool:
    return pvalue > P_VALUE_MIN and tv < TV_MAX


# ---- four tokens: chains of two drafts -------------------------------------------------------
# With 3 tokens a round has room for one draft only (the first token comes from prefill), so a
# drafter's choices within a chain (how long to make it) need a fourth token: the first round
# can then draft two. Its joint has 16^4 cells, too many for the draws, so the chi-square test
# takes the last three tokens' joint (16^3 cells, as for three tokens; the drafted ones and the
# bonus are among them) and the TV bound every position's marginal.

def exact_joint4(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3, t4) under plain sampling, shape [V, V, V, V]."""
    triples = torch.tensor(list(itertools.product(range(VOCAB), repeat=3)))  # [V^3, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(triples), -1), triples], dim=1)  # [V^3, P+3]
    cache = target.new_cache(len(PROMPT) + 3, num_slots=len(triples))
    positions = torch.arange(ids.shape[1]).expand(len(triples), -1)
    with torch.no_grad():
        logits = target(ids, positions, cache, num_logits=4)  # [V^3, 4, V]
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p).double()
    v = VOCAB
    p1 = probs[0, 0]  # [V]
    p2 = probs[:, 1].view(v, v, v, v)[:, 0, 0]  # [t1, t2]
    p3 = probs[:, 2].view(v, v, v, v)[:, :, 0]  # [t1, t2, t3]
    p4 = probs[:, 3].view(v, v, v, v)  # [t1, t2, t3, t4]
    return (p1[:, None, None, None] * p2[:, :, None, None] * p3[:, :, :, None] * p4).numpy()


def sample_counts4(generate: Callable[[SamplingParams], list[int]], params: SamplingParams,
                   draws: int = DRAWS) -> np.ndarray:
    """Histogram of ``generate``'s 4-token outputs over ``draws`` seeds."""
    counts = np.zeros((VOCAB,) * 4)
    for i in range(draws):
        out = generate(SamplingParams(**{**params.__dict__, "max_tokens": 4, "seed": 10_000 + i}))
        counts[tuple(out)] += 1
    return counts


def goodness_of_fit4(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, float]:
    """Chi-square p-value of the last three tokens' joint and the max marginal TV of the four."""
    pvalue, _ = goodness_of_fit(counts.sum(axis=0), expected_p.sum(axis=0))  # (t2, t3, t4)
    emp = counts / counts.sum()
    tv = max(
        0.5 * np.abs(emp.sum(axis=tuple(a for a in range(4) if a != axis))
                     - expected_p.sum(axis=tuple(a for a in range(4) if a != axis))).sum()
        for axis in range(4)
    )
    return pvalue, tv
