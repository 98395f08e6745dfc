"""SmolLM2-135M with packed int8 / int4 weights: speculation matches plain decoding of the same model."""

from __future__ import annotations

import pytest

from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, prompt_ids
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.loader import load_model
from verispec.models.quant import quantize_
from verispec.speculative.draft_model import DraftModelDrafter


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", pytest.param("int4", marks=pytest.mark.long)])
def test_smollm2_quantized_target_speculation_identical(smollm, scheme):
    target = load_model("smollm2-135m-instruct", quantization="none", progress=False)  # dense weights to pack
    target.model = quantize_(target.model, scheme)
    ids = prompt_ids(target, PROMPTS[0])
    plain = Engine(target, max_model_len=MAX_MODEL_LEN).generate(ids, GREEDY)
    ngram = Engine(target, SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False),
                   max_model_len=MAX_MODEL_LEN).generate(ids, GREEDY)
    # the draft: the same model on its own GGUF weights (the native kernels)
    drafter = DraftModelDrafter(smollm, smollm.model.config.vocab_size, MAX_MODEL_LEN)
    drafted = Engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=False),
                     max_model_len=MAX_MODEL_LEN, drafter=drafter).generate(ids, GREEDY)
    assert ngram.output_ids == plain.output_ids
    assert drafted.output_ids == plain.output_ids
    assert drafted.metrics.num_accepted_tokens > 0  # drafts were accepted ...
    assert ngram.metrics.num_accepted_tokens < ngram.metrics.num_draft_tokens  # ... and rejected
