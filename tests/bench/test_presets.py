"""``verispec bench NAME``: every preset is listed, parses its own options, and names valid methods."""

from __future__ import annotations

import importlib

import pytest

from verispec.bench.methods import parse_methods
from verispec.bench.presets import PRESETS
from verispec.bench.presets.reports import ADAPTIVE_METHODS, REPORT_METHODS
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
    without_llamacpp = parse_methods(REPORT_METHODS.split(",llamacpp:")[0])  # llama-cpp-python is optional
    assert without_llamacpp[0].label == "plain" and len(without_llamacpp) == 9
