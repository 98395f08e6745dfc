"""Tree speculation in the engine: greedy identity with every drafter, and the exact
sampled distribution (shared harness, ``tests/distribution.py``) with a negative control.

The harness generates 3 tokens, so its rounds verify depth-1 trees (several children of one
node, the heart of multi-draft sampling); deeper trees are covered statistically in
``tests/speculative/test_tree_verify.py`` and by greedy identity here. The adaptive node budget (the
controller verifying only a dynamic tree's m best nodes) is held to both: greedy identity with
the real controller and with random budgets, and the distribution with random budgets.
"""

from __future__ import annotations

import pytest

import verispec.engine.engine as engine_module
import verispec.speculative.tree_verify as tree_verify
from distribution import PROMPT as DIST_PROMPT, SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, \
    target_and_draft
from controllers import RandomBudget
from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.speculative.controller import AdaptiveController
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7, 9, 4, 3, 7, 9, 11, 6]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, seed=0)  # seeded: sampled children (iid, without_replacement) draw the same trees every run
DEPTH = 3

DRAFTERS = {
    "draft_model dynamic topk 2": dict(topk=2, budget=6),
    "draft_model static topk": dict(topk=3, budget=8, choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    "draft_model static without_replacement": dict(topk=3, budget=8, children="without_replacement"),
    "draft_model static iid": dict(topk=2, budget=6, children="iid"),
}


def engine(target, drafter, max_model_len=256) -> Engine:
    spec = SpeculativeConfig(method="given", num_speculative_tokens=DEPTH, adaptive=False)
    return Engine(loaded(target), spec, max_model_len=max_model_len, drafter=drafter)


def tree_drafter(draft, max_model_len=256, **kw) -> TreeDraftModelDrafter:
    return TreeDraftModelDrafter(loaded(draft), draft.config.vocab_size, max_model_len, depth=DEPTH, **kw)


@pytest.fixture(scope="module")
def plain(target):
    return Engine(loaded(target), max_model_len=256).generate(PROMPT, GREEDY)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_tree_identical_to_plain(target, draft, plain, name):
    seq = engine(target, tree_drafter(draft, **DRAFTERS[name])).generate(PROMPT, GREEDY)
    assert seq.output_ids == plain.output_ids
    m = seq.metrics
    assert m.tree_rounds > 0 and m.tree_nodes > m.tree_rounds  # real trees, not chains
    assert 0 < m.num_accepted_tokens


class RecordingBudget(AdaptiveController):
    """The adaptive controller, remembering each node budget: (kept, drafted)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = []

    def choose_nodes(self, seq, values, draft_s) -> int:
        m = super().choose_nodes(seq, values, draft_s)
        self.kept.append((m, len(values)))
        return m


def budget_engine(target, draft, controller, max_model_len=256, **drafter_kw) -> Engine:
    spec = SpeculativeConfig(method="given", num_speculative_tokens=DEPTH)
    drafter = TreeDraftModelDrafter(loaded(draft), draft.config.vocab_size, max_model_len, depth=DEPTH, **drafter_kw)
    return Engine(loaded(target), spec, max_model_len=max_model_len, drafter=drafter, controller=controller)


def test_any_node_budget_leaves_greedy_output_unchanged(target, draft, plain):
    controller = RandomBudget(seed=1)
    seq = budget_engine(target, draft, controller, topk=2, budget=6).generate(PROMPT, GREEDY)
    assert seq.output_ids == plain.output_ids
    assert any(m < n for m, n in controller.kept) and any(m == n for m, n in controller.kept)


def test_greedy_tree_with_adaptive_node_budget_identical_to_plain(target, draft, plain):
    controller = RecordingBudget()
    eng = budget_engine(target, draft, controller, topk=2, budget=6)
    outputs = [eng.generate(PROMPT, GREEDY).output_ids for _ in range(2)]  # 2nd: with learned costs
    print(f"node budgets (kept, drafted): {controller.kept}")
    assert outputs == [plain.output_ids] * 2
    assert controller.kept and eng.metrics.tree_rounds > 0


def test_greedy_ngram_trie_identical_to_plain(target, plain):
    seq = engine(target, NgramDrafter(1, 3, topk=3, budget=8)).generate(PROMPT, GREEDY)
    assert seq.output_ids == plain.output_ids
    assert seq.metrics.tree_rounds > 0 and seq.metrics.tree_nodes > seq.metrics.tree_rounds


def test_stop_string_inside_accepted_path(target, draft, plain):
    stop = plain.text[12:14]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,))
    ref = Engine(loaded(target), max_model_len=256).generate(PROMPT, params)
    seq = engine(target, tree_drafter(draft, topk=2, budget=6)).generate(PROMPT, params)
    assert seq.output_ids == ref.output_ids and seq.text == ref.text and seq.finish_reason == "stop"


def test_tree_fills_the_context_exactly(target, draft, plain):
    seq = engine(target, tree_drafter(draft, max_model_len=36, topk=3, budget=9), max_model_len=36).generate(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=100))
    assert seq.finish_reason == "length"
    assert len(PROMPT) + len(seq.output_ids) == 37  # the last token needs no cache entry
    assert seq.output_ids == plain.output_ids[: len(seq.output_ids)]


# ---- distribution identity -----------------------------------------------------------------

DIST_CASES = {  # name -> (drafter settings, sampling setting)
    "dynamic topk b3, T=1.0": (dict(topk=3, budget=9), "temperature=1.0"),
    "iid b4, T=0.7": (dict(topk=4, budget=8, children="iid", choices=((0,), (1,), (2,), (3,))), "temperature=0.7"),
    "without_replacement b2, T=1.0": (dict(topk=2, budget=6, children="without_replacement"), "temperature=1.0"),
}


@pytest.fixture(scope="module")
def dist_models():
    return target_and_draft()


def tree_counts(dist_models, drafter_kw, params):
    target, draft = dist_models
    eng = engine(target, TreeDraftModelDrafter(loaded(draft), draft.config.vocab_size, 64, depth=DEPTH, **drafter_kw),
                 max_model_len=64)
    counts = sample_counts(lambda p: eng.generate(DIST_PROMPT, p).output_ids, params)
    return eng, goodness_of_fit(counts, exact_joint(target, params))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n.startswith("dynamic") else n
                                  for n in DIST_CASES])  # deterministic children: also in test_tree_verify
def test_tree_sampling_matches_plain_distribution(dist_models, name):
    drafter_kw, setting = DIST_CASES[name]
    eng, (pvalue, tv) = tree_counts(dist_models, drafter_kw, SETTINGS[setting])
    m = eng.metrics
    print(f"{name}: acceptance {m.acceptance_rate:.3f}, depths {m.accepted_depth_counts}, p={pvalue:.4f}, TV={tv:.4f}")
    assert m.tree_rounds > 0 and m.accepted_depth_counts[0] > 0 and m.num_accepted_tokens > 0
    assert passes(pvalue, tv)


def test_no_residual_update_between_children_fails(dist_models, monkeypatch):
    """Negative control: trying every child against the unchanged p is biased."""
    monkeypatch.setattr(tree_verify, "_update_residual", lambda residual, q: residual)
    drafter_kw, setting = DIST_CASES["iid b4, T=0.7"]
    _, (pvalue, tv) = tree_counts(dist_models, drafter_kw, SETTINGS[setting])
    print(f"negative control: p={pvalue:.2e}, TV={tv:.4f}")
    assert not passes(pvalue, tv)


def test_random_node_budget_keeps_the_sampled_distribution(dist_models, monkeypatch):
    """Verifying only the m best nodes of a dynamic top-k tree, m chosen at random each round
    (the adaptive node budget's freedom), leaves the output distribution exactly the target's."""
    monkeypatch.setattr(engine_module, "_fixed_k", lambda seq: False)  # the harness seeds every draw
    target, draft = dist_models
    controller = RandomBudget(seed=0)
    eng = budget_engine(target, draft, controller, max_model_len=64, topk=3, budget=9)
    params = SETTINGS["temperature=1.0"]
    counts = sample_counts(lambda p: eng.generate(DIST_PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    pruned = sum(m < n for m, n in controller.kept)
    print(f"random node budget: {pruned} of {len(controller.kept)} trees pruned, p={pvalue:.4f}, TV={tv:.4f}")
    assert pruned > 0 and eng.metrics.tree_rounds > 0 and eng.metrics.num_accepted_tokens > 0
    assert passes(pvalue, tv)
