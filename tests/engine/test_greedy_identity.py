"""Greedy speculative decoding is token-identical to plain greedy decoding, for every drafter."""

from __future__ import annotations

import pytest

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

from tiny import loaded

# A prompt with repeats, so prompt lookup finds matches.
PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
# Long enough to take the prefill path (PREFILL_MIN_TOKENS): float32 on CPUs without native bf16.
LONG_PROMPT = [(5 * i * i + 3) % 48 for i in range(70)] + PROMPT


def run(target_model, prompt, params, drafter=None, k=0, eos=-1):
    spec = SpeculativeConfig(method="given", num_speculative_tokens=k, adaptive=False) if k else None
    engine = Engine(loaded(target_model, eos=eos), spec, max_model_len=512, drafter=drafter)
    return engine.generate(prompt, params)


def make_drafter(kind, draft_model):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    return DraftModelDrafter(loaded(draft_model), draft_model.config.vocab_size, 512)


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_greedy_output_identical_to_plain(target, draft, kind, k, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = run(target, prompt, params)
    spec = run(target, prompt, params, make_drafter(kind, draft), k)
    assert spec.output_ids == plain.output_ids
    assert spec.text == plain.text
    assert spec.metrics.num_draft_tokens > 0
    if kind == "draft_model":
        # Not vacuous: some drafts were accepted and some rejected.
        assert 0 < spec.metrics.num_accepted_tokens < spec.metrics.num_draft_tokens


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_eos_inside_accepted_run_stops_there(target, draft, kind):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain_all = run(target, PROMPT, params).output_ids
    eos = plain_all[20]  # make a token in the middle of the output the EOS token
    cut = plain_all.index(eos) + 1
    plain = run(target, PROMPT, params, eos=eos)
    spec = run(target, PROMPT, params, make_drafter(kind, draft), 5, eos=eos)
    assert plain.output_ids == plain_all[:cut]
    assert spec.output_ids == plain.output_ids
    assert spec.finish_reason == plain.finish_reason == "stop"


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_stop_string_inside_accepted_run(target, draft, kind):
    free = run(target, PROMPT, SamplingParams(temperature=0.0, max_tokens=60))
    stop = free.text[30:33]
    params = SamplingParams(temperature=0.0, max_tokens=60, stop=(stop,))
    plain = run(target, PROMPT, params)
    spec = run(target, PROMPT, params, make_drafter(kind, draft), 8)
    assert plain.text == free.text[: free.text.index(stop)]
    assert spec.text == plain.text
    assert spec.output_ids == plain.output_ids
    assert spec.finish_reason == "stop"


def test_max_tokens_respected_inside_run(target, draft):
    params = SamplingParams(temperature=0.0, max_tokens=7)
    plain = run(target, PROMPT, params)
    spec = run(target, PROMPT, params, make_drafter("draft_model", draft), 8)
    assert len(spec.output_ids) == 7
    assert spec.output_ids == plain.output_ids
    assert spec.finish_reason == "length"


def test_same_seed_same_sample(target, draft):
    params = SamplingParams(temperature=1.0, max_tokens=30, seed=1234)
    for drafter_kind in (None, "draft_model", "ngram"):
        outs = []
        for _ in range(2):
            d = make_drafter(drafter_kind, draft) if drafter_kind else None
            outs.append(run(target, PROMPT, params, d, 4 if d else 0).output_ids)
        assert outs[0] == outs[1]


def test_full_context_ends_with_length(target, draft):
    spec = SpeculativeConfig(method="given", num_speculative_tokens=4, adaptive=False)
    for drafter in (None, make_drafter("draft_model", draft)):
        engine = Engine(loaded(target), spec if drafter else None, max_model_len=24, drafter=drafter)
        seq = engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=100))
        assert seq.finish_reason == "length"
        assert len(PROMPT) + len(seq.output_ids) == 24 + 1  # the last token needs no cache entry


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_stop_token_id_inside_accepted_run_stops_there_even_with_ignore_eos(target, draft, kind):
    free = run(target, PROMPT, SamplingParams(temperature=0.0, max_tokens=60)).output_ids
    stop = free[20]
    cut = free.index(stop) + 1
    params = SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=frozenset([stop]), ignore_eos=True)
    plain = run(target, PROMPT, params, eos=free[5])
    spec = run(target, PROMPT, params, make_drafter(kind, draft), 5, eos=free[5])
    assert plain.output_ids == free[:cut]  # ignore_eos passes the EOS at index 5; the stop id ends it
    assert spec.output_ids == plain.output_ids
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason == "stop"
