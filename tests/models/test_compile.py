"""Compiled decode/verify steps: bucketing, row invariance across buckets, greedy identity.

Compiling is slow on a small CPU (each bucket is a fresh inductor graph), so the tests that
compile share one model and touch only buckets 1 and 4, and are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from tiny import loaded, tiny_model
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.compile import BUCKETS, bucket, compile_decoder
from verispec.models.decoder import EAGER_STEPS
from verispec.speculative.ngram import NgramDrafter


def test_bucket_is_the_smallest_that_fits():
    assert [bucket(t) for t in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert bucket(BUCKETS[-1] + 1) is None


@pytest.fixture(scope="module")
def compiled():
    return compile_decoder(tiny_model(seed=7))


@pytest.mark.slow
@pytest.mark.long
def test_rows_do_not_depend_on_the_bucket(compiled):
    layer, steps = compiled.layers[0], compiled.steps
    assert steps is not EAGER_STEPS
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 64, generator=gen).to(torch.bfloat16)  # T = 3, padded to bucket 4
    cos, sin = torch.ones(1, 1, 3, 16, dtype=torch.bfloat16), torch.zeros(1, 1, 3, 16, dtype=torch.bfloat16)
    together = steps.attention_inputs(layer, x, cos, sin, False)
    for i in range(3):
        alone = steps.attention_inputs(layer, x[:, i : i + 1], cos[:, :, :1], sin[:, :, :1], False)
        assert all(torch.equal(a[:, :, 0], b[:, :, i]) for a, b in zip(alone, together))
        assert torch.equal(steps.output(layer, x[:, i : i + 1], x[:, i : i + 1], False)[:, 0],
                           steps.output(layer, x, x, False)[:, i])


@pytest.mark.slow
@pytest.mark.long
def test_greedy_speculation_matches_plain_decoding_of_the_compiled_model(compiled):
    prompt = [3, 7, 9, 3]  # 4 tokens: prefill, verify (k = 3) and decode use buckets 4 and 1 only
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = Engine(loaded(compiled), None, max_model_len=128).generate(prompt, params)
    spec = Engine(loaded(compiled), SpeculativeConfig(method="given", num_speculative_tokens=3),
                  max_model_len=128, drafter=NgramDrafter(1, 3)).generate(prompt, params)
    assert spec.output_ids == plain.output_ids
    assert spec.metrics.num_draft_tokens > 0
