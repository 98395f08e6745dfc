"""``verispec plan``: the table, the optimum, the ceiling, the plot and the measurement."""

from __future__ import annotations

import pytest

from tiny import tiny_model
from verispec.cli import main
from verispec.plan import fit_alpha, format_plan, make_plan, measure, plot_plan


def test_plan_for_p08_alpha01_free_drafter_peaks_at_6():
    plan = make_plan([0.8], 0.0, 0.1, max_n=10)
    n, tokens, cost, gain = plan.best
    assert (n, tokens, cost) == (6, pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096 + 0.32768 + 0.262144), 1.6)
    assert gain == pytest.approx(3.951424 / 1.6)
    assert plan.ceiling == pytest.approx(10.0)
    text = format_plan(plan)
    assert "optimal N = 6 (2.470x)" in text and "1/alpha = 10.00x" in text


def test_plan_with_costly_drafter_says_decode_plainly():
    plan = make_plan([0.7], 0.4, 0.6, max_n=8)
    assert plan.best[0] == 0
    assert "does not pay" in format_plan(plan)


def test_batch_size_raises_alpha():
    assert make_plan([0.8], 0.0, 0.1, 4, batch_size=10).alpha == pytest.approx(1.0 / 1.9)


def test_plot_is_written(tmp_path):
    out = tmp_path / "plan.png"
    plot_plan(make_plan([0.9, 0.7], 0.1, 0.2, 8), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fit_alpha_on_a_line():
    assert fit_alpha({1: 2.0, 2: 3.0, 3: 4.0, 5: 6.0}) == pytest.approx(0.5)


def test_measure_times_a_target_and_a_draft():
    target, draft = tiny_model(seed=1), tiny_model(seed=2, layers=1)
    alpha, c, raw = measure(target, draft, batch_size=2, repeats=1)
    assert alpha >= 0 and c > 0
    assert sorted(raw["target_s"]) == list(range(1, 10)) and raw["draft_s"] > 0


def test_cli_prints_the_table(capsys):
    assert main(["plan", "--acceptance", "0.8", "--alpha", "0.1", "--max-n", "8"]) == 0
    assert "optimal N = 6" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--alpha", "0.1"], "give --acceptance P or --per-position"),
    (["--acceptance", "0.8"], "give --alpha A or --measure MODEL"),
    (["--acceptance", "1.5", "--alpha", "0.1"], "acceptance rates must be in [0, 1]"),
    (["--per-position", "0.9,x", "--alpha", "0.1"], "--per-position must be comma-separated numbers"),
    (["--acceptance", "0.8", "--alpha", "-1"], "alpha must be >= 0"),
    (["--acceptance", "0.8", "--alpha", "0.1", "--draft", "d"], "--draft needs --measure"),
    (["--acceptance", "0.8", "--alpha", "0.1", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--acceptance", "0.8", "--alpha", "0.1", "--max-n", "0"], "max N must be >= 1"),
])
def test_cli_bad_input_is_a_clear_error(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
