"""Medusa heads on a real model, as a user makes them: ``verispec train-drafter`` on SmolLM2
(self-distillation from a few prompts), then greedy speculation with the heads through the
native kernels, token-identical to plain decoding."""

from __future__ import annotations

import json

import pytest

from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, TRAIN_DRAFTER_LINES, prompt_ids
from verispec.cli import main
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("medusa")
    data = out / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in TRAIN_DRAFTER_LINES) + "\n")
    argv = ["train-drafter", "--target", "smollm2-135m-instruct", "--method", "medusa", "--data", str(data),
            "--out", str(out), "--steps", "6", "--batch-size", "2", "--seq-len", "96", "--max-new-tokens", "32",
            "--num-heads", "3", "--eval-every", "3", "--save-every", "3", "--held-out", "0.25", "--threads", "2"]
    assert main(argv) == 0
    return out


def test_train_drafter_writes_heads_checkpoints_and_held_out_reports(heads_dir):
    config = json.loads((heads_dir / "config.json").read_text())
    assert config["medusa_num_heads"] == 3
    assert (heads_dir / "medusa_lm_head.safetensors").is_file() and (heads_dir / "checkpoint.pt").is_file()
    reports = json.loads((heads_dir / "train_report.json").read_text())
    assert [r["step"] for r in reports] == [0, 3, 6]
    assert all(len(r["head_accuracy"]) == 3 for r in reports)


def test_resuming_past_the_last_step_trains_on(heads_dir, capsys):
    argv = ["train-drafter", "--target", "smollm2-135m-instruct", "--method", "medusa", "--data",
            str(heads_dir / "prompts.jsonl"), "--out", str(heads_dir), "--steps", "7", "--batch-size", "2",
            "--seq-len", "96", "--max-new-tokens", "32", "--num-heads", "3", "--eval-every", "3",
            "--save-every", "3", "--held-out", "0.25", "--resume", "--threads", "2"]
    assert main(argv) == 0
    assert "resumed at step 6" in capsys.readouterr().out
    reports = json.loads((heads_dir / "train_report.json").read_text())
    assert reports[0]["step"] == 6 and reports[-1]["step"] == 7


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_speculation_with_trained_heads_is_identical_to_plain(smollm, heads_dir, tree):
    extra = {"speculative_token_tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]} if tree else {}
    spec = SpeculativeConfig.from_dict({"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3,
                                        "adaptive": False, **extra})
    plain = Engine(smollm, max_model_len=MAX_MODEL_LEN)
    medusa = Engine(smollm, spec, max_model_len=MAX_MODEL_LEN)
    for text in PROMPTS:
        ids = prompt_ids(smollm, text)
        want = plain.generate(ids, GREEDY).output_ids
        assert medusa.generate(ids, GREEDY).output_ids == want
    assert medusa.metrics.num_draft_tokens > 0
