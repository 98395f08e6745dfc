"""The grammar constraint on its own: masks after committed tokens and drafts, consume and
rollback, cutting forbidden drafts, and clear errors for bad grammars."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from liveserver import CHARS, char_tokenizer
from verispec import constraints
from verispec.config import SamplingParams
from verispec.constraints import Grammar
from verispec.speculative.base import Proposal

JSON_CHARS = CHARS + list('{}[]"_')


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(JSON_CHARS)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def allowed_text(tok, mask: torch.Tensor) -> set[str]:
    return {tok.decode([i], skip_special_tokens=False) for i in mask.nonzero().flatten().tolist()}


def new(tok, grammar: Grammar) -> constraints.Constraint:
    return constraints.start(grammar, tok, len(tok))


def test_choice_mask_follows_the_committed_tokens(tok):
    c = new(tok, Grammar.choice(["red", "rose", "blue"]))
    assert allowed_text(tok, c.masks([[]])[0]) == {"r", "b"}
    c.consume(ids(tok, "r"))
    assert allowed_text(tok, c.masks([[]])[0]) == {"e", "o"}
    c.consume(ids(tok, "ed"))
    assert allowed_text(tok, c.masks([[]])[0]) == {"<|endoftext|>", "<|im_end|>"}  # complete: EOS only


def test_masks_after_drafts_leave_the_matcher_as_it_was(tok):
    c = new(tok, Grammar.regex("(ab|ba)+c"))
    rows = c.masks([[], ids(tok, "a"), ids(tok, "ab"), ids(tok, "aba")])  # [4, V]
    assert [allowed_text(tok, r) for r in rows] == [{"a", "b"}, {"b"}, {"a", "b", "c"}, {"b"}]
    assert allowed_text(tok, c.masks([[]])[0]) == {"a", "b"}  # rolled back
    c.consume(ids(tok, "ab"))  # and it still consumes from where it was
    assert allowed_text(tok, c.masks([[]])[0]) == {"a", "b", "c"}


def test_json_schema_allows_exactly_the_valid_documents(tok):
    c = new(tok, Grammar.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                      "required": ["ok"], "additionalProperties": False}))
    good = ids(tok, '{"ok": true}')
    assert c.allowed_prefix(good) == len(good)
    bad = ids(tok, '{"ok": 1}')
    assert c.allowed_prefix(bad) == len(ids(tok, '{"ok": '))
    c.consume(good)
    assert allowed_text(tok, c.masks([[]])[0]) == {"<|endoftext|>", "<|im_end|>"}


def test_consuming_a_forbidden_token_is_an_error(tok):
    c = new(tok, Grammar.regex("ab"))
    with pytest.raises(RuntimeError, match="refused token"):
        c.consume(ids(tok, "b"))


def test_cut_keeps_drafts_before_the_first_forbidden_one_with_q_restricted_to_the_grammar(tok):
    seq = SimpleNamespace(constraint=new(tok, Grammar.regex("[ab][bc]+d")))
    drafts = ids(tok, "acxb")
    q = torch.rand(len(drafts), len(tok)) + 0.1
    cut = constraints.cut(seq, Proposal(drafts, q))
    assert cut.tokens == drafts[:2] and seq.constraint.drafts_cut == 2
    for row, q_row, allowed in zip(cut.probs, q, ["ab", "bc"]):  # q given that the draft is allowed
        keep = torch.zeros(len(tok), dtype=torch.bool)
        keep[ids(tok, allowed)] = True
        assert torch.allclose(row, torch.where(keep, q_row, 0) / q_row[keep].sum())
    deterministic = Proposal(ids(tok, "abbd"))
    assert constraints.cut(seq, deterministic) is deterministic


def test_mask_chain_masks_row_j_with_the_state_after_j_drafts(tok):
    seq = SimpleNamespace(constraint=new(tok, Grammar.regex("a[bc]d")))
    logits = torch.zeros(1, 3, len(tok))
    masked = constraints.mask_chain(seq, ids(tok, "ab"), logits)  # rows: [t, a, b]
    assert [allowed_text(tok, torch.isfinite(row)) for row in masked[0]] == [{"a"}, {"b", "c"}, {"d"}]
    assert torch.equal(logits, torch.zeros(1, 3, len(tok)))  # a masked copy: logprobs stay raw


def test_mask_tree_masks_each_node_with_its_path(tok):
    seq = SimpleNamespace(constraint=new(tok, Grammar.regex("a[bc]d|bee")))
    a, b, c, e = (ids(tok, x)[0] for x in "abce")
    # root -> a -> {b, c}; root -> b -> e; root -> c (forbidden: its row is left alone)
    parents, tokens = (0, 1, 1, 0, 4, 0), [a, b, c, b, e, c]
    masked = constraints.mask_tree(seq, parents, tokens, torch.zeros(7, len(tok)))
    rows = [allowed_text(tok, torch.isfinite(row)) for row in masked]
    assert rows[:6] == [{"a", "b"}, {"b", "c"}, {"d"}, {"d"}, {"e"}, {"e"}]
    assert torch.isfinite(masked[6]).all()


@pytest.mark.parametrize("make, message", [
    (lambda: Grammar.json_schema('{"type": "objec"}'), "invalid JSON schema"),
    (lambda: Grammar.json_schema("{"), "invalid JSON schema"),
    (lambda: Grammar.regex("a(b"), "(?s)invalid regex.*unclosed group"),
    (lambda: Grammar.lark("start: foo"), "(?s)invalid grammar.*foo"),
    (lambda: Grammar.lark("root ::= ("), "invalid grammar"),
    (lambda: Grammar.choice([]), "non-empty list"),
])
def test_bad_grammars_are_refused_with_the_engines_message(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_gbnf_is_read_as_lark(tok):
    c = new(tok, Grammar.lark('root ::= "yes" | "no"'))
    assert allowed_text(tok, c.masks([[]])[0]) == {"y", "n"}


def test_ignore_eos_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=Grammar.json_object(), ignore_eos=True)


def test_grammar_tokenizer_is_built_once_per_tokenizer(tok):
    assert constraints.grammar_tokenizer(tok, len(tok)) is constraints.grammar_tokenizer(tok, len(tok))


def test_json_object_output_parses(tok):
    c = new(tok, Grammar.json_object())
    text = '{"a": [1, "x"], "b": {}}'
    assert c.allowed_prefix(ids(tok, text)) == len(ids(tok, text))
    assert json.loads(text)
