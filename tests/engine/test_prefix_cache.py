"""Prefix caching: a request reuses the K/V a free slot kept from an earlier one, exactly.

Invariants: the reused entries are bitwise the ones a fresh engine's prefill computes, so a
request's output (greedy, speculative, seeded sampling) does not depend on what ran before it;
a request takes the free slot with the longest shared prefix; it is off where it would not be
exact, and refused there when asked for.
"""

from __future__ import annotations

import pytest
import torch

from verispec import kernels
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.quant import quantize_
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

from tiny import loaded, tiny_model, torch_threads

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")

MAX_LEN = 400
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
FIRST = [(7 * i + 1) % 48 for i in range(30)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1, dtype=torch.float32)


@pytest.fixture(scope="module")
def draft(target):
    return tiny_model(seed=2, noise_from=target, noise=0.15, dtype=torch.float32)


def engine(target, draft=None, kind=None, prefix_caching=True, slots=2):
    if kind is None:
        return Engine(loaded(target), None, max_model_len=MAX_LEN, max_num_seqs=slots, prefix_caching=prefix_caching)
    drafter = NgramDrafter(1, 3) if kind == "ngram" else DraftModelDrafter(
        loaded(draft), draft.config.vocab_size, MAX_LEN, num_slots=slots)
    spec = SpeculativeConfig(method=kind, num_speculative_tokens=4, adaptive=False)
    return Engine(loaded(target), spec, max_model_len=MAX_LEN, drafter=drafter, max_num_seqs=slots,
                  prefix_caching=prefix_caching)


def follow_up(first):
    """A second turn: the first prompt, its answer and more tokens."""
    return first.prompt_ids + first.output_ids + [5, 9, 13, 2, 40, 41]


def cache_entries(eng, slot, n):
    return [(eng.cache.k[i][slot, :, :n].clone(), eng.cache.v[i][slot, :, :n].clone()) for i in range(len(eng.cache.k))]


def test_a_follow_up_reuses_the_kept_prefix_bit_for_bit(target):
    eng = engine(target)
    assert eng.prefix_caching
    first = eng.generate(FIRST, GREEDY)
    prompt = follow_up(first)
    second = eng.add_request(prompt, GREEDY)
    # the cache held every token of the first request but its last
    assert second.metrics.cached_prompt_tokens == len(first.token_ids) - 1
    fresh = engine(target)
    alone = fresh.add_request(prompt, GREEDY)
    assert alone.metrics.cached_prompt_tokens == 0
    for (k1, v1), (k2, v2) in zip(cache_entries(eng, second.slot, len(prompt)),
                                  cache_entries(fresh, alone.slot, len(prompt))):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for e in (eng, fresh):
        while e.running:
            e.step()
    assert second.output_ids == alone.output_ids
    assert eng.metrics.cached_prompt_tokens == second.metrics.cached_prompt_tokens
    assert eng.metrics.summary()["cached_prompt_tokens"] == second.metrics.cached_prompt_tokens
    assert f"({second.metrics.cached_prompt_tokens} prompt tokens cached)" in eng.metrics.format()


@pytest.mark.parametrize("kind", [None, "ngram", "draft_model"])
def test_output_does_not_depend_on_the_requests_before(target, draft, kind):
    reference = engine(target, prefix_caching=False).generate(follow_up(engine(target).generate(FIRST, GREEDY)), GREEDY)
    eng = engine(target, draft, kind)
    first = eng.generate(FIRST, GREEDY)
    second = eng.generate(follow_up(first), GREEDY)
    assert second.metrics.cached_prompt_tokens > len(FIRST)
    assert second.output_ids == reference.output_ids
    # a prompt that shares only part of the kept tokens reuses that part
    third = eng.generate(FIRST[:20] + [1, 2, 3], GREEDY)
    assert third.metrics.cached_prompt_tokens == 20
    assert third.output_ids == engine(target).generate(FIRST[:20] + [1, 2, 3], GREEDY).output_ids


def test_seeded_sampling_is_the_same_after_a_cached_prefix(target, draft):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20)
    eng = engine(target, draft, "draft_model")
    prompt = follow_up(eng.generate(FIRST, GREEDY))
    cached = eng.generate(prompt, params)
    assert cached.metrics.cached_prompt_tokens > 0
    assert cached.output_ids == engine(target, draft, "draft_model").generate(prompt, params).output_ids


def test_a_request_takes_the_slot_with_the_longest_shared_prefix(target):
    eng = engine(target, slots=3)
    other = [(3 * i + 2) % 48 for i in range(25)]
    a = eng.generate(FIRST, GREEDY)
    b = eng.generate(other, GREEDY)  # shares nothing: an empty slot, not the kept one
    assert b.slot != a.slot
    c = eng.generate(other + [4, 4, 4], GREEDY)
    assert c.slot == b.slot and c.metrics.cached_prompt_tokens == len(other)
    d = eng.generate(FIRST + [4], GREEDY)
    assert d.slot == a.slot and d.metrics.cached_prompt_tokens == len(FIRST)
    # the same prompt again: every position but the last is reused, and the answer is the same
    e = eng.generate(FIRST, GREEDY)
    assert e.metrics.cached_prompt_tokens == len(FIRST) - 1 and e.output_ids == a.output_ids
    # a third history fills the empty slot; then one more evicts the least recently used (c's)
    f = eng.generate([30] * 10, GREEDY)
    assert f.slot not in (a.slot, b.slot)
    g = eng.generate([31] * 10, GREEDY)
    assert g.slot == b.slot


def test_on_by_default_only_where_exact_and_free_and_refused_where_not_exact(target):
    bf16 = tiny_model(seed=1)  # torch's bf16 attention: rows change with the pass's length
    assert not engine(bf16, prefix_caching=None).prefix_caching
    with pytest.raises(ValueError, match="prefix caching needs"):
        engine(bf16, prefix_caching=True)
    # exact, but a dense model's prefill (one GEMM per layer) is faster than its decode path
    assert not engine(target, prefix_caching=None).prefix_caching
    # a native model whose prefill runs the decode kernels anyway: on by default
    native = quantize_(tiny_model(seed=1, dtype=torch.float32), "int8", dense_prefill=False, native=True)
    assert engine(native, prefix_caching=None).prefix_caching
    # with dense bf16 prefill copies it is off unless asked for
    dense_copies = quantize_(tiny_model(seed=1, dtype=torch.float32), "int8", dense_prefill=True, native=True)
    assert not engine(dense_copies, prefix_caching=None).prefix_caching
    assert engine(dense_copies, prefix_caching=True).prefix_caching
    off = engine(target, prefix_caching=False)
    first = off.generate(FIRST, GREEDY)
    assert off.generate(follow_up(first), GREEDY).metrics.cached_prompt_tokens == 0


def test_a_failed_request_leaves_nothing_to_reuse(target, monkeypatch):
    eng = engine(target, slots=1)
    seq = eng.add_request(FIRST, GREEDY)
    monkeypatch.setattr(eng, "_accept", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    eng.step()
    monkeypatch.undo()
    assert seq.finish_reason == "error" and not eng.running
    assert eng.generate(FIRST + [1], GREEDY).metrics.cached_prompt_tokens == 0


def test_a_self_draft_reads_prompts_as_the_target_and_keeps_its_prefix_too(target):
    """A draft model reads prompts through the decode path when the target does (else a model
    drafting for itself would not reproduce the target after a long prompt), and keeps its own
    K/V of a finished request for the next one in the slot."""
    drafter = DraftModelDrafter(loaded(target), target.config.vocab_size, MAX_LEN, num_slots=2)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=False)
    eng = Engine(loaded(target), spec, max_model_len=MAX_LEN, drafter=drafter, max_num_seqs=2, prefix_caching=True)
    assert eng.prefix_caching and not drafter.prompt_prefill
    long = [(7 * i + 1) % 48 for i in range(80)]  # past the prefill path's threshold
    first = eng.generate(long, GREEDY)
    assert first.metrics.acceptance_rate == 1.0
    second = eng.add_request(follow_up(first), GREEDY)
    assert drafter.cache.length(second.slot) > len(long)  # the shared prefix stayed
    while eng.running:
        eng.step()
    assert second.metrics.acceptance_rate == 1.0
    assert second.output_ids == engine(target).generate(follow_up(first), GREEDY).output_ids
    # a request that finishes in its prefill never starts the drafter: the kept prefix survives
    held = list(drafter.kept[second.slot])
    assert held
    one = eng.generate(follow_up(first), SamplingParams(temperature=0.0, max_tokens=1))
    assert one.slot == second.slot and drafter.kept[second.slot] == held
