"""Tree speculation settings: SGLang / vLLM names, validation, and the drafters they build."""

from __future__ import annotations

import pytest

from verispec.config import SpeculativeConfig
from verispec.speculative.base import DrafterContext
from verispec.speculative.registry import build_drafter
from verispec.speculative.draft_tree import default_choices
from verispec.speculative.ngram import NgramDrafter
from verispec.metrics import SpecMetrics


def test_tree_keys_and_draft_topk_alias():
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "draft_topk": 4, "num_draft_tokens": 10})
    assert (cfg.speculative_eagle_topk, cfg.tree_budget, cfg.is_tree) == (4, 10, True)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, speculative_eagle_topk=2).tree_budget == 6
    assert not SpeculativeConfig(method="ngram").is_tree


def test_token_tree_from_a_list_or_a_string():
    for value in ([[0], [1], [0, 0]], "[(0,), (1,), (0, 0)]"):
        cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": "m", "speculative_token_tree": value})
        assert cfg.speculative_token_tree == ((0,), (1,), (0, 0))
        assert cfg.is_tree and cfg.tree_budget == 3


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"speculative_eagle_topk": 0}, "speculative_eagle_topk must be an integer >= 1"),
        ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer in 1..62"),
        ({"num_draft_tokens": 63}, "num_draft_tokens must be an integer in 1..62"),
        ({"tree_children": "beam"}, "tree_children must be one of"),
        ({"speculative_token_tree": [[0, 0]]}, "no parent choice"),
        ({"speculative_token_tree": "[(0,"}, "not a list of tuples"),
        ({"speculative_token_tree": [["a"]]}, "list of rank tuples"),
    ],
)
def test_bad_tree_settings_are_clear_errors(data, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "ngram", **data})


def test_ngram_builds_a_trie_drafter_and_refuses_what_does_not_apply():
    context = DrafterContext(target=None, max_model_len=64)
    drafter = build_drafter(SpeculativeConfig(method="ngram", speculative_eagle_topk=3, num_draft_tokens=5), context)
    assert isinstance(drafter, NgramDrafter) and (drafter.topk, drafter.budget) == (3, 5)
    with pytest.raises(ValueError, match="deterministic"):
        build_drafter(SpeculativeConfig(method="ngram", speculative_eagle_topk=2, tree_children="iid"), context)
    with pytest.raises(ValueError, match="does not apply"):
        build_drafter(SpeculativeConfig(method="ngram", speculative_token_tree=((0,),)), context)


def test_default_static_tree_prefers_first_ranks():
    assert default_choices(2, 2, 4) == [(0,), (0, 0), (1,), (0, 1)]
    assert len(default_choices(3, 4, 30)) == 30


def test_tree_metrics_merge_and_format():
    a, b = SpecMetrics(), SpecMetrics()
    a.record_tree(6, 2)
    b.record_tree(8, 0)
    a.merge(b)
    assert (a.tree_rounds, a.tree_nodes, a.accepted_depth_counts) == (2, 14, [1, 0, 1])
    assert "mean size 7.0 nodes" in a.format()
