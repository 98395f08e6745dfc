"""Greedy tree speculation on the Qwen2.5-Coder pair is token-identical to plain decoding,
whatever node budget a round verifies.

Real weights, so marked ``slow``; compares against the session's ``qwen_plain`` outputs.
"""

from __future__ import annotations

import pytest

from controllers import RandomBudget
from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, prompt_ids
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.draft_tree import TreeDraftModelDrafter

pytestmark = pytest.mark.slow


def test_qwen_coder_draft_tree_and_ngram_trie_identical(qwen_target, qwen_draft, qwen_plain):
    target = qwen_target
    drafter = TreeDraftModelDrafter(qwen_draft, target.model.config.vocab_size, MAX_MODEL_LEN,
                                    topk=2, budget=6, depth=3)
    tree = Engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=3, adaptive=False),
                  max_model_len=MAX_MODEL_LEN, drafter=drafter)
    trie = Engine(target, SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False, speculative_eagle_topk=3,
                                            num_draft_tokens=6), max_model_len=MAX_MODEL_LEN)
    for text in PROMPTS:
        ids = prompt_ids(target, text)
        for engine in (tree, trie):
            assert engine.generate(ids, GREEDY).output_ids == qwen_plain[text], text
    assert tree.metrics.tree_rounds > 0 and trie.metrics.tree_rounds > 0
    assert tree.metrics.num_accepted_tokens > 0


def test_qwen_coder_tree_identical_under_any_node_budget(qwen_target, qwen_draft, qwen_plain):
    """Each round verifies a random number of the dynamic tree's best nodes (what the adaptive
    controller's node budget may do), and the output stays plain decoding's."""
    target = qwen_target
    drafter = TreeDraftModelDrafter(qwen_draft, target.model.config.vocab_size, MAX_MODEL_LEN,
                                    topk=2, budget=6, depth=3)
    controller = RandomBudget(seed=0)
    engine = Engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=3),
                    max_model_len=MAX_MODEL_LEN, drafter=drafter, controller=controller)
    for text in PROMPTS:
        assert engine.generate(prompt_ids(target, text), GREEDY).output_ids == qwen_plain[text], text
    assert any(m < n for m, n in controller.kept) and engine.metrics.num_accepted_tokens > 0
