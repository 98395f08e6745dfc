"""``verispec bench NAME``: every preset is listed, parses its own options, and names valid methods."""

from __future__ import annotations

import importlib

import pytest

from verispec.bench.methods import parse_methods
from verispec.bench.presets import PRESETS
from verispec.bench.presets.reports import ADAPTIVE_METHODS, REPORT_METHODS, REPORT_PEERS
from verispec.cli import main


def test_bench_help_lists_every_preset(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, preset in PRESETS.items():
        assert name in out and preset.summary in out


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_entry_exists_and_answers_help(capsys, name):
    module, _, function = PRESETS[name].entry.partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    assert f"verispec bench {name}" in capsys.readouterr().out


def test_the_report_presets_name_valid_methods():
    adaptive = parse_methods(ADAPTIVE_METHODS)
    assert adaptive[0].label == "plain" and len(adaptive) == 13
    ours = parse_methods(REPORT_METHODS)
    assert ours[0].label == "plain" and len(ours) == 6 and {s.backend for s in ours} == {"verispec"}
    assert all("quantization" not in s.options for s in ours)  # the GGUF files' own weights
    without_llamacpp = parse_methods(REPORT_PEERS.split(",llamacpp:")[0])  # llama-cpp-python is optional
    assert [s.backend for s in without_llamacpp[1:]] == ["hf"] * 3


def test_the_report_preset_takes_other_peers(monkeypatch):
    """``verispec bench report --peers LIST`` replaces the default other engines, and runs beside
    an explicit ``--methods`` list too (which alone runs without the default ones); the rest of
    the options go on to ``verispec bench``."""
    from verispec.bench.presets import reports

    seen = []
    monkeypatch.setattr(reports.harness, "main", lambda argv, **kw: seen.append(argv) or 0)
    peer = "openai:http://127.0.0.1:8080@llama-ngram-mod"
    assert reports.spec_bench_report(["--peers", peer, "--resume"]) == 0
    assert reports.spec_bench_report(["--peers="]) == 0
    assert reports.spec_bench_report([]) == 0
    # chosen methods keep the peers given beside them (and run without the default ones)
    assert reports.spec_bench_report(["--methods", "plain,suffix@k=8", "--peers", peer]) == 0
    assert reports.spec_bench_report(["--methods=plain"]) == 0
    methods = [argv[argv.index("--methods") + 1] for argv in seen]
    assert methods == [f"{REPORT_METHODS},{peer}", REPORT_METHODS, f"{REPORT_METHODS},{REPORT_PEERS}",
                       f"plain,suffix@k=8,{peer}", "plain"]
    assert all(argv.count("--methods") == 1 for argv in seen)
    assert seen[0][-1] == "--resume" and "--peers" not in seen[0] and "--quantization" not in seen[0]


def test_the_tree_preset_measures_against_plain_decoding_in_the_same_rotation():
    """``bench tree`` runs plain decoding in its T = 0 rotation: T = 0 outputs are checked
    against it, and c and alpha use its measured one-position step."""
    from argparse import Namespace

    from tiny import loaded, tiny_model, torch_threads
    from verispec.bench.presets.tree import PLAIN, run, summarize
    from verispec.config import SpeculativeConfig
    from verispec.engine.engine import Engine

    target = loaded(tiny_model(seed=3))
    chain = dict(num_speculative_tokens=3, adaptive=False)
    tree = dict(num_speculative_tokens=2, speculative_eagle_topk=2, num_draft_tokens=3, adaptive=False)
    engines = {PLAIN: Engine(target, max_model_len=64)}
    for shape, kw in (("chain", chain), ("tree", tree)):
        engines[("ngram", shape)] = Engine(target, SpeculativeConfig(method="ngram", **kw), max_model_len=64)
    args = Namespace(temps=[0.0, 1.0], max_tokens=24, drafter_list=["ngram"])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10]]
    with torch_threads(1):
        stats = run(engines, args, prompts)
    assert (PLAIN, 1.0) not in stats  # plain runs at T = 0 only
    rows = summarize(stats, args)
    assert rows["plain/T=0"]["t1_s"] > 0 and rows["plain/T=0"]["tokens_per_s"] > 0
    for shape in ("chain", "tree"):
        r = rows[f"ngram/{shape}/T=0"]
        assert r["identical_to_plain"] is True and r["speed_vs_plain"] > 0
        assert r["alpha"] is not None and r["c"] is not None
        assert "speed_vs_plain" not in rows[f"ngram/{shape}/T=1"]


TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# Each preset's options from the shared layer keep the flags and defaults they had when every
# preset parsed its own (the Makefile's bench targets and docs/benchmarks/ name them); the goals
# default to those of the preset's report.
PRESET_DEFAULTS = {
    "batch": dict(target=TARGET, max_tokens=32, repeats=2, threads=2, dtype="auto", quantization="auto",
                  batch_sizes="1,2,4,8"),
    "decode": dict(model=TARGET, max_tokens=128, threads=2, dtype="bfloat16", repeats=2, out=None, bandwidth_gib=2.0,
                   bandwidth_trials=7, goal_ratio=1.5, goal_roofline=0.75),
    "kernels": dict(model=TARGET, threads=2, repeats=7, sections="bandwidth,shapes,paths,model,calls,attention,llama"),
    "quant": dict(model=TARGET, max_tokens=64, repeats=2, threads=None, bandwidth_gib=2.0, pair=None, k=4),
    "quant_accuracy": dict(threads=None, tokens=2000, chunk=500, group_size=32),
    "scale": dict(target=TARGET, speculative_config=None, concurrency=8, requests=16, max_tokens=64, repeats=3,
                  threads=2, max_num_seqs=8, max_model_len=2048, out=None),
    "server": dict(target=TARGET, speculative_config=f'{{"model": "{DRAFT}", "num_speculative_tokens": 4}}',
                   concurrency="1,2,4,8", requests=16, max_tokens=64, max_num_seqs=8, max_model_len=2048, threads=2,
                   dtype="auto", quantization="auto", out=None, goal_spec_c1=1.3, goal_spec_c8=1.0, goal_batching=4.0),
    "spec": dict(target=TARGET, draft=DRAFT, num_questions=5, max_tokens=128, threads=2, goal_ngram=1.4,
                 goal_draft=1.2),
    "suffix": dict(target=TARGET, num_prompts=8, questions=0, max_tokens=256, k=8, threads=2, quantization="auto",
                   out=None, peers="", goal_suffix=2.5, goal_lookahead=1.1, goal_vs_peers=2.0),
    "tree": dict(target=TARGET, draft=DRAFT, num_questions=10, max_tokens=128, temperatures="0,1",
                 drafters="draft_model,ngram", budget=6, depth=3, topk=2, threads=2, quantization="auto", out=None,
                 goal_length=1.2, goal_speed=1.1),
}
QUESTION_FILE_OPTION = {"quant_accuracy": "questions", "scale": "questions", "server": "questions",
                        "suffix": "question_file", "tree": "questions"}


@pytest.mark.parametrize("name", list(PRESET_DEFAULTS))
def test_every_preset_keeps_its_options_and_defaults(monkeypatch, name):
    from verispec.bench.workloads import SPEC_BENCH_ENV, spec_bench_path

    monkeypatch.delenv(SPEC_BENCH_ENV, raising=False)
    parsed = importlib.import_module(f"verispec.bench.presets.{name}").parse_args([])
    args = vars(parsed[0] if isinstance(parsed, tuple) else parsed)
    assert {k: args[k] for k in PRESET_DEFAULTS[name]} == PRESET_DEFAULTS[name]
    if name in QUESTION_FILE_OPTION:  # unset: Spec-Bench's file, shipped with verispec
        assert args[QUESTION_FILE_OPTION[name]] == spec_bench_path()


def test_the_common_options_are_checked_once_for_every_preset(tmp_path, capsys):
    from verispec.bench.presets import decode, tree
    from verispec.bench.presets.common import PresetParser

    for preset, argv, message in ((tree, ["--threads", "0"], "--threads must be at least 1, got 0"),
                                  (tree, ["--num-questions", "0"], "--num-questions must be at least 1"),
                                  (decode, ["--repeats", "0"], "--repeats must be at least 1"),
                                  (tree, ["--questions", str(tmp_path / "none.jsonl")], "question file not found"),
                                  (tree, ["--quantization", "int3"], "invalid choice: 'int3'")):
        with pytest.raises(SystemExit):
            preset.parse_args(argv)
        assert message in capsys.readouterr().err
    p = PresetParser("x", None, threads=None, out=None)
    p.add_goal("speed", 1.1, "the speedup")
    assert vars(p.parse_args(["--goal-speed", "1.3"])) == {"threads": None, "out": None, "goal_speed": 1.3}
    help_text = p.format_help()
    assert "usage: verispec bench x" in help_text and "(default: the physical cores)" in help_text
    assert "goal: the speedup (default: 1.1)" in help_text


def test_the_harness_goals_are_options_defaulting_to_the_reports_goals():
    from verispec.bench.goals import Goals
    from verispec.bench.harness import goals_of
    from verispec.cli import build_parser

    args = build_parser().parse_args(["bench", "--model", "m"])
    assert goals_of(args) == Goals(vs_hf_assisted=2.0, plain_vs_hf_plain=1.5, adaptive_within_best=0.95,
                                   adaptive_over_best=1.05, adaptive_vs_plain=0.97)
    args = build_parser().parse_args(["bench", "--model", "m", "--goal-vs-hf-assisted", "1.8",
                                      "--goal-adaptive-vs-plain", "1"])
    assert (goals_of(args).vs_hf_assisted, goals_of(args).adaptive_vs_plain) == (1.8, 1.0)
