"""Chunked prefill: a prompt run a chunk at a time (``Engine.begin_requests`` / ``prefill``)
gives the sequence the whole prompt's prefill gives, bit for bit (the decode kernels' rows do not
depend on the pass), greedy and sampled, with and without a drafter; an abandoned prefill gives
its slots back."""

from __future__ import annotations

import pytest
import torch

from verispec import kernels
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.ngram import NgramDrafter

from tiny import loaded, tiny_model, torch_threads

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")

MAX_LEN = 256
PROMPT = [(5 * i + 3) % 48 for i in range(70)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, dtype=torch.float32)


def engine(target, drafter=None, slots=2):
    spec = None if drafter is None else SpeculativeConfig(method="given", num_speculative_tokens=3, adaptive=False)
    return Engine(loaded(target), spec, max_model_len=MAX_LEN, max_num_seqs=slots, drafter=drafter,
                  prefix_caching=True)


def run(eng: Engine, params: list[SamplingParams], chunk: int | None):
    pending = eng.begin_requests(PROMPT, params)
    chunks = 0
    while not eng.prefill(pending, chunk):
        chunks += 1
        assert not any(s in eng.running for s in pending.seqs)  # nothing joins before the last chunk
    while eng.running:
        eng.step()
    return [(s.output_ids, [(t.token_id, t.logprob, t.top) for t in s.output_logprobs]) for s in pending.seqs], chunks


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_prompt_prefilled_in_chunks_gives_the_whole_prompts_sequence(target, sampled):
    params = SamplingParams(temperature=0.8 if sampled else 0.0, max_tokens=16, seed=11, logprobs=2)
    for drafter in (None, NgramDrafter(1, 3)):
        eng = engine(target, drafter)
        assert eng.chunked_prefill
        whole, _ = run(eng, [params], None)
        for chunk in (1, 7, 16, 69):
            chunked, chunks = run(engine(target, drafter), [params], chunk)
            assert chunks == -(-len(PROMPT) // chunk) - 1
            assert chunked == whole, chunk


def test_n_samples_share_a_chunked_prefill(target):
    params = [SamplingParams(temperature=1.0, max_tokens=8, seed=s) for s in (1, 2)]
    whole, _ = run(engine(target), params, None)
    chunked, _ = run(engine(target), params, 9)
    assert chunked == whole and whole[0] != whole[1]


def test_an_abandoned_prefill_gives_its_slots_back(target):
    eng = engine(target, slots=3)
    pending = eng.begin_requests(PROMPT, [SamplingParams(temperature=0.0, max_tokens=4)] * 2)
    assert len(eng.free_slots) == 1
    eng.prefill(pending, 10)
    eng.abort_prefill(pending)
    assert sorted(eng.free_slots) == [0, 1, 2] and not eng.running
    # the slots serve the next request as if nothing had run there
    fresh = engine(target, slots=3).generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    assert eng.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6)).output_ids == fresh.output_ids
