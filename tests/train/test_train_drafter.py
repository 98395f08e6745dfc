"""train-drafter's rows and held-out reports: each self-distilled row knows where the target's
answer starts, and the held-out figures count only the positions whose drafts are answer
tokens (what speculation on answers would accept), never the prompt's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tiny import bigram, loaded, sampled_rows, tiny_model, torch_threads
from verispec.config import TrainSettings
from verispec.speculative.eagle_head import Eagle3Head, EagleConfig, default_aux_layers
from verispec.speculative.medusa import MedusaHeads, load_medusa
from verispec.train.data import read_rows
from verispec.train.drafter import _split, evaluate, evaluate_eagle, first_drafted, train_medusa
from verispec.train.losses import eagle_unrolled

VOCAB = 48


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    with torch_threads(1):  # tiny models run fastest on one thread
        yield


def with_text_tokenizer(decoder) -> SimpleNamespace:
    """The tiny target with a tokenizer that encodes text one character per token."""
    target = loaded(decoder)

    def encode(text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    target.tokenizer.encode = encode
    target.tokenizer.apply_chat_template = encode
    target.tokenizer.has_chat_template = True
    return target


def test_each_row_knows_where_the_targets_answer_starts(tmp_path):
    target = with_text_tokenizer(tiny_model(seed=2, dtype=torch.float32))
    short, long = "add two numbers", "explain recursion to a child, briefly"  # 15 and 37 tokens
    text = "x = 1\n" * 5  # 30 tokens: windows of 24 and 6
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [{"prompt": short}, {"text": text}, {"prompt": long}]) + "\n")
    rows, starts = read_rows(target, data, TrainSettings(seq_len=24, max_new_tokens=6), log=lambda _: None)
    enc = target.tokenizer.encode
    assert [row for row, start in zip(rows, starts) if start == 0] == [enc(text)[:24], enc(text)[24:]]  # all answer
    answered = {}
    for row, start in zip(rows, starts):
        for prompt in (short, long):
            if start and row[:start] == enc(prompt)[-start:]:
                answered[prompt] = start
                assert len(row) - start == 6  # the whole answer (no end-of-text token here)
    # The long prompt is cut to 24 tokens to be answered, and its row (24 + 6) to its last 24.
    assert answered == {short: 15, long: 18}


def test_first_drafted_is_the_base_before_the_answers_first_token():
    # Prefill takes x_0 .. x_{s-1}; the target itself gives x_s; drafts start at x_{s+1} from base s - 1.
    assert [first_drafted(s) for s in (0, 1, 2, 9)] == [0, 0, 1, 8]


def planted_row(predict, length: int, answer_start: int) -> list[int]:
    """A row whose first draft (the token two places after each base) is the head's own top
    token at every prompt base and a different token at every answer base. ``predict(row, t)``
    is the head's top token at base t, which reads the row up to x_{t+1} only, all there is."""
    row = [3, 5]
    first = first_drafted(answer_start)
    while len(row) < length:
        t = len(row) - 2
        top = predict(row, t)
        row.append(top if t < first else (top + 1) % VOCAB)
    return row


def test_medusa_reports_skip_the_prompts_positions():
    torch.manual_seed(0)
    heads = MedusaHeads(64, VOCAB, num_heads=3)
    hidden = torch.randn(24, 64)
    start = 12

    def predict(row, t):
        return int(heads(hidden[t : t + 1])[0, 0].argmax())

    row = planted_row(predict, 24, start)
    answers = evaluate(heads, [hidden], [row], 0, None, [start])
    everything = evaluate(heads, [hidden], [row], 0, None)
    assert answers.head_accuracy[0] == 0.0 and answers.mean_acceptance_length == 1.0
    assert everything.head_accuracy[0] > 0.4 and everything.mean_acceptance_length > 1.4


def test_eagle_reports_skip_the_prompts_positions():
    decoder = tiny_model(seed=1, layers=4, dtype=torch.float32)
    c = decoder.config
    config = EagleConfig(hidden_size=c.hidden_size, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                         vocab_size=VOCAB, draft_vocab_size=VOCAB, target_hidden_size=c.hidden_size,
                         aux_layers=default_aux_layers(c.num_layers))
    torch.manual_seed(0)
    head = Eagle3Head(config)
    features = torch.randn(24, 3 * c.hidden_size)
    start = 12

    def embed(ids):
        return decoder.embed(ids).float()

    @torch.no_grad()
    def predict(row, t):
        ids = torch.tensor([row])
        logits = eagle_unrolled(head, features[None, : len(row)], ids, embed(ids), 1)[0]
        return int(head.target_ids(logits[0, t].argmax()))

    row = planted_row(predict, 24, start)
    answers = evaluate_eagle(head, [features], [row], embed, 0, 3, [start])
    everything = evaluate_eagle(head, [features], [row], embed, 0, 3)
    assert answers.head_accuracy[0] == 0.0 and answers.mean_acceptance_length == 1.0
    assert everything.head_accuracy[0] > 0.4 and everything.mean_acceptance_length > 1.4


def test_train_rows_keeps_the_held_out_rows_and_trains_on_a_prefix_of_the_rest(tmp_path):
    """A learning curve against data: runs with fewer rows are judged on the same held-out rows,
    learn less from fewer rows, and count their draft vocabulary on the rows they read."""
    rows = [[i] * 4 for i in range(40)]
    held, train = _split(rows, TrainSettings(held_out=0.25))
    some_held, some = _split(rows, TrainSettings(held_out=0.25, train_rows=5))
    assert some_held == held and some == train[:5]
    with pytest.raises(ValueError, match="only 30 rows are left to train on"):
        _split(rows, TrainSettings(held_out=0.25, train_rows=31))
    with pytest.raises(ValueError, match="train_rows must be >= 0"):
        TrainSettings(train_rows=-1)

    decoder = bigram(tiny_model(seed=1, dtype=torch.float32))
    rows = sampled_rows(decoder, 40, 24, seed=3, greedy=True).tolist()

    def run(train_rows: int, out):
        settings = TrainSettings(num_heads=3, steps=60, batch_size=8, lr=1e-2, seq_len=24, eval_every=60,
                                 save_every=60, held_out=0.25, draft_vocab_size=20, train_rows=train_rows)
        return train_medusa(loaded(decoder), rows, out, settings, log=lambda _: None, progress=False)

    full, few = run(0, tmp_path / "all"), run(2, tmp_path / "two")
    assert full[-1].mean_acceptance_length > few[-1].mean_acceptance_length > few[0].mean_acceptance_length
    held, two = _split(rows, TrainSettings(held_out=0.25, train_rows=2))
    read = {t for i in held + two for t in rows[i]}
    vocab = set(load_medusa(tmp_path / "two", 64, VOCAB).target_ids(torch.arange(20)).tolist())
    assert vocab <= read or read <= vocab  # every draft token was read, or every token read is drafted
