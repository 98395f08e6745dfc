"""Choosing k per round never changes what is generated.

At T = 0 the output is token-identical to plain decoding whatever k each round uses: with the
adaptive controller on, and with a controller that picks k at random. With sampling, the adaptive
controller leaves the output distribution exactly the target's (shared harness).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from distribution import PROMPT as DIST_PROMPT
from distribution import SETTINGS, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from tiny import loaded
from verispec.config import SamplingParams, SpeculativeConfig
import verispec.engine.engine as engine_module
from verispec.engine.engine import Engine
from verispec.speculative.controller import AdaptiveController, FixedK, RoundReport
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

PROMPT = [3, 7, 9, 11, 3, 7, 9, 11, 5, 3, 7, 9, 2, 8, 3, 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=60)


class Recording(AdaptiveController):
    """The adaptive controller, remembering each k it chose."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: Counter[int] = Counter()

    def choose_k(self, seq, k_max: int) -> int:
        k = super().choose_k(seq, k_max)
        self.chosen[k] += 1
        return k


class RandomK:
    """Any k in 0..k_max, from its own generator (never the request's)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose_k(self, seq, k_max: int) -> int:
        return self.rng.randint(0, k_max)

    def observe(self, seq, report: RoundReport) -> None:
        pass


def make_drafter(kind, draft_model, max_model_len=512):
    if kind == "ngram":
        return NgramDrafter(1, 3)
    return DraftModelDrafter(loaded(draft_model), draft_model.config.vocab_size, max_model_len)


def engine(target, drafter, k_max, controller=None):
    spec = SpeculativeConfig(method="given", num_speculative_tokens=k_max)  # adaptive by default
    return Engine(loaded(target), spec, max_model_len=512, drafter=drafter, controller=controller)


@pytest.fixture(scope="module")
def plain_output(target):
    return Engine(loaded(target), None, max_model_len=512).generate(PROMPT, GREEDY).output_ids


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_greedy_identical_with_adaptive_controller(target, draft, plain_output, kind):
    controller = Recording()
    eng = engine(target, make_drafter(kind, draft), 6, controller)
    outputs = [eng.generate(PROMPT, GREEDY).output_ids for _ in range(2)]  # 2nd: with learned costs
    print(f"{kind}: k chosen {dict(sorted(controller.chosen.items()))}")
    assert outputs == [plain_output, plain_output]
    assert eng.metrics.num_draft_tokens > 0
    assert controller.chosen[0] > 0  # the first round measures plain decoding


@pytest.mark.parametrize("k_max", [1, 4, 8])
@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_any_choice_of_k_leaves_greedy_output_unchanged(target, draft, plain_output, kind, k_max):
    eng = engine(target, make_drafter(kind, draft), k_max, RandomK(seed=k_max))
    seq = eng.generate(PROMPT, GREEDY)
    assert seq.output_ids == plain_output
    assert 0 < seq.metrics.num_drafts < seq.metrics.num_rounds


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
def test_an_engine_calibrates_the_adaptive_controller_it_builds(target, draft, plain_output, kind):
    """Warm timings of every verify width and of the draft model seed the cost model, so the
    first decisions do not rest on cold first runs; the scratch slot is left empty."""
    eng = engine(target, make_drafter(kind, draft), 4)
    costs = eng.controller.costs
    assert isinstance(eng.controller, AdaptiveController)
    assert sorted(costs.target_s) == [1, 2, 3, 4, 5] and all(t > 0 for t in costs.target_s.values())
    assert eng.cache.length(0) == 0
    if kind == "draft_model":
        assert costs.draft_s_per_token > 0
        assert [m for m, _ in costs.prompt_reads] == list(DraftModelDrafter.CALIBRATION_READS)
        assert [m for m, _ in costs.resume_reads] == list(DraftModelDrafter.CALIBRATION_RESUMES)
        assert eng.drafter.cache.length(0) == 0
        assert costs.catch_up_time(100) > 0 and costs.catch_up_time(100, prompt=100) > 0
    else:  # prompt lookup has no calibration: its cost is measured by its rounds
        assert costs.draft_s_per_token is None and not costs.prompt_reads and not costs.resume_reads
    assert eng.generate(PROMPT, GREEDY).output_ids == plain_output
    # A controller passed in keeps the costs it came with.
    given = Recording()
    assert engine(target, make_drafter(kind, draft), 4, given).controller is given and not given.costs.target_s


def test_controller_choosing_too_many_drafts_is_an_error(target, draft):
    class Greedy(RandomK):
        def choose_k(self, seq, k_max):
            return k_max + 1

    eng = engine(target, make_drafter("ngram", draft), 4, Greedy(0))
    with pytest.raises(RuntimeError, match="controller chose k=5, outside 0..4"):
        eng.generate(PROMPT, GREEDY)


def test_adaptive_sampling_matches_plain_distribution(monkeypatch):
    # The harness seeds every draw so the test is deterministic; seeded sampled requests
    # normally draft a fixed k (so a seed reproduces its output), so let the controller choose.
    monkeypatch.setattr(engine_module, "_fixed_k", lambda seq: False)
    target, draft = target_and_draft()
    params = SETTINGS["temperature=1.0"]
    controller = Recording()
    eng = engine(target, make_drafter("draft_model", draft, 64), 2, controller)
    counts = sample_counts(lambda p: eng.generate(DIST_PROMPT, p).output_ids, params)
    pvalue, tv = goodness_of_fit(counts, exact_joint(target, params))
    print(f"adaptive: k chosen {dict(sorted(controller.chosen.items()))}, "
          f"acceptance {eng.metrics.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert controller.chosen[0] > 0 and controller.chosen[1] > 0  # both plain and drafting rounds
    assert passes(pvalue, tv)


def test_a_chain_that_stops_on_its_values_leaves_greedy_output_unchanged(target, draft, plain_output):
    """A draft model asked for 6 drafts a round stops wherever its path value falls below 0.5."""
    drafter = make_drafter("draft_model", draft)
    decisions: list[bool] = []

    def keep(seq, drafted, value):
        assert 0.0 <= value <= 1.0 and 1 <= drafted < 6
        decisions.append(value >= 0.5)
        return decisions[-1]

    drafter.bind_stop(keep)
    eng = engine(target, drafter, 6, FixedK())
    seq = eng.generate(PROMPT, GREEDY)
    print(f"went on {decisions.count(True)}, stopped {decisions.count(False)}; "
          f"{seq.metrics.num_draft_tokens} drafts in {seq.metrics.num_drafts} rounds")
    assert seq.output_ids == plain_output
    assert True in decisions and False in decisions
    assert seq.metrics.num_draft_tokens < 6 * seq.metrics.num_drafts  # some chains stopped short


def test_an_adaptive_engine_binds_its_controllers_stop_to_a_chain_draft_model(target, draft):
    """The controller's rule reaches a draft model's chain, and k is then a cap; a fixed k, a
    tree drafter and a drafter without values are left as they were."""
    drafter = make_drafter("draft_model", draft)
    adaptive = engine(target, drafter, 4)
    assert drafter._keep is not None and adaptive.controller.value_stops
    fixed_drafter = make_drafter("draft_model", draft)
    engine(target, fixed_drafter, 4, FixedK())
    assert fixed_drafter._keep is None
    tree = TreeDraftModelDrafter(loaded(draft), draft.config.vocab_size, 512, topk=2, budget=4)
    assert not engine(target, tree, 4).controller.value_stops and tree._keep is None
    assert not engine(target, make_drafter("ngram", draft), 4).controller.value_stops
