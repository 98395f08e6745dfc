"""Structured outputs stay exact under speculation.

Greedy: with a grammar, every drafter's output is token-identical to plain decoding with the
same grammar, and matches it; some drafts are accepted and some cut. Sampled: the χ² harness of
``tests/distribution.py`` against the exact constrained distribution (each position's p masked
with the grammar's state after the tokens before it). The negative control, cutting forbidden
drafts but verifying the kept ones with q as drafted, must fail it. (Masking a row with the wrong
state needs no statistics: the matcher then refuses the committed token, and the request fails.)
"""

from __future__ import annotations

import itertools
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from distribution import PROMPT, exact_joint, goodness_of_fit, passes, sample_counts, target_and_draft
from liveserver import CHARS, char_tokenizer
from tiny import tiny_model
from verispec import constraints
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.constraints import Grammar
from verispec.engine.engine import Engine
from verispec.sampling import logits_to_probs
from verispec.speculative.base import Proposal
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.draft_tree import TreeDraftModelDrafter
from verispec.speculative.ngram import NgramDrafter

K = 3
JSON_CHARS = CHARS + list('{}[]"_')
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-e]{2,6}$"},
                   "tags": {"type": "array", "items": {"enum": ["ab", "ba", "cab"]}, "maxItems": 5},
                   "ok": {"type": "boolean"}},
    "required": ["name", "tags", "ok"], "additionalProperties": False,
}
REGEX = r"(ab|bca|c)+ (d[a-e]{1,3} ){2,8}e"
# Most tokens allowed at most positions: the draft model's drafts are often verified, and cut
# where they are not.
LARK = 'start: /[a-z0-9 ,]{40,80}/ "."'
GRAMMARS = {"json_schema": Grammar.json_schema(SCHEMA), "regex": Grammar.regex(REGEX), "lark": Grammar.lark(LARK)}


@pytest.fixture(scope="module")
def models():
    tokenizer = char_tokenizer(JSON_CHARS)
    vocab = len(tokenizer)
    target = tiny_model(vocab=vocab, seed=1)
    draft = tiny_model(vocab=vocab, seed=2, noise_from=target, noise=0.15)
    return (SimpleNamespace(model=target, tokenizer=tokenizer, name="tiny"),
            SimpleNamespace(model=draft, tokenizer=tokenizer, name="tiny-draft"))


def drafter_for(kind: str, draft, vocab: int):
    if kind == "draft_model":
        return DraftModelDrafter(draft, vocab, 256)
    if kind == "ngram":
        return NgramDrafter(1, 3)
    return NgramDrafter(1, 3, topk=3, budget=8)  # "ngram-tree": a trie of earlier continuations


def generate(target, prompt: str, params: SamplingParams, drafter=None):
    spec = SpeculativeConfig(method="given", num_speculative_tokens=K, adaptive=False) if drafter else None
    engine = Engine(target, spec, max_model_len=256, drafter=drafter)
    return engine.generate(target.tokenizer.encode(prompt, add_special_tokens=False), params)


@pytest.mark.parametrize("kind", ["draft_model", "ngram", "ngram-tree"])
@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_constrained_greedy_output_identical_to_plain(models, kind, grammar):
    target, draft = models
    params = SamplingParams(temperature=0.0, max_tokens=120, grammar=GRAMMARS[grammar], logprobs=3)
    prompt = 'name: "abc", tags: ["ab", "ba"], ok: true. ab ab bca bca dab dab'
    plain = generate(target, prompt, params)
    spec = generate(target, prompt, params, drafter_for(kind, draft, target.model.config.vocab_size))
    assert spec.output_ids == plain.output_ids
    assert spec.output_logprobs == plain.output_logprobs  # the same floats: raw, before the mask
    assert plain.finish_reason == "stop"  # the grammar completed and EOS ended it
    if grammar == "json_schema":
        doc = json.loads(plain.text)
        assert set(doc) == {"name", "tags", "ok"} and re.fullmatch("[a-e]{2,6}", doc["name"])
        assert set(doc["tags"]) <= {"ab", "ba", "cab"} and isinstance(doc["ok"], bool)
    elif grammar == "regex":
        assert re.fullmatch(REGEX, plain.text)
    else:
        assert re.fullmatch("[a-z0-9 ,]{40,80}[.]", plain.text)
    # raw: the greedy token is the masked argmax, and somewhere the unmasked argmax was forbidden
    assert any(entry.top[0][0] != entry.token_id for entry in plain.output_logprobs)
    assert spec.metrics.num_accepted_tokens > 0  # not vacuous: drafts were verified under the mask
    if kind == "draft_model":
        assert spec.constraint.drafts_cut > 0  # and some were cut before verification


@pytest.fixture(scope="module")
def small():
    """The harness's 16-token target and mismatched draft, with a 16-token char tokenizer."""
    target, draft = target_and_draft()
    tokenizer = char_tokenizer(list("abcdefghijklm"))  # 3 specials + 13 letters
    assert len(tokenizer) == target.config.vocab_size
    return (SimpleNamespace(model=target, tokenizer=tokenizer, name="tiny"),
            SimpleNamespace(model=draft, tokenizer=tokenizer, name="tiny-draft"))


# Which letters may come next depends on the ones before: a row masked with another row's state
# gives a different distribution.
SMALL_REGEX = "(a[b-e][f-m]|b[a-m][a-d]|[c-m][g-m][a-f])[a-m]*"


def exact_constrained_joint(target, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) under plain sampling with the grammar: every position's p masked with the
    grammar's state after the tokens before it."""
    vocab = target.model.config.vocab_size
    prefixes = list(itertools.product(range(vocab), repeat=2))
    ids = torch.tensor([PROMPT + list(p) for p in prefixes])  # [V^2, P+2]
    cache = target.model.new_cache(ids.shape[1], num_slots=len(prefixes))
    with torch.no_grad():
        logits = target.model(ids, torch.arange(ids.shape[1]).expand(len(prefixes), -1), cache, num_logits=3)
    c = constraints.start(params.grammar, target.tokenizer, vocab)
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [V^2, 3, V]: row i after prefix[:i]
    for b, prefix in enumerate(prefixes):
        rows = [list(prefix[:i]) for i in range(3)]
        reachable = [i for i, r in enumerate(rows) if c.allowed_prefix(r) == len(r)]
        allowed[b, reachable] = c.masks([rows[i] for i in reachable])
    masked = logits.masked_fill(~allowed, float("-inf"))
    probs = logits_to_probs(masked, params.temperature, params.top_k, params.top_p, params.min_p).double()
    p1 = probs[0, 0]  # [V]
    p2 = probs[torch.arange(vocab) * vocab, 1]  # [V(t1), V]: prefix (t1, 0)
    p3 = probs[:, 2].view(vocab, vocab, vocab)
    return (p1[:, None, None] * p2[:, :, None] * p3).numpy()


def sampled_counts(small, params):
    target, draft = small
    vocab = target.model.config.vocab_size
    engine = Engine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=2, adaptive=False),
                    max_model_len=64, drafter=DraftModelDrafter(draft, vocab, 64))
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, params)
    return counts, engine


@pytest.fixture(scope="module")
def constrained_params():
    return SamplingParams(temperature=1.0, max_tokens=3, grammar=Grammar.regex(SMALL_REGEX))


def test_constrained_speculative_sampling_matches_constrained_plain(small, constrained_params):
    expected = exact_constrained_joint(small[0], constrained_params)
    assert abs(expected.sum() - 1) < 1e-6  # float32 probabilities
    assert (expected > 0).sum() < expected.size / 4  # the grammar forbids most 3-token outputs
    assert not np.allclose(expected, exact_joint(small[0].model, constrained_params))
    counts, engine = sampled_counts(small, constrained_params)
    pvalue, tv = goodness_of_fit(counts, expected)
    print(f"acceptance {engine.metrics.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert 0.1 < engine.metrics.acceptance_rate < 0.9  # the residual path is exercised
    assert passes(pvalue, tv)


def cut_keeping_q_as_drafted(seq, proposal):
    """The tempting mistake: cut the chain at its first forbidden draft but verify the kept
    drafts with q as drafted."""
    n = seq.constraint.allowed_prefix(proposal.tokens) if seq.constraint and proposal.tokens else len(proposal)
    return Proposal(proposal.tokens[:n], None if proposal.probs is None else proposal.probs[:n])


def test_negative_control_q_as_drafted_fails(small, constrained_params, monkeypatch):
    monkeypatch.setattr(constraints, "cut", cut_keeping_q_as_drafted)
    counts, _ = sampled_counts(small, constrained_params)
    assert not passes(*goodness_of_fit(counts, exact_constrained_joint(small[0], constrained_params)))


@pytest.mark.long
def test_constrained_tree_sampling_matches_constrained_plain(small, constrained_params):
    """A sampled tree is not cut: its forbidden children are verified (masked p = 0, always
    rejected) with their siblings' q as drafted."""
    target, draft = small
    drafter = TreeDraftModelDrafter(draft, target.model.config.vocab_size, 64, depth=2, topk=3, budget=6,
                                    children="without_replacement")
    engine = Engine(target, SpeculativeConfig(method="given", num_speculative_tokens=2, adaptive=False),
                    max_model_len=64, drafter=drafter)
    counts = sample_counts(lambda p: engine.generate(PROMPT, p).output_ids, constrained_params)
    pvalue, tv = goodness_of_fit(counts, exact_constrained_joint(target, constrained_params))
    print(f"tree: acceptance {engine.metrics.acceptance_rate:.3f}, chi2 p={pvalue:.4f}, max marginal TV={tv:.4f}")
    assert engine.metrics.tree_rounds > 0 and engine.metrics.num_accepted_tokens > 0
    assert passes(pvalue, tv)
