"""The speedup formula on hand-computed values, and the adaptive controller on synthetic streams.

The synthetic world: a verify pass over n positions takes t1 * (1 + alpha * (n - 1)) seconds,
drafting costs c * t1 per token, and draft i survives with probability p (given the ones before
it survived). The controller sees only what the engine would report.
"""

from __future__ import annotations

import random

import pytest

from verispec.speculative.controller import AdaptiveController, FixedK, RoundReport
from verispec.speculative.cost_model import CostModel, alpha_at_batch, expected_tokens, linear_verify_cost, speedups

T1 = 0.3  # seconds per plain step


class Request:
    """Stands in for an engine sequence (the controller keys per-request state on it)."""

    def __init__(self, prompt_tokens: int = 50, tokens_left: int = 10**6) -> None:
        self.num_tokens = self.num_prompt_tokens = prompt_tokens
        self.tokens_left = tokens_left  # what max_tokens still allows
        self.drafter_seen = 0  # tokens the simulated drafter has read


def simulate_round(controller, seq, k_max, p, alpha, c, rng, catch_up_s=0.0):
    """One round; returns (k, seconds, tokens committed). ``catch_up_s``: seconds per token a
    drafter pays, on its first draft, to read what it has not seen (prompt, plain rounds)."""
    k = controller.choose_k(seq, k_max)
    accepted = 0
    while accepted < k and rng.random() < p:
        accepted += 1
    draft_s = 0.0
    if k:
        draft_s = k * c * T1 + catch_up_s * (seq.num_tokens - seq.drafter_seen)
        seq.drafter_seen = seq.num_tokens + accepted + 1
    verify_s = T1 * (1 + alpha * k)
    seq.num_tokens += accepted + 1
    seq.tokens_left = max(seq.tokens_left - accepted - 1, 0)
    controller.observe(seq, RoundReport(k, accepted, accepted + 1, draft_s, verify_s))
    return k, draft_s + verify_s, accepted + 1


def run_phase(controller, seq, rounds, p, alpha=0.1, c=0.0, k_max=8, seed=0, catch_up_s=0.0):
    rng = random.Random(seed)
    return [simulate_round(controller, seq, k_max, p, alpha, c, rng, catch_up_s) for _ in range(rounds)]


def ks(rounds):
    return [k for k, _, _ in rounds]


def slowdown(rounds):
    """Time taken over the time plain decoding needs for the same tokens (1.0 = plain)."""
    return sum(s for _, s, _ in rounds) / (T1 * sum(n for _, _, n in rounds))


# ---- the formula ---------------------------------------------------------------------------


def test_expected_tokens_hand_computed():
    assert expected_tokens([0.8], 0) == 1.0
    assert expected_tokens([0.8], 2) == pytest.approx(1 + 0.8 + 0.64)
    assert expected_tokens([0.8, 0.5], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tokens([1.0], 5) == 6.0


def test_speedup_hand_computed_and_peak_for_p08_alpha01():
    s = speedups([0.8], 0.0, linear_verify_cost(0.1, 10))
    assert s[0] == 1.0
    assert s[1] == pytest.approx(1.8 / 1.1)
    assert s[4] == pytest.approx((1 + 0.8 + 0.64 + 0.512 + 0.4096) / 1.4)
    best = max(range(len(s)), key=s.__getitem__)
    assert best == 6 and 6 <= best <= 8  # the "peak near N = 6-8"
    assert s[6] == pytest.approx((1 - 0.8 ** 7) / 0.2 / 1.6)


def test_draft_cost_and_ceiling():
    # c = 0.4, alpha = 0.6 (a bf16 draft model on a CPU): speculation never pays at p = 0.7.
    s = speedups([0.7], 0.4, linear_verify_cost(0.6, 8))
    assert max(s[1:]) < 1.0
    assert s[1] == pytest.approx(1.7 / (0.4 + 1.6))
    # Perfect acceptance and a free drafter approach the 1/alpha ceiling from below.
    far = speedups([1.0], 0.0, linear_verify_cost(0.1, 1000))
    assert far[1000] < 10.0 and far[1000] > 9.9


def test_alpha_grows_toward_one_with_batch_size():
    assert alpha_at_batch(0.1, 1) == pytest.approx(0.1)
    assert alpha_at_batch(0.1, 10) == pytest.approx(1.0 / 1.9)
    assert 0.99 < alpha_at_batch(0.1, 10_000) < 1.0


@pytest.mark.parametrize("bad", [lambda: speedups([1.2], 0, [1.0, 1.1]), lambda: speedups([0.5], -1, [1.0]),
                                 lambda: expected_tokens([], 2), lambda: linear_verify_cost(-0.1, 3)])
def test_bad_inputs_are_clear_errors(bad):
    with pytest.raises(ValueError):
        bad()


# ---- the cost model ------------------------------------------------------------------------


def test_cost_model_interpolates_and_extrapolates_a_line():
    costs = CostModel()
    for n in (1, 2, 4):
        costs.observe_target(n, 2.0 + 0.5 * n)
    assert costs.target_time(4) == pytest.approx(4.0)  # measured
    assert costs.target_time(3) == pytest.approx(3.5)  # interpolated
    assert costs.target_time(8) == pytest.approx(6.0)  # extrapolated
    c, verify = costs.relative(3)
    assert c == 0.0 and verify == pytest.approx([1.0, 3.0 / 2.5, 3.5 / 2.5, 4.0 / 2.5])


def test_costs_keep_their_shape_while_the_machine_speed_drifts():
    """Calibrated at T1 = 100 ms (v(3) = 1.2, a draft 0.5 of a step, a 40-token catch-up 2
    steps), the machine then runs 1.4x slower for a while, seen by plain rounds only: v(3) and
    c stay, the catch-up costs 1.4x the seconds. Ratios of times taken at different speeds
    said v(3) = 0.86 and c = 0.36, and drafting looked a bargain."""
    costs = CostModel()
    for n, t in ((1, 0.1), (2, 0.11), (3, 0.12)):
        costs.observe_target(n, t)
    costs.observe_draft(1, 0.05)
    costs.observe_catch_up(40, 0, 0.2)
    for _ in range(30):
        costs.observe_target(1, 0.14)
    assert costs.speed == pytest.approx(1.4, rel=1e-3)
    c, verify = costs.relative(2)
    assert c == pytest.approx(0.5) and verify == pytest.approx([1.0, 1.1, 1.2])
    assert costs.catch_up_time(40) == pytest.approx(0.28, rel=1e-3)
    assert costs.target_s[3] == pytest.approx(0.12)  # what was measured, as measured
    # Drafting rounds alone (verify passes of 3) track the speed too: back to the reference. While
    # the speed lags, the passes of 3 also pull their shape a little (the price of learning it).
    for _ in range(30):
        costs.observe_target(3, 0.12)
    assert costs.speed == pytest.approx(1.0, rel=0.03) and costs.t1() == pytest.approx(0.1, rel=0.03)
    assert costs.relative(2)[1] == pytest.approx([1.0, 1.1, 1.2], rel=0.03)


def test_cost_model_needs_t1_and_uses_the_prior_slope_with_one_point():
    costs = CostModel(prior_alpha=0.1)
    assert costs.relative(4) is None
    costs.observe_target(1, 1.0)
    costs.observe_draft(4, 0.8)
    c, verify = costs.relative(2)
    assert c == pytest.approx(0.2) and verify == pytest.approx([1.0, 1.1, 1.2])


# ---- the controller on synthetic streams ---------------------------------------------------


def test_first_round_measures_plain_decoding():
    controller = AdaptiveController()
    assert controller.choose_k(Request(), 8) == 0


@pytest.mark.parametrize(("p", "alpha", "c"), [(0.8, 0.1, 0.0), (0.9, 0.2, 0.05), (0.6, 0.05, 0.02)])
def test_converges_to_the_optimum_of_a_known_cost_model(p, alpha, c):
    true = speedups([p], c, linear_verify_cost(alpha, 8))
    best = max(range(9), key=true.__getitem__)
    late = ks(run_phase(AdaptiveController(), Request(), 600, p, alpha, c))[200:]
    achieved = sum(true[k] for k in late) / len(late)
    typical = sorted(late)[len(late) // 2]
    print(f"p={p} alpha={alpha} c={c}: optimum k={best} ({true[best]:.3f}x); late median k={typical}, "
          f"range {min(late)}..{max(late)}, expected speedup of the choices {achieved:.3f}x")
    assert achieved > 0.93 * true[best]
    assert abs(typical - best) <= 2


def test_stays_plain_when_speculation_cannot_pay():
    # The draft model of a compute-bound CPU: c = 0.4, alpha = 0.6, p = 0.7 (best k > 0: 0.85x).
    rounds = run_phase(AdaptiveController(), Request(), 300, 0.7, alpha=0.6, c=0.4)
    assert sum(k > 0 for k in ks(rounds)[20:]) < 0.2 * 280
    assert slowdown(rounds[20:]) < 1.03


def test_turns_off_when_acceptance_collapses_and_comes_back():
    controller = AdaptiveController()
    seq = Request()
    on = run_phase(controller, seq, 150, 0.9, seed=1)
    assert all(k > 0 for k in ks(on)[50:])
    off = run_phase(controller, seq, 300, 0.0, seed=2)
    assert ks(off)[10:].count(0) > 0.7 * 290  # mostly plain rounds within a few rounds
    assert any(k > 0 for k in ks(off)[10:])  # but it keeps probing
    assert slowdown(off[10:]) < 1.035  # probes cost about the 3% budget
    back = ks(run_phase(controller, seq, 150, 0.9, seed=3))
    first_on = next(i for i in range(len(back)) if all(k > 0 for k in back[i:i + 20]))
    print(f"slowdown while off {slowdown(off[10:]):.3f}; speculating steadily again after {first_on} rounds")
    assert first_on <= 30


def test_expensive_catch_up_makes_probes_rare():
    """A drafter that must re-read idle tokens pays for it; the budget spaces probes out."""
    probes = []
    for catch_up in (0.0, 0.1 * T1):  # 0.1: a 0.5B draft's prefill per token against the 1.5B's step
        seq = Request()
        rounds = run_phase(AdaptiveController(), seq, 1000, 0.0, alpha=0.6, k_max=4, catch_up_s=catch_up)
        probes.append(sum(k > 0 for k in ks(rounds)))
        print(f"catch-up {catch_up / T1:.1f} T1 per token: {probes[-1]} probes, slowdown {slowdown(rounds[10:]):.3f}")
        assert slowdown(rounds[10:]) < 1.035
    assert probes[1] < probes[0] / 3


def test_a_new_request_does_not_probe_with_a_draft_prefill_it_has_not_earned():
    """Once the engine has measured what catching a draft model up costs per token, a new
    request whose prior says speculation does not pay waits, instead of paying the draft's
    prompt prefill for a probe at once."""
    controller = AdaptiveController()
    run_phase(controller, Request(), 100, 0.3, alpha=0.5, c=0.5, catch_up_s=0.1 * T1)
    # Measured from its one probe; the per-draft cost is not known yet (no two drafting rounds
    # in a row), so the probe's own drafts count as catch-up: an estimate on the safe side.
    assert 0.1 * T1 <= controller.costs.catch_up_time(50, prompt=50) / 50 < 1.3 * 0.1 * T1
    new = run_phase(controller, Request(prompt_tokens=200), 40, 0.3, alpha=0.5, c=0.5, catch_up_s=0.1 * T1)
    print(f"ks {ks(new)[:12]}, slowdown {slowdown(new):.3f}")
    assert ks(new) == [0] * 40
    assert slowdown(new) == pytest.approx(1.0)


def test_a_draft_model_reads_a_long_prompt_only_when_the_answer_can_repay_it():
    """Speculation pays (~2x predicted), but catching a draft model up on a 1,000-token prompt
    costs 100 plain steps: worth it for 2,000 tokens to come, not for 100 (saving ~50 steps)."""
    controller = AdaptiveController()
    run_phase(controller, Request(), 200, 0.9, alpha=0.2, c=0.05, catch_up_s=0.1 * T1)
    first = {}
    for prompt, left in ((1000, 100), (20, 100), (1000, 2000)):
        rounds = run_phase(controller, Request(prompt_tokens=prompt, tokens_left=left), 20, 0.9, alpha=0.2, c=0.05,
                           catch_up_s=0.1 * T1)
        first[prompt, left] = ks(rounds)
        print(f"prompt {prompt}, {left} tokens left: ks {ks(rounds)[:6]}, slowdown {slowdown(rounds):.3f}")
    assert first[1000, 100] == [0] * 20
    assert first[20, 100][0] > 0 and first[1000, 2000][0] > 0


def run_requests(controller, p, n, prompt=100, tokens=128, seed=0, **world):
    """``n`` requests of ``tokens`` tokens each; returns every round of all of them."""
    rng, rounds = random.Random(seed), []
    for _ in range(n):
        seq = Request(prompt_tokens=prompt, tokens_left=tokens)
        while seq.tokens_left > 0:
            rounds.append(simulate_round(controller, seq, min(8, seq.tokens_left - 1), p, rng=rng, **world))
    return rounds


def test_the_engine_pool_lets_a_draft_model_back_after_unpredictable_requests():
    """After requests where a draft model does not pay, the prior says "stay plain", and a new
    request's own budget never covers reading its prompt. The engine-wide pool funds one first
    probe once it holds that cost, so predictable requests get speculation back; without the
    pool (first_probe = 0) they never do."""
    world = {"alpha": 0.3, "c": 0.2, "catch_up_s": 0.05 * T1}
    drafted = {}
    for first_probe in (0.25, 0.0):
        controller = AdaptiveController(first_probe=first_probe)
        run_requests(controller, 0.3, 4, **world)
        later = run_requests(controller, 0.9, 6, seed=1, **world)
        drafted[first_probe] = (sum(k > 0 for k in ks(later)) / len(later), slowdown(later))
        print(f"first_probe {first_probe}: drafting rounds {drafted[first_probe][0]:.0%}, "
              f"slowdown {drafted[first_probe][1]:.3f}")
    assert drafted[0.0][0] == 0
    assert drafted[0.25][0] > 0.5 and drafted[0.25][1] < 0.85


def test_the_pool_does_not_fund_a_probe_that_costs_a_large_share_of_the_request():
    """At p = 0.9 these costs allow ~1.38x, so 128 tokens could save ~35 T1 at best; the pool
    pays a first probe up to a quarter of that (~8.7 T1)."""
    controller = AdaptiveController()
    world = {"alpha": 0.3, "c": 0.2, "catch_up_s": 0.05 * T1}
    run_requests(controller, 0.3, 4, **world)
    controller.pool = 100 * T1  # as after a long run of plain rounds: far more than one catch-up
    long = run_requests(controller, 0.9, 1, prompt=400, tokens=128, **world)  # reading it: 20 T1
    assert ks(long) == [0] * len(long)
    short = run_requests(controller, 0.9, 1, prompt=100, tokens=128, **world)  # 5 T1: funded
    assert any(ks(short))


def test_the_pool_funds_no_probe_where_a_draft_model_gains_little_even_at_best():
    """This CPU's 0.5B-for-1.5B costs (c ~ 0.55, alpha ~ 0.27): even if every draft survived 90%
    of the time, speculation would gain ~3%, about 1 T1 over a 128-token answer, so reading a
    60-token prompt (5.4 T1) for a probe never pays back, however full the pool. (Measured before
    this rule: such probes cost 10-20% on 15-35-token answers.)"""
    world = {"alpha": 0.27, "c": 0.55, "catch_up_s": 0.09 * T1}
    controller = AdaptiveController()
    run_requests(controller, 0.3, 2, prompt=60, **world)
    assert controller.costs.draft_s_per_token is not None  # the first request measured the drafter
    controller.pool = 100 * T1
    later = run_requests(controller, 0.9, 4, prompt=60, seed=1, **world)
    print(f"drafting rounds {sum(k > 0 for k in ks(later))} of {len(later)}, slowdown {slowdown(later):.3f}")
    assert ks(later) == [0] * len(later)
    assert controller.pool == pytest.approx(100 * T1 + 0.03 * T1 * len(later))


def test_a_drafting_request_is_not_stopped_by_noise_where_speculation_pays():
    """Prompt lookup where k = 1 gains ~14% (p = 0.6, alpha = 0.4): a noisy estimate dips below
    break-even now and then; tolerating a predicted 5% loss before stopping keeps the gain."""
    result = {}
    for stay in (0.05, 0.0):
        rounds = run_requests(AdaptiveController(stay=stay), 0.6, 8, alpha=0.4, c=0.0)
        result[stay] = slowdown(rounds)
        print(f"stay {stay}: speedup {1 / result[stay]:.3f}")
    assert 1 / result[0.05] > 1 / result[0.0] + 0.02
    assert 1 / result[0.05] > 1.05


def run_lookahead_like(report_positions: bool, rounds: int = 300, window: int = 4, alpha: float = 0.4) -> float:
    """Lookahead's shape: every drafting round also verifies a window of ``window`` positions,
    and the n-gram pool has a draft only 20% of the time. Returns the slowdown against plain."""
    controller, rng, seq = AdaptiveController(), random.Random(0), Request()
    total = committed = 0.0
    for _ in range(rounds):
        k = controller.choose_k(seq, 3)
        n = k if k and rng.random() < 0.2 else 0
        accepted = 0
        while accepted < n and rng.random() < 0.7:
            accepted += 1
        positions = 1 + n + (window if k else 0)
        verify_s = T1 * (1 + alpha * (positions - 1))
        seq.num_tokens += accepted + 1
        controller.observe(seq, RoundReport(n, accepted, accepted + 1, 0.0, verify_s,
                                            num_positions=positions if report_positions else 0))
        total, committed = total + verify_s, committed + accepted + 1
    return total / (T1 * committed)


def test_a_drafters_extra_verified_positions_are_priced():
    """Told how many positions each verify pass computed, the controller prices the window and
    counts a round with a window but no draft as a miss, so it stops paying for the window; seeing
    only the drafts (as before), it took window-only rounds for plain ones and kept paying."""
    priced, blind = run_lookahead_like(True), run_lookahead_like(False)
    print(f"slowdown with positions reported {priced:.3f}, without {blind:.3f}")
    assert priced < 1.04
    assert blind > priced + 0.1


def test_new_requests_start_from_the_engine_wide_prior():
    controller = AdaptiveController()
    run_phase(controller, Request(), 200, 0.0, alpha=0.3)
    assert controller.prior[0] < 0.3
    run_phase(controller, Request(), 300, 0.95, alpha=0.3)
    assert controller.prior[0] > 0.6


def test_a_new_request_does_not_trust_a_prior_shaped_by_others():
    """After predictable requests the prior says "draft deep"; a new, unpredictable request
    must not pay for that: its k ramps up from what it has tested itself."""
    losses = {}
    for ramp in (2, 8):  # 8 = no ramp at k_max 8
        controller = AdaptiveController(ramp=ramp)
        run_phase(controller, Request(), 200, 0.97, alpha=0.1)
        assert controller.prior[7] > 0.8
        new = run_phase(controller, Request(), 24, 0.1, alpha=0.1, seed=5)
        losses[ramp] = slowdown(new) - 1
        print(f"ramp {ramp}: first ks {ks(new)[:6]}, slowdown {slowdown(new):.3f}")
    assert losses[2] < 0.5 * losses[8]


def test_the_round_that_shows_speculation_stopped_paying_is_charged():
    """With an expensive draft model (c and alpha of the int4 0.5B/1.5B pair on this CPU), a new
    24-token request whose drafts fail stops at once: the failed round's loss is charged to the
    probe budget, so no probe follows right after it, and so short an answer cannot repay more
    rounds of evidence (``settle``)."""
    controller = AdaptiveController()
    run_phase(controller, Request(), 200, 0.95, alpha=0.3, c=0.45)
    new = run_phase(controller, Request(tokens_left=24), 24, 0.1, alpha=0.3, c=0.45, seed=5)
    print(f"ks {ks(new)[:8]}, slowdown {slowdown(new):.3f}")
    assert ks(new)[0] > 0 and ks(new)[1:].count(0) >= 20
    assert slowdown(new) < 1.07


def test_ramp_still_reaches_a_deep_optimum_quickly():
    rounds = ks(run_phase(AdaptiveController(), Request(), 40, 0.95, alpha=0.05))
    print(f"ks: {rounds[:12]}")
    assert max(rounds[:8]) == 8  # 0 (measures T1), then 2, 4, 6, 8 while drafts survive


# ---- trees: the node budget ------------------------------------------------------------------


def tree_controller(alpha: float, max_nodes: int = 8) -> AdaptiveController:
    """A controller that has measured T_target(n) = T1 * (1 + alpha * (n - 1)) for every width."""
    controller = AdaptiveController()
    for n in range(1, max_nodes + 2):
        controller.costs.observe_target(n, T1 * (1 + alpha * (n - 1)))
    return controller


@pytest.mark.parametrize("alpha, draft_s, expected", [
    # values 0.9 0.5 0.3 0.05; tokens per unit time for m = 1..4 nodes:
    (0.1, 0.0, 3),  # 1.9/1.1=1.73  2.4/1.2=2.00  2.7/1.3=2.08  2.75/1.4=1.96
    (0.5, 0.0, 1),  # 1.9/1.5=1.27  2.4/2.0=1.20  2.7/2.5=1.08  2.75/3.0=0.92
    (0.5, T1, 2),  # drafting already paid (1 T1): 1.9/2.5=0.76  2.4/3.0=0.80  2.7/3.5=0.77  2.75/4.0=0.69
])
def test_node_budget_hand_computed(alpha, draft_s, expected):
    controller = tree_controller(alpha)
    assert controller.choose_nodes(Request(), (0.9, 0.5, 0.3, 0.05), draft_s) == expected


def simulate_tree(controller, rounds, scale, alpha, seed=0):
    """Trees whose node i (best first) has draft value 0.9**i while verification accepts it with
    probability scale * 0.9**i (a chain of nodes, so an accepted node's ancestors are accepted).
    Returns the node budgets chosen."""
    rng, seq, chosen = random.Random(seed), Request(), []
    values = tuple(0.9 ** i for i in range(1, 7))
    for _ in range(rounds):
        m = controller.choose_nodes(seq, values, 0.0)
        accepted = 0
        while accepted < m and rng.random() < (scale * 0.9 if accepted == 0 else 0.9):
            accepted += 1
        controller.observe(seq, RoundReport(m, accepted, accepted + 1, 0.0, T1 * (1 + alpha * m),
                                            num_positions=m + 1, depth=m))
        chosen.append(m)
    return chosen


def true_rates(scale, alpha):
    """Tokens per plain-step time for m = 1..6 in the world of :func:`simulate_tree`."""
    return [(1 + sum(scale * 0.9 ** i for i in range(1, m + 1))) / (1 + alpha * m) for m in range(1, 7)]


@pytest.mark.parametrize("scale", [0.4, 1.1])
def test_node_budget_calibrates_to_the_acceptance_it_sees(scale):
    """Overconfident drafts (verification accepts 0.4x what the draft values say) shrink the
    budget from five of six nodes to the few worth a position; underconfident ones keep it near full.
    Either way the budget settles where the true tokens per second are within 2% of the best."""
    alpha = 0.3
    controller = tree_controller(alpha)
    chosen = simulate_tree(controller, 300, scale, alpha)
    rates = true_rates(scale, alpha)
    good = {m for m, r in enumerate(rates, start=1) if r >= 0.98 * max(rates)}
    late = chosen[-200:]
    print(f"scale {scale}: first budgets {chosen[:8]}, late mean {sum(late) / len(late):.2f}, good {sorted(good)}")
    assert chosen[0] == 5  # calibration 1 until measured: 5 of 6 nodes at alpha 0.3
    assert sum(m in good for m in late) >= 0.9 * len(late)
    assert good == ({1, 2, 3} if scale < 1 else {4, 5, 6})


def test_a_tree_round_is_learned_by_depth_and_its_breadth_priced():
    """A tree of 6 nodes and depth 3 that accepted a path of 2: depths 1..3 were tested (not 6
    positions), drafting cost is per depth level, and the 3 nodes off the longest path are priced
    as extra verify positions in the choice of depth."""
    controller = tree_controller(0.1)
    seq = Request()
    for _ in range(2):  # the first drafting round also reads the prompt: not a per-level sample
        controller.choose_k(seq, 4)
        controller.observe(seq, RoundReport(6, 2, 3, 0.3 * T1, T1 * 1.6, num_positions=7, depth=3))
    req = controller._requests[seq]
    assert req.trials == [2, 2, 2] and req.depth == 3
    assert controller.costs.extra_positions == 3
    c, verify = controller.costs.relative(4)
    assert c == pytest.approx(0.1)  # 0.3 T1 over 3 depth levels
    assert verify[2] == pytest.approx(1 + 0.1 * 5)  # depth 2 + root + 3 off-path nodes = 6 positions


def test_catch_up_cost_is_a_line_through_measured_reads_not_a_rate_per_token():
    """A draft model reads a short prompt at several times the per-token cost of a long one
    (measured with the 0.5B int4 draft on an AMX Xeon: 20 tokens 134 ms, 100 tokens 208 ms).
    Priced per token from a short first read, a 100-token prompt looked 3x dearer than it is and
    the adaptive draft row of the issue-8 benchmark never probed (1.00x plain, where fixed k = 2
    ran at 1.12x). The first round's own draft (37 ms) is taken out once a draft is timed."""
    costs = CostModel()
    costs.observe_catch_up(missed=20, drafted=1, seconds=0.134 + 0.037, prompt=20)
    assert costs.catch_up_time(20, prompt=20) == pytest.approx(0.171)  # provisional: the draft counts
    costs.observe_draft(tokens=1, seconds=0.037)
    assert costs.catch_up_time(20, prompt=20) == pytest.approx(0.134)
    costs.observe_catch_up(missed=100, drafted=2, seconds=0.208 + 2 * 0.037, prompt=100)
    slope = (0.208 - 0.134) / 80
    assert costs.catch_up_time(80, prompt=80) == pytest.approx(0.134 + slope * 60)
    assert costs.catch_up_time(80, prompt=80) < 0.4 * 80 * 0.134 / 20  # the per-token price: 0.536 s
    assert costs.catch_up_time(0) == 0.0


def test_a_return_to_drafting_is_priced_by_catch_ups_on_generated_tokens_not_by_prompt_reads():
    """Tokens generated while a draft model idled are read in decode-sized passes, at ~5 ms a
    token where a 256-token prompt costs ~1.5 (0.5B int4 draft, AMX Xeon). Priced like a prompt,
    a return to drafting after 40 plain tokens looked to cost 60 ms, not 200."""
    costs = CostModel()
    costs.observe_draft(tokens=1, seconds=0.05)
    for tokens, seconds in ((64, 0.16), (256, 0.38)):
        costs.observe_catch_up(tokens, 0, seconds, prompt=tokens)
    # Until a return has been timed, generated tokens are priced by the prompt reads.
    assert costs.catch_up_time(40) == pytest.approx(costs.catch_up_time(40, prompt=40))
    for tokens, seconds in ((8, 0.09), (32, 0.2)):
        costs.observe_catch_up(tokens, 0, seconds)
    assert costs.catch_up_time(40) == pytest.approx(0.09 + 0.11 / 24 * 32)
    assert costs.catch_up_time(64, prompt=64) == pytest.approx(0.16)  # prompt reads keep their own line
    # A first catch-up reads the prompt and then what plain rounds generated: the generated part
    # is priced as a return, and the rest is a prompt read sample (here 0.6 s for 160 tokens).
    costs.observe_catch_up(200, 1, 0.6 + costs.catch_up_time(40) + 0.05, prompt=160)
    assert costs.prompt_reads[-1] == (160, pytest.approx(0.6))
    assert costs.catch_up_time(200, prompt=160) == pytest.approx(
        costs.catch_up_time(160, prompt=160) + costs.catch_up_time(40))


def run_answer(controller, phases, prompt=50, seed=0, **world):
    """One request through ``phases`` [(tokens, p)]: its content changes predictability."""
    rng, rounds = random.Random(seed), []
    seq = Request(prompt_tokens=prompt, tokens_left=sum(tokens for tokens, _ in phases))
    for tokens, p in phases:
        stop = seq.tokens_left - tokens
        while seq.tokens_left > stop:
            rounds.append(simulate_round(controller, seq, min(8, seq.tokens_left - 1), p, rng=rng, **world))
    return rounds


def test_one_failed_first_probe_does_not_stop_a_draft_model_for_the_whole_answer():
    """Benchmark coding q121 on this CPU: the draft model's first probe drafted 2 and both failed
    on the answer's opening words, and the request then ran 126 plain rounds, while fixed k = 2
    accepted 88% and ran 1.08x plain. A return was never affordable, since catching a draft
    model up costs more per plain round than the 3% budget earns. With ``settle`` = 3 a request
    drafts on while in sync until 3 rounds have tested its first position; with 1 it stops at
    once."""
    world = {"alpha": 0.15, "c": 0.45, "catch_up_s": 0.05 * T1}
    result = {}
    for settle in (3, 1):
        controller = AdaptiveController(settle=settle)
        run_requests(controller, 0.8, 3, prompt=50, **world)  # earlier answers: the draft pays
        rounds = run_answer(controller, [(1, 0.0), (127, 0.9)], seed=1, **world)
        result[settle] = rounds
        print(f"settle {settle}: ks {ks(rounds)[:8]}, drafting rounds {sum(k > 0 for k in ks(rounds))} "
              f"of {len(rounds)}, speedup {1 / slowdown(rounds):.3f}")
    assert ks(result[1])[0] > 0 and ks(result[1])[1:] == [0] * (len(result[1]) - 1)
    assert sum(k > 0 for k in ks(result[3])[3:]) > 0.9 * (len(result[3]) - 3)
    assert 1 / slowdown(result[3]) > 1 / slowdown(result[1]) + 0.05


def test_evidence_rounds_are_not_spent_where_unpredictable_content_stays_so():
    """The other side of ``settle``: on an answer that stays unpredictable, the extra rounds of
    evidence cost a bounded few percent over a 128-token answer, and the request then stops."""
    world = {"alpha": 0.15, "c": 0.45, "catch_up_s": 0.05 * T1}
    result = {}
    for settle in (3, 1):
        controller = AdaptiveController(settle=settle)
        run_requests(controller, 0.8, 3, prompt=50, **world)
        result[settle] = run_answer(controller, [(128, 0.05)], seed=1, **world)
        print(f"settle {settle}: ks {ks(result[settle])[:8]}, slowdown {slowdown(result[settle]):.3f}")
    assert sum(k > 0 for k in ks(result[3])) <= 3
    assert ks(result[3])[3:] == [0] * (len(result[3]) - 3)
    assert slowdown(result[3]) < slowdown(result[1]) + 0.04


def calibrated(alpha: float, c: float, catch_up_s: float) -> AdaptiveController:
    """A fresh controller whose costs are seeded as an engine's calibration seeds them."""
    controller = AdaptiveController()
    for n in range(1, 10):
        controller.costs.observe_target(n, T1 * (1 + alpha * (n - 1)))
    controller.costs.observe_draft(1, c * T1)
    for tokens in (32, 64):
        controller.costs.observe_catch_up(tokens, 0, catch_up_s * tokens)
        controller.costs.observe_catch_up(tokens, 0, catch_up_s * tokens, prompt=tokens)
    return controller


def test_a_fresh_engine_probes_its_first_request_without_an_earned_pool():
    """Benchmark math_reasoning q401 on this CPU: the first request of a freshly built engine
    drafted in none of 127 rounds, while fixed k = 1 accepted 92% (1.25x plain). Its guessed prior
    (0.5) predicts no gain, and the pool, empty in a fresh engine, would take ~100 plain rounds to
    pay for reading the prompt. Nothing has shown that speculation does not pay, so the first
    probe needs only the catch-up to be a small share of what it could save; once the prior has
    been taught, an unfunded probe waits for the pool again."""
    world = {"alpha": 0.15, "c": 0.45, "catch_up_s": 0.05 * T1}
    controller = calibrated(**world)
    first = run_answer(controller, [(128, 0.9)], prompt=60, **world)
    print(f"first answer: ks {ks(first)[:6]}, drafting rounds {sum(k > 0 for k in ks(first))} of {len(first)}, "
          f"speedup {1 / slowdown(first):.3f}")
    assert ks(first)[0] > 0 and 1 / slowdown(first) > 1.1
    controller = calibrated(**world)
    run_answer(controller, [(128, 0.2)], prompt=60, **world)  # the prior now says: does not pay
    controller.pool = 0.0
    second = run_answer(controller, [(128, 0.9)], prompt=60, seed=1, **world)
    assert ks(second)[:20] == [0] * 20


def test_what_drafting_gains_beyond_its_debt_funds_later_first_probes():
    """Benchmark writing q83 and roleplay q92 on this CPU: later requests of a long-running engine
    never probed, although fixed k = 1 accepted 60-70% (q92 ran 1.25x plain). The prior predicted
    a gain under the margin, and the pool, filled only by 3% of each plain round and drained by the
    first probes of unpredictable requests, never held a prompt read. What a drafting round gains
    beyond what its request owes now goes to the pool (the request's own budget stays capped at
    zero), so what the engine has earned by speculating pays for finding out whether a new
    request is predictable; the pool still funds one first probe per request."""
    world = {"alpha": 0.15, "c": 0.45, "catch_up_s": 0.05 * T1}
    controller = calibrated(**world)
    first = run_answer(controller, [(128, 0.9)], prompt=60, **world)
    saved = T1 * sum(n for _, _, n in first) - sum(s for _, s, _ in first)
    print(f"first answer saved {saved / T1:.1f} T1; pool {controller.pool / T1:.1f} T1")
    assert saved > 15 * T1 and controller.pool > 0.5 * saved
    hard = run_requests(controller, 0.1, 3, prompt=60, seed=1, **world)
    gains = speedups(controller.prior[:8], *controller.costs.relative(8))
    print(f"unpredictable requests: slowdown {slowdown(hard):.3f}; the prior then predicts {max(gains):.3f}x; "
          f"pool {controller.pool / T1:.1f} T1")
    assert max(gains) < 1.02 and slowdown(hard) < 1.05
    later = run_answer(controller, [(128, 0.9)], prompt=60, seed=3, **world)
    print(f"a predictable request: ks {ks(later)[:6]}, speedup {1 / slowdown(later):.3f}")
    assert ks(later)[0] > 0 and 1 / slowdown(later) > 1.1


def run_prompt_lookup_like(p: float, k_max: int, adaptive: bool, seed: int, match: float = 0.5,
                           alpha: float = 0.14) -> tuple[float, float]:
    """Prompt lookup's shape: 8 answers of 128 tokens, a match (1 or 2 drafts) in half the rounds,
    nothing to propose in the others. Returns (speedup, share of the match rounds that drafted)."""
    controller = AdaptiveController() if adaptive else FixedK()
    rng, total, committed, matched, drafted = random.Random(seed), 0.0, 0, 0, 0
    for _ in range(8):
        seq = Request(tokens_left=128)
        while seq.tokens_left > 0:
            k = controller.choose_k(seq, min(k_max, seq.tokens_left - 1))
            has = rng.random() < match
            n = min(k, rng.choice((1, 2))) if has else 0
            accepted = 0
            while accepted < n and rng.random() < p:
                accepted += 1
            verify_s = T1 * (1 + alpha * n)
            seq.num_tokens += accepted + 1
            seq.tokens_left = max(seq.tokens_left - accepted - 1, 0)
            controller.observe(seq, RoundReport(n, accepted, accepted + 1, 0.0, verify_s))
            total, committed = total + verify_s, committed + accepted + 1
            matched, drafted = matched + has, drafted + (n > 0)
    return T1 * committed / total, drafted / matched


def test_rounds_without_a_match_do_not_end_drafting():
    """Benchmark math_reasoning q402 and q403, prompt lookup on this CPU: fixed k = 1 drafted in 64
    of 96 and 54 of 113 rounds (acceptance 48% and 26%), the adaptive row in 21 of 116 and 9 of 127.
    A round in which the drafter found no match used to count as a plain round, so the next one
    needed the 2% margin instead of tolerating a predicted 5% loss, and an estimate near
    break-even stopped the request for many rounds. Here k = 1 gains ~10%."""
    adaptive = [run_prompt_lookup_like(0.35, 8, True, seed) for seed in range(4)]
    fixed = [run_prompt_lookup_like(0.35, 1, False, seed)[0] for seed in range(4)]
    speedup, share = sum(s for s, _ in adaptive) / 4, sum(d for _, d in adaptive) / 4
    print(f"adaptive {speedup:.3f}, drafting in {share:.0%} of the match rounds; fixed k = 1 {sum(fixed) / 4:.3f}")
    assert share > 0.88
    assert speedup > 0.98 * sum(fixed) / 4


# ---- a chain drafter that stops on its draft values ----------------------------------------

def trained(p=0.8, alpha=0.1, c=0.3):
    controller = AdaptiveController()
    seq = Request()
    run_phase(controller, seq, 100, p, alpha, c)
    return controller, seq


def test_keep_drafting_hand_computed():
    """One more draft while value * (the request's acceptance estimate there) >= c + v(n + 2) - v(n + 1)."""
    controller, seq = trained()
    for drafted in (1, 2, 3):
        c, verify = controller.costs.relative(drafted + 1)
        rate = controller._estimates(controller._request(seq), drafted + 1)[drafted]  # the request's own
        need = (c + verify[drafted + 1] - verify[drafted]) / rate
        print(f"after {drafted}: c {c:.3f}, extra position {verify[drafted + 1] - verify[drafted]:.3f}, "
              f"rate {rate:.3f}: value needed {need:.3f}")
        assert 0.3 < need < 0.6  # c = 0.3, alpha = 0.1, p = 0.8 in this world: (0.3 + 0.1) / 0.8
        assert controller.keep_drafting(seq, drafted, need * 1.01)
        assert not controller.keep_drafting(seq, drafted, need * 0.99)


def test_keep_drafting_drafts_on_before_costs_are_measured():
    assert AdaptiveController().keep_drafting(Request(), 1, 0.0)
    assert FixedK().keep_drafting(Request(), 1, 0.0)


def test_a_value_stopping_drafter_is_asked_for_the_deepest_k_its_ramp_allows():
    plain, seq = trained()
    stopping, stopping_seq = trained()
    stopping.value_stops = True
    k, capped = plain.choose_k(seq, 8), stopping.choose_k(stopping_seq, 8)
    depth = stopping._request(stopping_seq).depth
    print(f"k chosen {k}, with value stops {capped} (deepest tested position {depth})")
    assert 0 < k < capped == min(8, depth + stopping.ramp)
    # where speculation does not pay, a cap changes nothing: no drafts either way
    never, never_seq = trained(p=0.05, c=0.5)
    never.value_stops = True
    assert never.choose_k(never_seq, 8) == 0


def simulate_valued_round(controller, seq, k_max, rng, alpha, c, stops):
    """A world where each draft is confident (value 0.95, 70% of drafts) or unsure (0.2), and
    survives with its value: a drafter that stops on values can skip the unsure ones."""
    k = controller.choose_k(seq, k_max)
    drafted, accepted, value, alive = 0, 0, 1.0, True
    while drafted < k:
        p = 0.95 if rng.random() < 0.7 else 0.2
        drafted += 1
        value *= p
        if alive and rng.random() < p:
            accepted += 1
        else:
            alive = False
        if stops and drafted < k and not controller.keep_drafting(seq, drafted, value):
            break
    draft_s = drafted * c * T1
    verify_s = T1 * (1 + alpha * drafted)
    seq.num_tokens += accepted + 1
    controller.observe(seq, RoundReport(drafted, accepted, accepted + 1, draft_s, verify_s))
    return drafted, draft_s + verify_s, accepted + 1


def test_stopping_on_draft_values_beats_the_best_fixed_depth():
    """In that world (c = 0.3, alpha = 0.08) the controller's stop makes decoding faster than
    without it, by more than a few percent (0.89-0.92 of its time over three seeds)."""
    slow = {}
    for stops in (False, True):
        controller, seq, rng = AdaptiveController(), Request(), random.Random(3)
        controller.value_stops = stops
        rounds = [simulate_valued_round(controller, seq, 8, rng, 0.08, 0.3, stops) for _ in range(1500)][300:]
        slow[stops] = slowdown(rounds)
        print(f"value stops {stops}: time over plain {slow[stops]:.3f}, mean drafts {sum(ks(rounds)) / len(rounds):.2f}")
    assert slow[True] < 0.95 * slow[False]
