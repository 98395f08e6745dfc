"""The draft model's catch-up: it reads what it missed the way the target read it.

A draft model reads the prompt on its first drafting round, and whatever plain rounds committed
on the next one. If it read those tokens in other passes than the target did (one long float32
pass over prompt and output together), its cache would differ from the target's in the last
bits, and a model drafting for itself would no longer reproduce the target. The test drafts with
the target itself after a long prompt (the prefill path) and many plain-decoded tokens
(more than one catch-up chunk): every drafted token must be the target's own next token.
"""

from __future__ import annotations

import pytest
import torch

from verispec.config import SamplingParams
from verispec.engine.engine import Engine
from verispec.models.decoder import PREFILL_MIN_TOKENS
from verispec.speculative.draft_model import DECODE_CHUNK, DraftModelDrafter

from tiny import loaded, tiny_model

VOCAB = 64


def test_a_self_draft_after_a_long_catch_up_reproduces_the_target():
    target = loaded(tiny_model(VOCAB, seed=3))
    prompt = [int(t) for t in torch.randint(1, VOCAB, (PREFILL_MIN_TOKENS + 6,), generator=torch.Generator().manual_seed(0))]
    generated = DECODE_CHUNK + 10  # plain rounds the draft did not see: two catch-up chunks
    k = 4
    full = Engine(target, max_model_len=256).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=generated + k, ignore_eos=True)).output_ids
    seq = Engine(target, max_model_len=256).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=generated, ignore_eos=True))
    drafter = DraftModelDrafter(target, VOCAB, 256)
    drafter.start(seq)
    assert drafter.cache.length(seq.slot) == 0  # start reads nothing
    assert seq.metrics.catch_up_time_s == 0.0
    proposal = drafter.propose(seq, k)
    assert proposal.tokens == full[generated:generated + k]
    assert drafter.cache.length(seq.slot) == len(seq.token_ids) + k - 1
    caught_up = seq.metrics.catch_up_time_s
    assert caught_up > 0  # the prompt and the plain rounds' tokens, timed apart from drafting
    drafter.catch_up(seq)  # nothing left to catch up on: no time counted
    assert seq.metrics.catch_up_time_s == caught_up


def test_c_leaves_the_catch_up_out():
    """c prices a draft token; a draft model's catching up is counted apart, not spread over c."""
    from verispec.metrics import SpecMetrics

    m = SpecMetrics(num_draft_tokens=10, draft_time_s=3.0, catch_up_time_s=2.0)
    m.record_target(1, 0.1)
    _, c, _ = m.cost_model()
    assert c == pytest.approx((3.0 - 2.0) / 10 / 0.1)
    both = SpecMetrics.from_dict(m.to_dict())
    both.merge(m)
    assert both.catch_up_time_s == 4.0 and both.summary()["catch_up_time_s"] == 4.0
    assert "catching up 4.00s" in both.format()
