"""An EAGLE-3 head on a real model, as a user makes one: ``verispec train-drafter --method eagle``
on SmolLM2 (self-distillation from a few prompts, a reduced draft vocabulary), then greedy
speculation with the head (Q8_0 on the native kernels) through the native target, token-identical
to plain decoding, as a chain and as a dynamic tree."""

from __future__ import annotations

import json

import pytest

from realmodels import GREEDY, MAX_MODEL_LEN, PROMPTS, TRAIN_DRAFTER_LINES, prompt_ids
from verispec.cli import main
from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.models.native import NativeLinear

pytestmark = pytest.mark.slow

ARGS = ["--target", "smollm2-135m-instruct", "--method", "eagle", "--batch-size", "2", "--seq-len", "96",
        "--max-new-tokens", "32", "--ttt-steps", "3", "--draft-vocab-size", "2048", "--intermediate-size", "256",
        "--eval-every", "3", "--save-every", "3", "--held-out", "0.25", "--threads", "2"]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    data = out / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in TRAIN_DRAFTER_LINES) + "\n")
    assert main(["train-drafter", *ARGS, "--data", str(data), "--out", str(out), "--steps", "6"]) == 0
    return out


def test_train_drafter_writes_a_speculators_checkpoint_and_reports(head_dir, capsys):
    config = json.loads((head_dir / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 2048
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # SmolLM2 has 30 layers
    reports = json.loads((head_dir / "train_report.json").read_text())
    assert [r["step"] for r in reports] == [0, 3, 6] and all(len(r["head_accuracy"]) == 3 for r in reports)
    argv = ["train-drafter", *ARGS, "--data", str(head_dir / "prompts.jsonl"), "--out", str(head_dir),
            "--steps", "7", "--resume"]
    assert main(argv) == 0
    assert "resumed at step 6" in capsys.readouterr().out


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_speculation_with_a_trained_head_is_identical_to_plain(smollm, head_dir, tree):
    extra = {"speculative_eagle_topk": 2, "num_draft_tokens": 6} if tree else {}
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": 3,
                                        "adaptive": False, **extra})
    plain = Engine(smollm, max_model_len=MAX_MODEL_LEN)
    eagle = Engine(smollm, spec, max_model_len=MAX_MODEL_LEN)
    assert isinstance(eagle.drafter.head.lm_head, NativeLinear)  # the head runs on the kernels
    for text in PROMPTS:
        ids = prompt_ids(smollm, text)
        want = plain.generate(ids, GREEDY).output_ids
        assert eagle.generate(ids, GREEDY).output_ids == want
    assert eagle.metrics.num_draft_tokens > 0
