"""Continuous batching: one target forward per step for every running sequence.

Invariants: a sequence's greedy output does not depend on which sequences share its batch
(nor on their drafts, padding or cache lengths), sequences join and leave without disturbing
the others, slots are reused, and a seeded sampled sequence is reproducible inside a batch.
"""

from __future__ import annotations

import pytest

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.batch_k import StepCosts, choose_k
from verispec.engine.engine import Engine
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

from tiny import loaded, torch_threads

MAX_LEN = 400
# Different lengths; the last one crosses the 256-entry attention block, so rows of one batch
# reduce over different padded cache lengths than they would alone.
PROMPTS = [
    [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7],
    [1, 2],
    [(7 * i + 1) % 48 for i in range(40)],
    [5, 5, 5, 5, 5, 5, 5],
    [(5 * i * i + 3) % 48 for i in range(250)],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def engine(target, draft, kind=None, k=4, slots=8):
    if kind is None:
        return Engine(loaded(target), None, max_model_len=MAX_LEN, max_num_seqs=slots)
    drafter = NgramDrafter(1, 3) if kind == "ngram" else DraftModelDrafter(
        loaded(draft), draft.config.vocab_size, MAX_LEN, num_slots=slots)
    spec = SpeculativeConfig(method=kind, num_speculative_tokens=k, adaptive=False)
    return Engine(loaded(target), spec, max_model_len=MAX_LEN, drafter=drafter, max_num_seqs=slots)


def run_batch(eng, prompts, params):
    seqs = [eng.add_request(p, params) for p in prompts]
    texts = {s: s.text for s in seqs}
    while eng.running:
        for s, t in eng.step().items():
            texts[s] += t
    assert all(texts[s] == s.text for s in seqs)  # streamed pieces add up to the final text
    return seqs


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def alone(target):
    """Each prompt decoded alone, plainly, in a fresh engine."""
    return [engine(target, None).generate(p, GREEDY).output_ids for p in PROMPTS]


@pytest.mark.parametrize("kind", [None, "ngram", "draft_model"])
def test_batched_greedy_equals_each_sequence_alone(target, draft, alone, kind):
    eng = engine(target, draft, kind)
    seqs = run_batch(eng, PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == alone
    assert sorted(eng.free_slots) == list(range(8)) and not eng.running
    if kind == "draft_model":
        assert 0 < eng.metrics.num_accepted_tokens < eng.metrics.num_draft_tokens


def test_sequences_join_and_leave_mid_flight(target, draft, alone):
    """Requests arriving while others run, with different max_tokens, in 2 slots."""
    eng = engine(target, draft, "draft_model", slots=2)
    pending = list(enumerate(PROMPTS))
    done: dict[int, list[int]] = {}
    active: dict = {}
    while pending or eng.running:
        while pending and eng.free_slots:
            i, p = pending.pop(0)
            active[eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=4 + 3 * i))] = i
        eng.step()
        for s in [s for s in active if s.finished]:
            done[active.pop(s)] = s.output_ids
    assert [done[i] for i in range(len(PROMPTS))] == [a[: 4 + 3 * i] for i, a in enumerate(alone)]


def test_per_request_k_and_disabled_speculation(target, draft, alone):
    eng = engine(target, draft, "draft_model")
    off = eng.add_request(PROMPTS[0], GREEDY, num_speculative_tokens=0)
    two = eng.add_request(PROMPTS[2], GREEDY, num_speculative_tokens=2)
    while eng.running:
        eng.step()
    assert off.output_ids == alone[0] and two.output_ids == alone[2]
    assert off.metrics.num_draft_tokens == 0
    assert two.metrics.num_draft_tokens > 0 and len(two.metrics.proposed_at) <= 2


def test_abort_frees_the_slot_and_spares_the_others(target, draft, alone):
    eng = engine(target, draft, "draft_model", slots=2)
    keep = eng.add_request(PROMPTS[0], GREEDY)
    gone = eng.add_request(PROMPTS[1], GREEDY)
    eng.step()
    eng.abort(gone)
    assert gone.finish_reason == "abort" and eng.running == [keep] and len(eng.free_slots) == 1
    late = eng.add_request(PROMPTS[3], GREEDY)
    assert late.slot == gone.slot
    while eng.running:
        eng.step()
    assert keep.output_ids == alone[0] and late.output_ids == alone[3]


def test_full_engine_refuses_a_request(target):
    eng = engine(target, None, slots=1)
    eng.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="slots are in use"):
        eng.add_request(PROMPTS[1], GREEDY)


def test_seeded_sampling_is_reproducible_inside_a_batch(target, draft):
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    single = engine(target, draft, "draft_model").generate(PROMPTS[0], params).output_ids
    eng = engine(target, draft, "draft_model")
    neighbours = [eng.add_request(p, SamplingParams(temperature=0.8, max_tokens=20)) for p in PROMPTS[1:3]]
    seq = eng.add_request(PROMPTS[0], params)
    while eng.running:
        eng.step()
    assert seq.output_ids == single
    assert all(n.finished for n in neighbours)


def test_choose_k_shrinks_as_the_forward_turns_compute_bound():
    costs = StepCosts()
    # A forward costs 10 ms plus 1 ms per row: cheap extra rows at batch 1, not at batch 32.
    for rows in (1, 5, 8, 40, 160):
        costs.record_forward(rows, 0.010 + 0.001 * rows)
    costs.record_proposal(100, 0.0)
    costs.record_acceptance(70)
    ks = [choose_k(4, b, costs) for b in (2, 4, 32)]
    assert ks[0] >= ks[1] >= ks[2] and ks[0] >= 3 and ks[2] == 0
    assert choose_k(4, 1, costs) == 4  # batch 1: the configured k stands
    assert choose_k(4, 8, StepCosts()) == 4  # no measurements yet: use k
