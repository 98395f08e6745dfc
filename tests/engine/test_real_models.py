"""Greedy speculative decoding on the real bundled models is token-identical to plain decoding.

These load real weights (fetched and converted on first use), so they are marked ``slow``;
CI runs them. bf16 is the default compute dtype on CPU and the one whose matmul rows are batch
invariant, which is what makes the k+1-row verify pass agree with 1-row plain decoding bit for
bit.
"""

from __future__ import annotations

import pytest

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.spec.draft_model import DraftModelDrafter

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize in two sentences: The quick brown fox jumps over the lazy dog. The dog did not "
    "react. The fox jumped again, and the dog finally woke up and chased the fox away.",
    "Explain what a hash map is and give a short example in Python.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def smollm():
    from verispec.models.loader import load_model

    return load_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="module")
def qwen_pair():
    from verispec.models.loader import load_model

    target = load_model("qwen2.5-coder-1.5b-instruct", progress=False)
    draft = load_model("qwen2.5-coder-0.5b-instruct", progress=False)
    return target, draft


def prompt_ids(model, text):
    return model.tokenizer.apply_chat_template(text)


def test_smollm2_ngram_and_self_draft_identical(smollm):
    for text in PROMPTS:
        ids = prompt_ids(smollm, text)
        plain = Engine(smollm, max_model_len=1024).generate(ids, GREEDY)
        ngram = Engine(smollm, SpeculativeConfig(method="ngram", num_speculative_tokens=5),
                       max_model_len=1024).generate(ids, GREEDY)
        # SmolLM2 drafting for itself: every draft should be accepted.
        drafter = DraftModelDrafter(smollm, smollm.model.config.vocab_size, 1024)
        self_draft = Engine(smollm, SpeculativeConfig(method="draft_model", num_speculative_tokens=4),
                            max_model_len=1024, drafter=drafter).generate(ids, GREEDY)
        assert ngram.output_ids == plain.output_ids
        assert self_draft.output_ids == plain.output_ids
        assert self_draft.metrics.acceptance_rate == 1.0


def test_qwen_coder_1_5b_with_0_5b_draft_identical(qwen_pair):
    target, draft = qwen_pair
    drafter = DraftModelDrafter(draft, target.model.config.vocab_size, 1024)
    spec_engine = Engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=4),
                         max_model_len=1024, drafter=drafter)
    plain_engine = Engine(target, max_model_len=1024)
    accepted = 0
    for text in PROMPTS:
        ids = prompt_ids(target, text)
        plain = plain_engine.generate(ids, GREEDY)
        spec = spec_engine.generate(ids, GREEDY)
        assert len(plain.output_ids) > 16
        assert spec.output_ids == plain.output_ids, text
        accepted += spec.metrics.num_accepted_tokens
    assert accepted > 0


def test_incompatible_draft_vocabulary_is_a_clear_error(smollm, qwen_pair):
    from verispec.spec.draft_model import check_vocab_compatible

    target, _ = qwen_pair
    with pytest.raises(ValueError, match="incompatible"):
        check_vocab_compatible(target, smollm)
