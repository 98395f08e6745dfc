"""Batch invariance on a real model: SmolLM2-135M, 16 requests sharing 8 slots.

Each request's greedy output in the batch, drafted by prompt lookup, equals its output decoded
alone without speculation. The requests' prompts differ in length, so rows of one verify pass
sit at different cache positions and propose different numbers of drafts.
"""

from __future__ import annotations

import pytest

from realmodels import PROMPTS, prompt_ids
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine

pytestmark = [pytest.mark.slow, pytest.mark.long]

PARAMS = SamplingParams(temperature=0.0, max_tokens=24)


def test_sixteen_batched_speculative_requests_equal_each_alone_plain(smollm):
    texts = [f"{PROMPTS[i % 3]} (variant {i}: {'please ' * (i % 5)}be brief)" for i in range(16)]
    prompts = [prompt_ids(smollm, t) for t in texts]
    plain = Engine(smollm, None, max_model_len=512)
    alone = [plain.generate(p, PARAMS).output_ids for p in prompts]

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    engine = Engine(smollm, spec, max_model_len=512, max_num_seqs=8)
    pending, seqs = list(prompts), []
    while pending or engine.running:
        while pending and engine.free_slots:
            seqs.append(engine.add_request(pending.pop(0), PARAMS))
        engine.step()
    assert [s.output_ids for s in seqs] == alone
    assert engine.metrics.num_draft_tokens > 0
