"""Tests for verispec.speculative.lookahead: the n-gram pool and its chained drafts, the window's
mask, the aux branch, and the gate that prices the window."""

from __future__ import annotations

import pytest
import torch

from tiny import loaded, tiny_model
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.base import Drafter, Outcome, Proposal
from verispec.speculative.cost_model import CostModel
from verispec.speculative.lookahead import LookaheadDrafter, NgramPool, WindowGate, window_branch


def test_pool_keeps_guess_most_recent_per_token() -> None:
    pool = NgramPool(n=3, guess=2)
    pool.add_all([1, 2, 3, 1, 4, 5, 1, 2, 3, 1, 6, 7])
    # (1 -> 2 3) was re-added after (1 -> 4 5), and (1 -> 6 7) pushed the oldest, (4 5), out.
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    assert pool.candidates(9) == []


def test_pool_chains_continuations_up_to_k_and_marks_window_guesses() -> None:
    pool = NgramPool(n=3, guess=2)
    pool.add_all([1, 2, 3, 4, 5])  # 1 -> (2, 3), 2 -> (3, 4), 3 -> (4, 5)
    pool.add([5, 8, 9], guessed=True)  # only the window has seen 5 -> (8, 9)
    assert pool.chain(1, 6) == ([2, 3, 4, 5, 8, 9], [False, False, False, False, True, True])
    assert pool.chain(1, 3) == ([2, 3, 4], [False, False, False])  # cut at k
    assert pool.chain(9, 4) == ([], [])
    # Seen in the text too, a guess is no longer the window's alone, whichever came first.
    pool.add([5, 8, 9])
    pool.add([3, 4, 5], guessed=True)
    assert pool.chain(5, 2) == ([8, 9], [False, False]) and pool.chain(3, 2) == ([4, 5], [False, False])
    # A cycle is cut by k.
    loop = NgramPool(n=2, guess=1)
    loop.add_all([7, 7])
    assert loop.chain(7, 5) == ([7, 7, 7, 7, 7], [False] * 5)


def timed_costs(t1: float = 0.040, per_position: float = 0.004) -> CostModel:
    """A cost model that has timed verify passes of 1..20 positions on a line."""
    costs = CostModel()
    for n in range(1, 21):
        costs.observe_target(n, t1 + per_position * (n - 1))
    return costs


def test_window_gate_runs_always_without_a_cost_model() -> None:
    gate = WindowGate(probe=2, rest=3)
    for _ in range(10):
        assert gate.use()
        gate.record(0, 2, 12)
    assert gate.on


def test_window_gate_switches_off_a_window_that_does_not_pay_and_probes_again() -> None:
    gate = WindowGate(probe=4, rest=3)
    gate.bind(timed_costs())  # 4 window tokens after 2 drafts: 0.4 of a step
    assert gate.cost(2, 4) == pytest.approx(0.4)
    for _ in range(3):  # not judged before ``probe`` rounds
        assert gate.use()
        gate.record(0, 2, 4)
    assert gate.on
    assert gate.use()
    gate.record(1, 2, 4)  # 0.25 accepted guesses a round < 0.4
    assert not gate.on
    assert [gate.use() for _ in range(3)] == [False, False, False]  # ``rest`` rounds off
    for _ in range(4):  # then a fresh probe
        assert gate.use()
        gate.record(1, 2, 4)  # 1 accepted guess a round: pays
    assert gate.on and gate.use()


def test_window_branch_mask_and_positions() -> None:
    branch = window_branch([[10, 11], [20, 21]], num_drafts=1)
    assert branch.tokens == [10, 11, 20, 21]
    assert branch.positions == [1, 2, 2, 3]
    expected = torch.tensor([
        # t  d  a0 a1 b0 b1
        [1, 0, 1, 0, 0, 0],  # a0
        [1, 0, 1, 1, 0, 0],  # a1
        [1, 0, 1, 0, 1, 0],  # b0
        [1, 0, 1, 1, 0, 1],  # b1
    ], dtype=torch.bool)
    assert torch.equal(branch.mask, expected)


class _Recorder(Drafter):
    """Proposes one fixed window and records the aux logits the engine hands back."""

    def __init__(self, rows):
        self.rows, self.aux_logits = rows, []

    def start(self, seq):
        pass

    def propose(self, seq, k):
        return Proposal([], aux=window_branch(self.rows, 0))

    def feedback(self, seq, outcome):
        self.aux_logits.append(outcome.aux_logits)

    def finish(self, seq):
        pass


def test_aux_logits_equal_plain_forward_of_each_window_path() -> None:
    """Row (r, j)'s logits are the target's next-token logits after t, row0[:j+1], row1..r[j]."""
    model = tiny_model(seed=3)
    prompt, rows = [4, 9, 2, 7], [[5, 6, 7], [8, 9, 10]]
    recorder = _Recorder(rows)
    engine = Engine(loaded(model), SpeculativeConfig(method="given", num_speculative_tokens=2, adaptive=False),
                    max_model_len=64, drafter=recorder)
    seq = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3))
    aux = recorder.aux_logits[0]  # the first round: the cache holds the prompt, t = output 0
    t = seq.output_ids[0]
    for r in range(2):
        for j in range(3):
            path = prompt + [t] + rows[0][: j + 1] + [rows[a][j] for a in range(1, r + 1)]
            cache = model.new_cache(64)
            ref = model(torch.tensor([path]), torch.arange(len(path))[None], cache)[0, -1]
            torch.testing.assert_close(aux[r * 3 + j], ref, rtol=0.02, atol=0.05)
            assert aux[r * 3 + j].argmax() == ref.argmax()


def test_jacobi_window_fills_then_collects_ngrams() -> None:
    drafter = LookaheadDrafter(window=2, ngram=3, guess=4)
    seq = type("S", (), {})()
    seq.prompt_ids, seq.output_ids, seq.slot = [1, 2, 3], [4], 0
    seq.token_ids = [1, 2, 3, 4]
    drafter.start(seq)
    state = drafter._requests[0]
    assert len(state.rows) == 1 and len(state.rows[0]) == 2
    first = list(state.rows[0])

    def logits_for(rows_tokens):
        out = torch.zeros(len(rows_tokens), 50)
        out[torch.arange(len(rows_tokens)), torch.tensor(rows_tokens)] = 1.0
        return out

    drafter.feedback(seq, Outcome(0, 0, [], logits_for([30, 31])))  # fill: one row -> two rows
    assert state.rows == [first, [30, 31]]
    drafter.feedback(seq, Outcome(0, 0, [], logits_for([0, 0, 40, 41])))  # full: collect, shift
    assert state.rows == [[30, 31], [40, 41]]
    assert (30, 40) in drafter._requests[0].pool.candidates(first[0])
    assert (31, 41) in drafter._requests[0].pool.candidates(first[1])


@pytest.mark.parametrize("key,value", [("lookahead_window_size", 0), ("lookahead_ngram_size", 1),
                                       ("lookahead_guess_set_size", 0)])
def test_bad_lookahead_config_is_a_clear_error(key, value) -> None:
    with pytest.raises(ValueError, match=f"{key} must be >= "):
        SpeculativeConfig(method="lookahead", **{key: value})
