"""Tests for verispec.speculative.lookahead: the n-gram pool, the window's mask, and the aux branch."""

from __future__ import annotations

import pytest
import torch

from tiny import loaded, tiny_model
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.base import Outcome, Proposal
from verispec.speculative.lookahead import LookaheadDrafter, NgramPool, window_branch


def test_pool_keeps_guess_most_recent_per_token() -> None:
    pool = NgramPool(n=3, guess=2)
    pool.add_all([1, 2, 3, 1, 4, 5, 1, 2, 3, 1, 6, 7])
    # (1 -> 2 3) was re-added after (1 -> 4 5), and (1 -> 6 7) pushed the oldest, (4 5), out.
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    assert pool.candidates(9) == []


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


class _Recorder:
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
