"""Logprobs are the target's raw log-softmax at each emitted position, whatever drafted it:
speculation (a draft model, a draft model's tree, n-gram lookup, suffix decoding) returns the same floats as plain
decoding, bit for bit, and they equal a log-softmax of the target's logits computed directly."""

from __future__ import annotations

import pytest
import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.logprobs import token_logprobs
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

from tiny import bigram, loaded, tiny_model

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
TOP = 5


KINDS = ["draft_model", "draft_tree", "ngram", "suffix"]


@pytest.fixture(scope="module")
def repetitive():
    """A target whose next token depends on the last one alone: its output cycles, so n-gram
    lookup finds drafts that are accepted."""
    return bigram(tiny_model(seed=1))


def run(target_model, params, kind=None, draft_model=None, k=4):
    """``target_model``'s output for PROMPT: plain (``kind`` None) or speculative. The suffix
    engine answers twice and returns the second answer, which it drafts from the first."""
    if kind is None:
        return Engine(loaded(target_model), max_model_len=512).generate(PROMPT, params)
    if kind == "suffix":
        engine = Engine(loaded(target_model), SpeculativeConfig(method="suffix", num_speculative_tokens=k,
                                                                adaptive=False), max_model_len=512)
        engine.generate(PROMPT, params)
        return engine.generate(PROMPT, params)
    spec = SpeculativeConfig(method="given", num_speculative_tokens=k, adaptive=False)
    if kind == "ngram":
        drafter = NgramDrafter(1, 3)
    elif kind == "draft_tree":  # verified with a tree mask; the accepted path's rows give the logprobs
        drafter = TreeDraftModelDrafter(loaded(draft_model), draft_model.config.vocab_size, 512, topk=2, budget=8,
                                        depth=k)
    else:
        drafter = DraftModelDrafter(loaded(draft_model), draft_model.config.vocab_size, 512)
    return Engine(loaded(target_model), spec, max_model_len=512, drafter=drafter).generate(PROMPT, params)


def target_for(kind, target, repetitive):
    return repetitive if kind == "ngram" else target


def direct_logprobs(target_model, output_ids, top_n):
    """The target's logits over prompt + output in one decode-path pass, reduced row by row."""
    ids = PROMPT + output_ids[:-1]
    cache = target_model.new_cache(len(ids) + 1)
    with torch.no_grad():
        logits = target_model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, slots=[0])  # [1, P+n-1, V]
    rows = logits[0, len(PROMPT) - 1:]  # [n, V] the rows that emitted the output
    return token_logprobs(rows, output_ids, top_n)


def floats(seq):
    return [(t.token_id, t.logprob, t.top) for t in seq.output_logprobs]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_logprobs_identical_with_and_without_speculation(target, draft, repetitive, kind):
    target = target_for(kind, target, repetitive)
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=TOP)
    plain = run(target, params)
    spec = run(target, params, kind, draft)
    assert spec.output_ids == plain.output_ids
    assert spec.metrics.num_accepted_tokens > 0  # some tokens came from verified drafts
    assert len(plain.output_logprobs) == len(plain.output_ids)
    assert floats(spec) == floats(plain)  # exact floats, not approximately
    assert [t.token_id for t in plain.output_logprobs] == plain.output_ids
    assert all(t.top[0][0] == t.token_id for t in plain.output_logprobs)  # greedy emits the argmax
    assert floats(plain) == floats(direct(target, plain))


def direct(target, seq):
    return type("Direct", (), {"output_logprobs": direct_logprobs(target, seq.output_ids, TOP)})


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_logprobs_are_the_targets_raw_log_softmax(target, draft, repetitive, kind):
    target = target_for(kind, target, repetitive)
    # Speculation changes the random draws, so the tokens differ from plain decoding's; every
    # logprob must still be the target's own at its position, before temperature and top-p.
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, seed=1234, logprobs=TOP)
    spec = run(target, params, kind, draft)
    assert spec.metrics.num_accepted_tokens > 0
    assert len(spec.output_logprobs) == len(spec.output_ids)
    assert floats(spec) == floats(direct(target, spec))


def test_no_logprobs_unless_asked(target, draft):
    seq = run(target, SamplingParams(temperature=0.0, max_tokens=10), "draft_model", draft)
    assert seq.output_logprobs == []


def test_stop_inside_accepted_run_keeps_one_logprob_per_token(target, draft):
    free = run(target, SamplingParams(temperature=0.0, max_tokens=40))
    stop = free.text[20:23]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,), logprobs=0)
    plain = run(target, params)
    spec = run(target, params, "draft_model", draft, k=8)
    assert spec.output_ids == plain.output_ids
    assert len(spec.output_logprobs) == len(spec.output_ids)
    assert floats(spec) == floats(plain)
    assert all(t.top == () for t in spec.output_logprobs)


def test_a_batch_gives_each_request_its_own_logprobs(target, draft):
    """Rows verified in one padded pass with another request's rows give the floats they give
    alone."""
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=TOP)
    other = [5, 1, 4, 1, 5, 9, 2, 6]
    alone = run(target, params, "draft_model", draft)
    spec = SpeculativeConfig(method="given", num_speculative_tokens=4, adaptive=False)
    drafter = DraftModelDrafter(loaded(draft), draft.config.vocab_size, 512, num_slots=2)
    engine = Engine(loaded(target), spec, max_model_len=512, drafter=drafter, max_num_seqs=2)
    seq = engine.add_request(PROMPT, params)
    engine.add_request(other, SamplingParams(temperature=0.0, max_tokens=30, logprobs=0))
    while engine.running:
        engine.step()
    assert seq.output_ids == alone.output_ids
    assert floats(seq) == floats(alone)
