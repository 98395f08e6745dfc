"""The bench harness end to end on tiny models: report files, equality check, --compare, Ctrl-C,
--resume.

The harness runs on a tiny random bf16 target (plus a perturbed copy as draft model) with a
toy chat format, on an inline JSONL with three categories, one of them two-turn. A drafter that
breaks its contract (it overwrites a committed token) is registered for the test only, and the
equality check must flag it at the exact token it corrupted.
"""

from __future__ import annotations

import io
import json
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest

from verispec.bench import methods as bench_methods
from verispec.bench.goals import Goals
from verispec.bench.harness import run_and_report
from verispec.bench.report import load_report
from verispec.bench.runner import Settings
from verispec.bench.workloads import OVERALL, load_workload
from verispec.config import SamplingParams
from verispec.cli import main
from verispec.speculative import registry
from verispec.speculative.base import Drafter, Proposal

from tiny import LETTERS, loaded, tiny_model

VOCAB = 48
QUESTIONS = [
    {"question_id": 1, "category": "alpha", "turns": ["abcab abcab", "again abc"]},
    {"question_id": 2, "category": "alpha", "turns": ["unused"]},
    {"question_id": 3, "category": "beta", "turns": ["xyzxyz xyz"]},
    {"question_id": 4, "category": "gamma", "turns": ["hello hello"]},
]
# The draft method keeps a fixed k: the tiny draft costs as much as the tiny target, so an
# adaptive controller (rightly) would not draft, and the report would have no acceptance to show.
METHODS = "plain,ngram@k=3,prompt_lookup_max=2,draft_model:tiny-draft@k=2,adaptive=false,corrupt@k=2"
MAX_TOKENS = 8


class ToyFormat:
    """One token per character (ids mod the vocabulary), a role marker per message."""

    def encode(self, messages):
        ids = []
        for m in messages:
            ids.append(1 if m["role"] == "user" else 2)
            ids += [LETTERS.index(c) % VOCAB if c in LETTERS else 0 for c in m["content"]]
        return ids + [2]

    def decode(self, ids):
        return "".join(LETTERS[i % len(LETTERS)] for i in ids)


class CorruptingDrafter(Drafter):
    """Proposes nothing useful and, on its first feedback, overwrites the last committed token."""

    corrupted_at: list[int] = []

    def start(self, seq):
        self.done = False

    def propose(self, seq, k):
        return Proposal([0] * k)

    def feedback(self, seq, outcome):
        if not self.done and len(seq.output_ids) < seq.params.max_tokens:
            seq.output_ids[-1] = (seq.output_ids[-1] + 1) % VOCAB
            CorruptingDrafter.corrupted_at.append(len(seq.output_ids) - 1)
            self.done = True

    def finish(self, seq):
        pass


def make_runner(out_root: Path, methods: str = METHODS, max_turns: int | None = None, goals: Goals = Goals()):
    """A function that runs the harness on the tiny models and returns the report."""
    target_model = tiny_model(VOCAB, seed=0)
    draft_model = tiny_model(VOCAB, seed=1, noise_from=target_model, noise=0.05)
    qfile = out_root / "questions.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    workload = load_workload(str(qfile), None, 1, max_turns)
    meta = {"command": "test", "model": "tiny", "dtype": "bfloat16",
            "machine": {"date": "now", "cpu": "cpu", "cpu_count": 1, "torch_threads": 1, "torch": "t",
                        "transformers": "t", "loadavg_start": 0.0, "revision": "0123abcd"}}

    def run(out: Path, settings: Settings, previous: dict | None = None) -> dict:
        specs = bench_methods.parse_methods(methods)
        return run_and_report(loaded(target_model), ToyFormat(), specs, workload, settings, out,
                              lambda name, quantization: loaded(draft_model, name=name), meta,
                              previous=previous, goals=goals)

    return run


@contextmanager
def corrupt_registered():
    CorruptingDrafter.corrupted_at = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry._REGISTRY, "corrupt", lambda config, context: CorruptingDrafter())
        yield mp


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One run, two repeats, shared by the report and --compare tests: (report, out dir, stdout)."""
    root = tmp_path_factory.mktemp("bench")
    stdout = io.StringIO()
    with corrupt_registered(), redirect_stdout(stdout):
        report = make_runner(root)(root / "out", Settings(max_tokens=MAX_TOKENS, repeats=2, warmup=False,
                                                          progress=False))
    return report, root / "out", stdout.getvalue(), list(CorruptingDrafter.corrupted_at)


def test_report_is_complete_and_flags_the_broken_method(full_run):
    report, out, stdout, corrupted_at = full_run
    for name in ("report.json", "report.md", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0
    for name in ("speedup.png", "acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["partial"] is False and on_disk["blocks_done"] == on_disk["blocks_planned"] == 6
    last = stdout.rstrip("\n").splitlines()[-1]
    assert json.loads(last) == {k: v for k, v in on_disk.items() if k != "runs"}
    assert "| corrupt@k=2 |" in stdout and "PARTIAL" not in stdout

    labels = ["plain", "ngram@k=3,prompt_lookup_max=2", "draft_model:tiny-draft@k=2,adaptive=false", "corrupt@k=2"]
    assert list(report["results"]) == labels
    for label in labels:
        assert set(report["results"][label]) == {"alpha", "beta", "gamma", "overall"}
        overall = report["results"][label]["overall"]
        assert overall["turns"] == 8 and overall["tok_s"] > 0 and len(overall["tok_s_by_repeat"]) == 2
    for label in labels[:3]:  # lossless methods: every answer identical to plain
        assert report["results"][label]["overall"]["identical"] == 8
    assert report["results"][labels[2]]["overall"]["mean_acceptance_length"] > 1.0
    assert report["results"][labels[2]]["overall"]["per_position_acceptance"]

    broken = report["results"]["corrupt@k=2"]["overall"]
    assert broken["identical"] == 0 and broken["compared"] == 8
    assert broken["first_divergence"]["index"] == corrupted_at[0]
    assert report["goals"]["verispec_t0_identical"]["met"] is False

    # the details table gives each method's prompt time: end to end minus decode
    md = (out / "report.md").read_text()
    assert "| decode speedup | prompt s |" in md
    plain = report["results"]["plain"]["overall"]
    row = next(line for line in md.splitlines() if line.startswith("| plain | overall |"))
    assert row.split(" | ")[6] == f"{plain['total_s'] - plain['decode_s']:.1f}"

    # Multi-turn: turn 2's prompt carries turn 1's answer; the starting method rotates per block.
    runs = [r for r in report["runs"] if r["method"] == "plain" and r["question_id"] == "1" and r["repeat"] == 0]
    assert [r["turn"] for r in runs] == [0, 1]
    assert runs[1]["prompt_tokens"] >= runs[0]["prompt_tokens"] + runs[0]["output_tokens"]
    firsts = [r["method"] for r in report["runs"] if r["order"] == 0 and r["turn"] == 0]
    assert len(set(firsts)) > 1


def test_compare_prints_per_method_deltas(full_run, tmp_path, capsys):
    report, out, _, _ = full_run
    b = json.loads(json.dumps(report))
    b["results"]["plain"]["overall"]["tok_s"] = report["results"]["plain"]["overall"]["tok_s"] * 2
    del b["results"]["corrupt@k=2"]
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["bench", "--compare", str(out / "report.json"), str(tmp_path / "b.json")]) == 0
    text = capsys.readouterr().out
    assert "| plain | overall |" in text and "+100.0%" in text
    assert "corrupt@k=2 (only in A)" in text


def test_compare_rejects_a_file_that_is_not_a_report(tmp_path, capsys):
    (tmp_path / "x.json").write_text("[1, 2]")
    assert main(["bench", "--compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "not a verispec bench report" in capsys.readouterr().err


def test_ctrl_c_writes_a_partial_report(tmp_path, monkeypatch, capsys):
    real = bench_methods.EngineRunner.generate
    calls = []

    def interrupt_later(self, prompt_ids, params):
        calls.append(1)
        if len(calls) == 10:  # block 1 (4 methods x 2 turns), then mid-block 2
            raise KeyboardInterrupt
        return real(self, prompt_ids, params)

    monkeypatch.setattr(bench_methods.EngineRunner, "generate", interrupt_later)
    out = tmp_path / "partial"
    with corrupt_registered():
        report = make_runner(tmp_path)(out, Settings(max_tokens=4, warmup=False, progress=False))
    assert report["partial"] is True
    assert report["blocks_done"] == 1 and report["blocks_planned"] == 3
    assert {r["question_id"] for r in report["runs"]} == {"1"}  # only whole blocks
    assert "PARTIAL REPORT" in (out / "report.md").read_text()
    assert json.loads((out / "report.json").read_text())["partial"] is True
    assert (out / "speedup.png").is_file() and (out / "acceptance.png").is_file()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "killed"])
def test_resume_runs_only_the_missing_blocks_and_keeps_the_earlier_ones(tmp_path, monkeypatch, capsys, stop):
    real = bench_methods.EngineRunner.generate
    calls = []

    def counted(self, prompt_ids, params):
        calls.append(1)
        if interrupt and len(calls) == 10:  # block 1 (4 methods x 2 turns), then mid-block 2
            raise stop
        return real(self, prompt_ids, params)

    monkeypatch.setattr(bench_methods.EngineRunner, "generate", counted)
    out, settings = tmp_path / "resumed", Settings(max_tokens=4, warmup=False, progress=False)
    run = make_runner(tmp_path)
    interrupt = True
    with corrupt_registered():
        if stop is KeyboardInterrupt:
            first = json.loads(json.dumps(run(out, settings)))
        else:  # killed mid-block: no final report, only the checkpoint saved after block 1
            with pytest.raises(RuntimeError):
                run(out, settings)
            assert not list(out.glob("*.tmp"))
            first = load_report(out / "report.json")
    assert first["partial"] and first["blocks_done"] == 1

    previous = load_report(out / "report.json")
    interrupt, calls[:] = False, []
    with corrupt_registered():
        report = run(out, settings, previous=previous)
    assert len(calls) == 8  # blocks 2 and 3: one turn each, 4 methods; block 1 not run again
    assert report["partial"] is False and report["blocks_done"] == 3
    assert json.loads(json.dumps(report["runs"][:8])) == first["runs"]  # the earlier block's runs, unchanged
    assert {r["question_id"] for r in report["runs"]} == {"1", "3", "4"}
    assert set(report["results"]["plain"]) == {"alpha", "beta", "gamma", "overall"}
    assert len(report["segments"]) == 2 and report["wall_s"] > first["wall_s"]
    assert "in 2 sittings" in (out / "report.md").read_text()
    assert [seg["revision"] for seg in report["segments"]] == ["0123abcd"] * 2
    assert "; verispec 0123abcd" in (out / "report.md").read_text()
    # The kept runs' metrics were read back, not dropped: block 1 alone gives the same figures.
    alpha = report["results"]["ngram@k=3,prompt_lookup_max=2"]["alpha"]
    assert alpha["mean_acceptance_length"] == first["results"]["ngram@k=3,prompt_lookup_max=2"]["alpha"][
        "mean_acceptance_length"]
    assert report["results"]["draft_model:tiny-draft@k=2,adaptive=false"]["overall"]["per_position_acceptance"]


def test_resume_refuses_a_report_of_another_benchmark(tmp_path, capsys):
    out = tmp_path / "r"
    with corrupt_registered():
        make_runner(tmp_path)(out, Settings(max_tokens=3, warmup=False, progress=False))
    previous = load_report(out / "report.json")
    with corrupt_registered(), pytest.raises(ValueError, match="cannot resume: settings differs"):
        make_runner(tmp_path)(out, Settings(max_tokens=4, warmup=False, progress=False), previous=previous)
    assert main(["bench", "--model", "no-such-model-anywhere", "--questions", "code-edit", "--resume",
                 "--out", str(out)]) == 2
    assert "is a finished report: nothing to resume" in capsys.readouterr().err


def test_resume_refuses_a_report_timed_on_another_machine(tmp_path):
    out = tmp_path / "r"
    with corrupt_registered():
        make_runner(tmp_path)(out, Settings(max_tokens=3, warmup=False, progress=False))
    previous = load_report(out / "report.json")
    previous["machine"]["cpu"] = "AMD EPYC"  # as if the earlier sittings ran on another CPU
    with corrupt_registered(), pytest.raises(ValueError, match="cannot resume on another machine: cpu is 'cpu' here"):
        make_runner(tmp_path)(out, Settings(max_tokens=3, warmup=False, progress=False), previous=previous)


def test_sampling_runs_report_no_identity_check(tmp_path, capsys):
    with corrupt_registered():
        report = make_runner(tmp_path)(tmp_path / "t1", Settings(max_tokens=3, temperature=1.0, warmup=False,
                                                                 progress=False))
    assert all(f["identical"] is None for by_cat in report["results"].values() for f in by_cat.values())
    assert report["goals"]["verispec_t0_identical"]["met"] is None
    assert all(r["output_tokens"] == 3 for r in report["runs"])


def test_top_p_reaches_every_run_and_the_report(tmp_path, capsys):
    settings = Settings(max_tokens=3, temperature=0.7, top_p=0.9, warmup=False, progress=False)
    assert settings.params(5) == SamplingParams(temperature=0.7, top_p=0.9, max_tokens=3, seed=5)
    with corrupt_registered():
        report = make_runner(tmp_path)(tmp_path / "p", settings)
    assert report["settings"]["top_p"] == 0.9
    assert "top-p 0.9;" in (tmp_path / "p" / "report.md").read_text()
    off = Settings(max_tokens=3, temperature=0.7, warmup=False, progress=False)
    with corrupt_registered():
        assert "top_p" not in make_runner(tmp_path)(tmp_path / "q", off)["settings"]  # old reports resume
    with pytest.raises(ValueError, match="top_p"):
        Settings(max_tokens=3, temperature=0.7, top_p=0.0)


def test_adaptive_is_held_against_the_best_fixed_k_of_its_family(tmp_path, capsys):
    from verispec.bench.report import adaptive_goals, render_markdown

    methods = "plain,ngram@k=3,ngram@k=1,adaptive=false,ngram@k=3,adaptive=false,draft_model:tiny-draft@k=2"
    goals = Goals(adaptive_within_best=0.95, adaptive_over_best=1.05, adaptive_vs_plain=0.97)
    report = make_runner(tmp_path, methods, max_turns=1, goals=goals)(
        tmp_path / "out", Settings(max_tokens=MAX_TOKENS, warmup=False, progress=False))
    assert report["settings"]["max_turns"] == 1
    assert {r["turn"] for r in report["runs"]} == {0}  # question 1 has two turns; only the first ran
    [a] = report["goals"]["adaptive_vs_fixed"]  # draft_model has no fixed-k sibling: no family
    fixed = ["ngram@k=1,adaptive=false", "ngram@k=3,adaptive=false"]
    assert (a["family"], a["adaptive"], a["fixed"]) == ("ngram", "ngram@k=3", fixed)
    results = report["results"]
    assert set(a["per_category"]) == {"alpha", "beta", "gamma", "overall"}
    for cat, p in a["per_category"].items():
        speedups = {f: results[f][cat]["speedup"] for f in fixed}
        assert p["best_fixed"] == max(speedups, key=speedups.get)
        assert p["adaptive"] == results["ngram@k=3"][cat]["speedup"]
        assert p["vs_best"] == pytest.approx(p["adaptive"] / speedups[p["best_fixed"]])
    cats = ["alpha", "beta", "gamma"]
    assert a["within_best"]["met"] == all(a["per_category"][c]["vs_best"] >= 0.95 for c in cats)
    assert a["within_best"]["lowest"] == min(a["per_category"][c]["vs_best"] for c in cats)
    assert a["over_best_overall"]["met"] == (a["per_category"]["overall"]["vs_best"] >= 1.05)
    assert a["vs_plain"]["lowest"] == min(results["ngram@k=3"][c]["speedup"] for c in cats)
    assert a["vs_plain"]["met"] == (a["vs_plain"]["lowest"] >= 0.97)
    assert (a["within_best"]["goal"], a["over_best_overall"]["goal"], a["vs_plain"]["goal"]) == (0.95, 1.05, 0.97)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Adaptive against fixed k: ngram" in md and "first 1 turn(s) of each question" in md
    assert "- ngram@k=3: within 5% of the best fixed k in every category" in md
    assert "x plain in a category (goal >= 0.97x: " in md

    # without goals the same comparison shows its ratios and judges nothing
    [bare] = adaptive_goals(results, bench_methods.parse_methods(methods))
    assert bare["per_category"] == a["per_category"] and bare["within_best"]["lowest"] == a["within_best"]["lowest"]
    assert all(bare[k]["goal"] is None and bare[k]["met"] is None for k in ("within_best", "over_best_overall", "vs_plain"))
    line = next(line for line in render_markdown({**report, "goals": {**report["goals"], "adaptive_vs_fixed": [bare]}})
                .splitlines() if line.startswith("- ngram@k=3:"))
    assert line.startswith("- ngram@k=3: lowest ") and "goal" not in line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "plain,nope"], "unknown method 'nope'; valid methods: plain, "),
        (["--questions", "no/such/file.jsonl"], "question file not found"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--max-tokens", "0"], "max_tokens must be a positive integer"),
        (["--max-turns", "0"], "--max-turns must be at least 1"),
    ],
)
def test_bad_bench_input_fails_before_loading_the_model(capsys, argv, message):
    assert main(["bench", "--model", "no-such-model-anywhere", "--questions", "code-edit", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_needs_a_model_unless_comparing(capsys):
    assert main(["bench"]) == 2
    assert "--model is required" in capsys.readouterr().err


def test_the_fastest_verispec_method_is_held_against_each_other_engine(full_run):
    """``vs_peers``: the verispec method fastest overall, over each other engine's method, per
    category and overall, with the category where it does worst."""
    from verispec.bench.report import against_peers, goals, render_markdown

    specs = bench_methods.parse_methods("plain,ngram@k=3,hf:plain,openai:http://127.0.0.1:8080@llama-mod")
    tok_s = {"plain": (10.0, 10.0, 10.0), "ngram@k=3": (20.0, 8.0, 12.0), "hf:plain": (5.0, 5.0, 5.0),
             "openai:llama-mod": (10.0, 16.0, 11.0)}
    results = {label: {c: {"tok_s": v} for c, v in zip(("alpha", "beta", OVERALL), figs)}
               for label, figs in tok_s.items()}
    peers = goals(results, specs, greedy=False)["vs_peers"]
    assert [p["peer"] for p in peers] == ["hf:plain", "openai:llama-mod"]
    assert {p["ours"] for p in peers} == {"ngram@k=3"}  # 12 tok/s overall, above plain's 10
    hf, llama = peers
    assert hf["per_category"] == pytest.approx({"alpha": 4.0, "beta": 1.6, OVERALL: 2.4})
    assert (hf["lowest_category"], hf["lowest"]) == ("beta", pytest.approx(1.6))
    assert llama["per_category"] == pytest.approx({"alpha": 2.0, "beta": 0.5, OVERALL: 12 / 11})
    assert (llama["lowest_category"], llama["lowest"]) == ("beta", pytest.approx(0.5))
    assert against_peers(results, specs, []) == []  # no verispec method ran: nothing to compare

    report = dict(full_run[0], workload={**full_run[0]["workload"], "categories": ["alpha", "beta"]})
    report["goals"] = {**report["goals"], "vs_peers": peers}
    md = render_markdown(report)
    assert "## Against the other engines" in md and "verispec's fastest method overall (ngram@k=3)" in md
    assert "| hf:plain | 4.00x | 1.60x | 2.40x | beta 1.60x |" in md
    assert "| openai:llama-mod | 2.00x | 0.50x | 1.09x | beta 0.50x |" in md
    assert "hf:assisted" not in md and "hf:plain:" not in md  # transformers did not run: no line for it
    report["goals"]["best_verispec_vs_hf_assisted"] = {"ours": "ngram@k=3", "theirs": "hf:assisted:d",
                                                       "ratio": 2.5, "goal": 2.0, "met": True}
    assert "- best verispec method vs hf:assisted: ngram@k=3 / hf:assisted:d = 2.50x (goal >= 2.0x: met)" \
        in render_markdown(report)
