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
    monkeypatch.setattr(reports.bench_cli, "main", lambda argv, **kw: seen.append(argv) or 0)
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
