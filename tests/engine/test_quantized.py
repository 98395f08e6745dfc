"""Speculation over a quantized target is lossless with respect to that quantized target.

The quantized model is a different model from the bf16 one, so every comparison here is with
plain decoding *of the same quantized model*.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distribution import PROMPT as DIST_PROMPT
from distribution import SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from tiny import loaded
from verispec import kernels
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.quant import quantize_
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
LONG_PROMPT = [(5 * i * i + 3) % 48 for i in range(70)] + PROMPT  # takes the prefill path (PREFILL_MIN_TOKENS)


def make_drafter(kind, draft_model, max_model_len=512):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    return DraftModelDrafter(loaded(draft_model), draft_model.config.vocab_size, max_model_len)


def run(target_model, prompt, params, drafter=None, k=0):
    spec = SpeculativeConfig(method="given", num_speculative_tokens=k, adaptive=False) if k else None
    return Engine(loaded(target_model), spec, max_model_len=512, drafter=drafter).generate(prompt, params)


TARGETS = [(s, d, n, False) for n in (False, True) for s in ("int8", "int4") for d in (False, True)]
TARGETS += [("int4", d, True, True) for d in (False, True)]


@pytest.fixture(scope="module", params=TARGETS,
                ids=[f"{s}{'-dense-prefill' if d else ''}-{'native' if n else 'torch'}{'-float16-cache' if h else ''}"
                     for s, d, n, h in TARGETS])
def quantized_target(request, target):
    """With and without the dense bf16 copies that a long prompt's prefill multiplies by, on
    PyTorch's kernels and on the native ones, and on the native ones with a float16 KV cache
    (what the loader gives a native model)."""
    scheme, dense, native, half = request.param
    if native and not kernels.available():
        pytest.skip("native kernels unavailable (no compiler)")
    model = quantize_(copy.deepcopy(target), scheme, dense_prefill=dense, native=native)
    if half:
        model.kv_cache_dtype = torch.float16
        assert model.new_cache(4).k[0].dtype == torch.float16
    return model


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_greedy_speculation_matches_plain_decoding_of_the_quantized_target(quantized_target, draft, kind,
                                                                          prompt):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = run(quantized_target, prompt, params)
    for k in (2, 5):
        spec = run(quantized_target, prompt, params, make_drafter(kind, draft), k)
        assert spec.output_ids == plain.output_ids
        assert spec.metrics.num_draft_tokens > 0


def test_quantized_draft_keeps_the_target_output(target, draft):
    params = SamplingParams(temperature=0.0, max_tokens=60)
    plain = run(target, PROMPT, params)
    spec = run(target, PROMPT, params, make_drafter("draft_model", quantize_(copy.deepcopy(draft), "int4")), 4)
    assert spec.output_ids == plain.output_ids


@pytest.mark.long
@pytest.mark.parametrize("half", [False, True], ids=["float32-cache", "float16-cache"])
def test_sampling_over_an_int4_target_matches_its_plain_distribution(half):
    target, draft = target_and_draft()
    quantize_(target, "int4")
    if half:  # the native model's cache; the exact joint is computed over the same cache
        if not kernels.available():
            pytest.skip("native kernels unavailable (no compiler)")
        target.kv_cache_dtype = torch.float16
    params = SETTINGS["temperature=1.0"]
    drafter_engine = Engine(loaded(target), SpeculativeConfig(method="draft_model", num_speculative_tokens=2, adaptive=False),
                            max_model_len=64, drafter=make_drafter("draft_model", draft, 64))
    counts = sample_counts(lambda p: drafter_engine.generate(DIST_PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    print(f"int4 target: acceptance {drafter_engine.metrics.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, TV={tv:.4f}")
    assert 0.2 < drafter_engine.metrics.acceptance_rate < 0.9
    assert passes(pvalue, tv)
