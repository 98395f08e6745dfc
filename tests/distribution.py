"""The shared statistical harness for "speculation leaves the output distribution unchanged".

A tiny target with a 16-token vocabulary generates 3 tokens many times with some speculative
method. The exact distribution of those 3 tokens under plain sampling is computed by enumerating
all 16 x 16 two-token prefixes in one batched forward. With 3 tokens a round has room for one
draft only (the first token comes from prefill), so a drafter's choices within a chain (how long
to make it) take ``tokens=4``: the chi-square test then covers the last three tokens' joint
(16^4 cells would be too many for the draws) and the TV bound all four marginals. A chi-square goodness-of-fit test and a
total-variation bound on each position's marginal must pass; every method's test uses the same
thresholds, and each has a negative control that must fail them.
"""

from __future__ import annotations

import itertools
import os
import signal
import tempfile
import time
import warnings
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


def exact_joint(target, params: SamplingParams, tokens: int = 3) -> np.ndarray:
    """P(t1, ..., t_tokens) under plain sampling, shape [V] * tokens: every (tokens - 1)-token
    prefix in one batched forward."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=tokens - 1)))  # [V^(n-1), n-1]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)  # [V^(n-1), P+n-1]
    cache = target.new_cache(ids.shape[1], num_slots=len(prefixes))
    positions = torch.arange(ids.shape[1]).expand(len(prefixes), -1)
    with torch.no_grad():
        logits = target(ids, positions, cache, num_logits=tokens)  # [V^(n-1), n, V]
    probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p).double()
    joint = torch.ones((), dtype=torch.float64)
    for i in range(tokens):
        # token i + 1 given the first i: the rows whose later prefix tokens are 0 -> [V] * (i + 1)
        given = probs[:, i].view((VOCAB,) * tokens)[(slice(None),) * i + (0,) * (tokens - 1 - i)]
        joint = joint[..., None] * given
    return joint.numpy()


def sample_counts(generate: Callable[[SamplingParams], list[int]], params: SamplingParams,
                  draws: int = DRAWS, tokens: int = 3) -> np.ndarray:
    """Histogram of ``generate``'s ``tokens``-token outputs over ``draws`` seeds.

    Each draw runs on one intra-op thread: a tiny model's operations gain nothing from a second
    one, and on a two-core machine torch's OpenMP workers and the kernels' pool, each spinning
    after its own calls, take turns stealing the core the other needs. Rows are bit-identical for
    any thread count (tested with the kernels), so the distribution drawn is the same. The draws
    are split between this process and a forked copy of it (see :func:`_forked_counts`), so
    both cores draw; which process draws a seed does not change what it draws."""
    counts = np.zeros((VOCAB,) * tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def draw(seeds) -> np.ndarray:
        part = np.zeros((VOCAB,) * tokens)
        for i in seeds:
            out = generate(SamplingParams(**{**params.__dict__, "max_tokens": tokens, "seed": 10_000 + i}))
            part[tuple(out)] += 1
        return part

    try:
        counts += _forked_counts(draw, range(1, draws, 2), lambda: draw(range(0, draws, 2)))
    finally:
        torch.set_num_threads(threads)
    return counts


def _forked_counts(draw: Callable, child_seeds: range, own: Callable[[], np.ndarray]) -> np.ndarray:
    """``draw(child_seeds)`` in a forked child while this process runs ``own()``; their sum.

    The child inherits the models, engines and any monkeypatched rule as they are, and draws on
    one thread (the kernels' pool and torch's both run a call on the calling thread alone then).
    A child that fails, or that has not answered well after this process finished its own share
    (a library whose threads did not survive the fork could leave it waiting), is killed and its
    seeds are drawn here instead: the test is never lost or hung by the split."""
    if not hasattr(os, "fork"):
        return own() + draw(child_seeds)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "counts.npy")
        pid = os.fork()
        if pid == 0:  # the child: draw, save, and leave without running any of pytest's exit code
            code = 1
            try:
                np.save(result + ".part.npy", draw(child_seeds))
                os.replace(result + ".part.npy", result)
                code = 0
            finally:
                os._exit(code)
        start = time.monotonic()
        mine = own()
        waited_for = max(60.0, 2 * (time.monotonic() - start))
        deadline = time.monotonic() + waited_for
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.01)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if status == 0 and os.path.exists(result):
            return mine + np.load(result)
    warnings.warn("the forked share of the draws did not come back; drawn here instead", stacklevel=3)
    return mine + draw(child_seeds)


def goodness_of_fit(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, float]:
    """Chi-square p-value of the last three tokens' joint (cells with expected count < 5 pooled)
    and the max marginal TV distance over every position."""
    leading = tuple(range(counts.ndim - 3))
    last3, expected3 = counts.sum(axis=leading), expected_p.sum(axis=leading)
    expected = expected3.ravel() * last3.sum()
    observed = last3.ravel()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    pvalue = chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    emp = counts / counts.sum()
    axes = range(counts.ndim)
    tv = max(
        0.5 * np.abs(emp.sum(axis=tuple(a for a in axes if a != axis))
                     - expected_p.sum(axis=tuple(a for a in axes if a != axis))).sum()
        for axis in axes
    )
    return pvalue, tv


def passes(pvalue: float, tv: float) -> bool:
    return pvalue > P_VALUE_MIN and tv < TV_MAX

