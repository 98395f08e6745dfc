"""Greedy speculative decoding on the real bundled models is token-identical to plain decoding.

These load real weights (fetched and converted on first use), so they are marked ``slow``;
CI runs them. bf16 is the default compute dtype on CPU and the one whose matmul rows are batch
invariant, which is what makes the k+1-row verify pass agree with 1-row plain decoding bit for
bit.
"""

from __future__ import annotations

import pytest

from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, prompt_ids
from verispec import kernels
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.controller import AdaptiveController
from verispec.speculative.cost_model import CostModel
from verispec.speculative.draft_model import DraftModelDrafter

pytestmark = pytest.mark.slow


def test_smollm2_ngram_and_self_draft_identical(smollm):
    for text in PROMPTS:
        ids = prompt_ids(smollm, text)
        plain = Engine(smollm, max_model_len=MAX_MODEL_LEN).generate(ids, GREEDY)
        ngram = Engine(smollm, SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False),
                       max_model_len=MAX_MODEL_LEN).generate(ids, GREEDY)
        # SmolLM2 drafting for itself: every draft should be accepted.
        drafter = DraftModelDrafter(smollm, smollm.model.config.vocab_size, MAX_MODEL_LEN)
        self_draft = Engine(smollm, SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=False),
                            max_model_len=MAX_MODEL_LEN, drafter=drafter).generate(ids, GREEDY)
        assert ngram.output_ids == plain.output_ids
        assert self_draft.output_ids == plain.output_ids
        assert self_draft.metrics.acceptance_rate == 1.0


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_qwen_coder_1_5b_with_0_5b_draft_identical(qwen_target, qwen_draft, qwen_plain, adaptive):
    """Fixed k = 4, and the adaptive controller, whose rule also stops a chain within k where
    the draft is unsure (``keep_drafting``).

    The adaptive controller starts from costs set here rather than measured: a draft step a
    third of a target step, a pass of n positions 1 + 0.05 (n - 1) steps, about what this pair
    costs. Measured on a loaded machine, the draft can price itself out before its first round,
    and the test would then check nothing under the controller's own rule. The rounds go on
    learning from the times they take, as always."""
    target = qwen_target
    drafter = DraftModelDrafter(qwen_draft, target.model.config.vocab_size, MAX_MODEL_LEN)
    assert drafter.vocab is not None and drafter.vocab.ranges[0] == (0, 100_256)  # the bundled draft's cut head ...
    assert [kernels.format_name(p.fmt) for p in drafter.vocab.head.parts] == ["Q4_1"]  # ... requantized
    controller = None
    if adaptive:
        costs = CostModel()
        for n in range(1, 6):
            costs.observe_target(n, 1.0 + 0.05 * (n - 1))
        costs.observe_draft(1, 1 / 3)
        controller = AdaptiveController(costs=costs)
    spec_engine = Engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=adaptive),
                         max_model_len=MAX_MODEL_LEN, drafter=drafter, controller=controller)
    assert (drafter._keep is not None) == adaptive
    accepted = 0
    for text in PROMPTS:
        spec = spec_engine.generate(prompt_ids(target, text), GREEDY)
        assert spec.output_ids == qwen_plain[text], text
        accepted += spec.metrics.num_accepted_tokens
    assert accepted > 0


def test_incompatible_draft_vocabulary_is_a_clear_error(smollm, qwen_target):
    from verispec.speculative.draft_model import check_vocab_compatible

    with pytest.raises(ValueError, match="incompatible"):
        check_vocab_compatible(qwen_target, smollm)


def test_smollm2_second_turn_on_a_cached_prefix_equals_a_fresh_engine(smollm):
    """Prefix caching on the real model's native kernels: the second turn of a chat reuses the
    first turn's K/V and answers exactly as an engine that never saw the first turn."""
    eng = Engine(smollm, max_model_len=MAX_MODEL_LEN, max_num_seqs=2)
    if not eng.prefix_caching:
        pytest.skip("prefix caching is off for this model on this CPU (dense prefill copies)")
    tok = smollm.tokenizer
    question = PROMPTS[0]
    first = eng.generate(tok.apply_chat_template(question), GREEDY)
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "Now say it in one sentence."}]
    ids = tok.apply_chat_template(turns)
    second = eng.generate(ids, GREEDY)
    assert second.metrics.cached_prompt_tokens >= len(first.prompt_ids)
    fresh = Engine(smollm, max_model_len=MAX_MODEL_LEN).generate(ids, GREEDY)
    assert fresh.metrics.cached_prompt_tokens == 0
    assert second.output_ids == fresh.output_ids


def test_smollm2_logprobs_identical_with_and_without_speculation(smollm):
    """On real weights, greedy logprobs (the target's raw log-softmax, top 5) are the same floats
    whether a token came from a plain step or from a verify pass (self-draft: every draft
    accepted; n-grams: accepted and rejected drafts)."""
    from dataclasses import replace

    params = replace(GREEDY, logprobs=5)
    ids = prompt_ids(smollm, PROMPTS[0])

    def floats(seq):
        return [(t.token_id, t.logprob, t.top) for t in seq.output_logprobs]

    plain = Engine(smollm, max_model_len=MAX_MODEL_LEN).generate(ids, params)
    drafter = DraftModelDrafter(smollm, smollm.model.config.vocab_size, MAX_MODEL_LEN)
    self_draft = Engine(smollm, SpeculativeConfig(method="draft_model", num_speculative_tokens=4, adaptive=False),
                        max_model_len=MAX_MODEL_LEN, drafter=drafter).generate(ids, params)
    ngram = Engine(smollm, SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False),
                   max_model_len=MAX_MODEL_LEN).generate(ids, params)
    assert len(plain.output_logprobs) == len(plain.output_ids) > 16
    assert self_draft.metrics.num_accepted_tokens > 0
    for spec in (self_draft, ngram):
        assert spec.output_ids == plain.output_ids
        assert floats(spec) == floats(plain)
