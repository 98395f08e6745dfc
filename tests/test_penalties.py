"""The penalty arithmetic of :mod:`verispec.penalties` against direct references: OpenAI's
formulas row by row, and Hugging Face's RepetitionPenaltyLogitsProcessor."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from verispec.config import SamplingParams
from verispec.penalties import penalize, preceding_counts
from verispec.sequence import Sequence

VOCAB = 12
EOS = 11


def sequence(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(list(prompt), params, torch.Generator(), frozenset([EOS]), None)
    seq.output_ids = list(output)
    return seq


def path_tokens(output: list[int], drafts: list[int], parents: tuple[int, ...] | None, row: int) -> list[int]:
    """The output counted for ``row``: the committed output, then the drafts from the root to it."""
    parents = tuple(range(len(drafts))) if parents is None else parents
    path = []
    node = row
    while node > 0:
        path.append(drafts[node - 1])
        node = parents[node - 1]
    return output + path[::-1]


def test_counts_of_a_chain_add_the_earlier_drafts_row_by_row():
    counts, depth = preceding_counts([5], [7, 5], None, VOCAB)
    assert counts[:, 5].tolist() == [1, 1, 2]
    assert counts[:, 7].tolist() == [0, 1, 1]
    assert counts.sum(dim=1).tolist() == [1, 2, 3]
    assert depth.tolist() == [0, 1, 2]


def test_counts_of_a_tree_follow_each_nodes_root_path():
    # root -> 1 (token 4) -> 3 (token 4); root -> 2 (token 6)
    counts, depth = preceding_counts([], [4, 6, 4], (0, 0, 1), VOCAB)
    assert counts[:, 4].tolist() == [0, 1, 0, 2]
    assert counts[:, 6].tolist() == [0, 0, 1, 0]
    assert depth.tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("parents", [None, (0, 0, 1, 3)], ids=["chain", "tree"])
def test_presence_frequency_and_bias_follow_openais_formula_on_every_row(parents):
    """mu[j] + bias[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, with c counting the
    row's own output (the committed output and the drafts before it)."""
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4, logit_bias={3: 5.0, 9: -100.0})
    output, drafts = [2, 3, 2], [3, 5, 2, 5]
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=torch.Generator().manual_seed(0))
    got = penalize(sequence(params, [1, 4], output), drafts, logits, parents)
    for row in range(len(drafts) + 1):
        tokens = path_tokens(output, drafts, parents, row)
        for j in range(VOCAB):
            c = tokens.count(j)
            want = logits[row, j].item() + dict(params.logit_bias).get(j, 0.0) - c * -0.4 - (c > 0) * 0.7
            assert got[row, j].item() == pytest.approx(want, abs=1e-5), (row, j)


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
@pytest.mark.parametrize("parents", [None, (0, 1, 1)], ids=["chain", "tree"])
def test_repetition_penalty_is_hugging_faces_over_prompt_and_output(penalty, parents):
    params = SamplingParams(repetition_penalty=penalty)
    prompt, output, drafts = [1, 4, 4], [6, 2], [7, 1, 8]
    logits = torch.randn(len(drafts) + 1, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    got = penalize(sequence(params, prompt, output), drafts, logits, parents)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for row in range(len(drafts) + 1):
        ids = torch.tensor([prompt + path_tokens(output, drafts, parents, row)])
        want = hf(ids, logits[row : row + 1].clone())[0]
        torch.testing.assert_close(got[row], want, rtol=0, atol=1e-6)


def test_min_tokens_masks_eos_and_stop_ids_until_enough_tokens_precede_the_row():
    params = SamplingParams(min_tokens=4, max_tokens=10, stop_token_ids=frozenset([3]))
    logits = torch.zeros(4, VOCAB)
    got = penalize(sequence(params, [1], [5, 6]), [7, 8, 9][:3], logits)  # rows follow 2, 3, 4, 5 tokens
    assert torch.isinf(got[:2, EOS]).all() and torch.isinf(got[:2, 3]).all()
    assert (got[2:, EOS] == 0).all() and (got[2:, 3] == 0).all()
    assert (got[:, :3] == 0).all()
    # ignore_eos leaves EOS alone, stop token ids are masked all the same
    params = SamplingParams(min_tokens=4, max_tokens=10, stop_token_ids=frozenset([3]), ignore_eos=True)
    got = penalize(sequence(params, [1], [5, 6]), [7, 8, 9], logits)
    assert (got[:, EOS] == 0).all() and torch.isinf(got[:2, 3]).all()


def test_a_bias_outside_the_vocabulary_is_a_clear_error():
    with pytest.raises(ValueError, match=r"logit_bias token id 12 is outside the vocabulary \[0, 12\)"):
        penalize(sequence(SamplingParams(logit_bias={12: 1.0}), [1], []), [], torch.zeros(1, VOCAB))


def test_a_request_without_penalties_gets_its_logits_untouched():
    logits = torch.randn(1, 3, VOCAB).to(torch.bfloat16)
    assert penalize(sequence(SamplingParams(), [1], [2]), [3, 4], logits) is logits
    penalized = penalize(sequence(SamplingParams(presence_penalty=1.0), [1], [2]), [3, 4], logits)
    assert penalized.shape == logits.shape and penalized.dtype == torch.float32


@pytest.mark.parametrize("kwargs,field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_is_stored_as_sorted_pairs():
    assert SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias=((4, 2.0),)) == SamplingParams(logit_bias={4: 2.0})


def test_each_choice_gets_its_own_reproducible_seed():
    params = SamplingParams(seed=7)
    seeds = [params.for_choice(i).seed for i in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [SamplingParams(seed=7).for_choice(i).seed for i in range(4)]
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert SamplingParams().for_choice(3).seed is None  # unseeded: each draws its own
