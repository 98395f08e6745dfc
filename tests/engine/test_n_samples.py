"""n samples of one prompt (:meth:`Engine.add_requests`): one prefill whose K/V every sample
shares, and each sample is the sequence it would be alone with its own params."""

from __future__ import annotations

import pytest

from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.ngram import NgramDrafter

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
N = 3


def engine(target, speculative: bool, slots: int = 4) -> Engine:
    spec = SpeculativeConfig(method="given", num_speculative_tokens=3, adaptive=False) if speculative else None
    return Engine(loaded(target), spec, max_model_len=128, drafter=NgramDrafter(1, 3) if speculative else None,
                  max_num_seqs=slots)


def run_all(eng: Engine, seqs) -> list[list[int]]:
    while any(not s.finished for s in seqs):
        eng.step()
    return [s.output_ids for s in seqs]


def count_prefills(eng: Engine, monkeypatch) -> list[int]:
    """Records the number of tokens of every target pass."""
    passes: list[int] = []
    forward = eng.model.forward

    def counting(ids, *args, **kwargs):
        passes.append(ids.shape[1])
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", counting)
    return passes


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=3, max_tokens=20, frequency_penalty=0.5),
                                    SamplingParams(temperature=0.0, max_tokens=20)], ids=["seeded", "greedy"])
def test_each_sample_is_what_it_would_be_alone_after_one_prefill(target, monkeypatch, speculative, params):
    alone = [engine(target, speculative).generate(PROMPT, params.for_choice(i)).output_ids for i in range(N)]
    eng = engine(target, speculative)
    passes = count_prefills(eng, monkeypatch)
    seqs = eng.add_requests(PROMPT, [params.for_choice(i) for i in range(N)])
    assert passes == [len(PROMPT)]  # one prefill for the n samples
    assert [s.slot for s in seqs] == sorted({s.slot for s in seqs})  # their own slots
    assert run_all(eng, seqs) == alone
    if params.greedy:
        assert alone[0] == alone[1] == alone[2]
    else:
        assert len({tuple(a) for a in alone}) == N  # the seed streams differ
    assert sorted(eng.free_slots) == [0, 1, 2, 3]


def test_more_samples_than_slots_are_refused_clearly(target):
    eng = engine(target, False, slots=2)
    with pytest.raises(ValueError, match="n=3 samples need as many sequence slots; the engine has 2"):
        eng.add_requests(PROMPT, [SamplingParams()] * 3)
    eng.add_request(PROMPT, SamplingParams(max_tokens=5))
    with pytest.raises(RuntimeError, match="2 free sequence slots are needed, but 1 of 2 slots are in use"):
        eng.add_requests(PROMPT, [SamplingParams()] * 2)
