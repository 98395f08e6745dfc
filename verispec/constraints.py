"""Structured outputs: a grammar masks the target's logits at every verified position.

A request that carries a :class:`Grammar` (a JSON schema, any JSON object, a regex, a Lark
grammar or a list of choices) gets a :class:`Constraint` when it is prefilled: an llguidance
matcher that holds the grammar's state after the committed tokens. The engine calls this module at
three places of a round, and nowhere else:

* :func:`cut` (propose): the drafts are cut before the first one the grammar forbids (it could
  never be accepted, its masked p being 0; cutting it saves the verify positions behind it),
  and each kept draft's q is restricted to the tokens the grammar allows there (see below).
* :func:`mask_chain` / :func:`mask_tree` (verify): the target's logits of every verified
  position become -inf where the grammar forbids the token, before any sampling transform.
  Row j of a chain ``[t, d_1..d_n]`` is masked with the matcher's state after the committed
  tokens and ``d_1..d_j``; a tree node with the state after its path from the root. The
  matcher consumes those drafts to compute the masks and rolls them back, so it is left as it
  was.
* :func:`commit` (accept): the matcher consumes the committed tokens, and only those.

Why it stays exact: plain decoding under a grammar samples each token from the masked p. The
verify pass scores every draft with that same masked p (the state after the drafts before it
is the state plain decoding would have there). Speculative sampling is exact for any q, as long
as the draft was drawn from the q it is verified with: a draft that survives the cut was drawn
from q conditioned on being allowed, so that conditional (q masked and renormalised) is what
verification uses. Keeping q as drafted while cutting on the drawn token biases the residual
(the sampled test in ``tests/engine`` shows it, and its negative control is that mistake).
A deterministic drafter's drafts are a function of the context, so a cut leaves them exact.
A tree is not cut: a forbidden node is verified and, with p = 0, always rejected, which is exact
with its children's q as drafted. Greedy verification takes the masked argmax, as plain greedy
decoding does. When the grammar is complete the mask allows only the end-of-generation
ids, so the sequence ends with EOS; ``ignore_eos`` is refused with a grammar for that reason.

The matcher works on token ids; it reads the vocabulary once per tokenizer
(:func:`grammar_tokenizer`, cached): each token's bytes, with the special tokens marked, so a
special token never matches text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

if TYPE_CHECKING:
    from verispec.models.tokenizer import Tokenizer
    from verispec.sequence import Sequence
    from verispec.speculative.base import Proposal

__all__ = ["Constraint", "Grammar", "commit", "cut", "grammar_tokenizer", "mask_chain", "mask_tree", "start"]

GrammarKind = Literal["json_schema", "regex", "lark", "choice"]

# JSON output: no free whitespace (a model could otherwise emit spaces until max_tokens), with
# the separators OpenAI's and most models' JSON use. A schema's "x-guidance" key overrides them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAMES = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar", "choice": "choice"}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. Build one with the class methods; each checks the
    grammar's syntax and raises ``ValueError`` with llguidance's message when it is wrong."""

    kind: GrammarKind
    text: str  # a JSON schema (as JSON), a regex, a Lark or GBNF grammar, or a JSON list of choices
    compiled: str = field(init=False, repr=False, compare=False)  # llguidance's grammar

    def __post_init__(self) -> None:
        if self.kind == "json_schema":
            try:
                compiled = LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise ValueError(f"invalid JSON schema: {e}") from None
        elif self.kind == "regex":
            compiled = LLMatcher.grammar_from_regex(self.text)
        elif self.kind == "lark":  # or GBNF (llama.cpp's), which llguidance converts to Lark
            try:
                compiled = LLMatcher.grammar_from_lark(any_to_lark(self.text))
            except (GbnfToLarkError, ValueError) as e:
                raise ValueError(f"invalid grammar: {e}") from None
        elif self.kind == "choice":
            choices = json.loads(self.text)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            compiled = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        else:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected json_schema, regex, lark or choice")
        error = LLMatcher.validate_grammar(compiled)
        if error:
            raise ValueError(f"invalid {_NAMES[self.kind]}: {error.strip()}")
        object.__setattr__(self, "compiled", compiled)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """Output that is JSON valid under ``schema`` (the entry point for tool arguments too)."""
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_schema", '{"type": "object"}')

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """A Lark grammar as llguidance reads it (``start: ...``), or a GBNF one as llama.cpp
        reads it (``root ::= ...``), converted to Lark by llguidance."""
        return cls("lark", grammar)

    @classmethod
    def choice(cls, choices: list[str]) -> Grammar:
        """Exactly one of ``choices``."""
        return cls("choice", json.dumps(list(choices)))


class Constraint:
    """One request's grammar state: the matcher after its committed tokens.

    ``drafts_cut`` counts the drafts :func:`cut` removed (for tests and stats)."""

    def __init__(self, grammar: Grammar, tokenizer: LLTokenizer, vocab_size: int) -> None:
        self.matcher = LLMatcher(tokenizer, grammar.compiled, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar: {self.matcher.get_error()}")
        self.vocab_size = vocab_size  # V, the width of the target's logits
        self.eos = frozenset(tokenizer.eos_tokens)
        self.grammar_vocab = tokenizer.vocab_size  # >= V: the mask's width
        self.drafts_cut = 0
        self._chain: tuple[tuple[int, ...], torch.Tensor] | None = None  # the last chain's drafts and masks

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows after the committed ones."""
        if not tokens:
            return 0
        if self.matcher.is_stopped():  # complete: only EOS
            return next((i for i, t in enumerate(tokens) if t not in self.eos), len(tokens))
        return self.matcher.validate_tokens(tokens)

    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        """``[len(paths), V]`` bool: row i is True where the grammar allows the next token after
        the committed tokens and ``paths[i]`` (every path must be allowed). The matcher is left
        as it was."""
        allowed = torch.empty(len(paths), self.grammar_vocab, dtype=torch.bool)  # [rows, V']
        unfinished = []  # rows where the output cannot end yet
        for i, path in enumerate(paths):
            fed = self._feed(path)
            self._mask_row(allowed, i, unfinished)
            if fed:
                self.matcher.rollback(fed)
        return self._checked(allowed, unfinished)

    def chain_masks(self, drafts: list[int]) -> torch.Tensor:
        """``[n+1, V]``: row j after ``drafts[:j]`` (every draft must be allowed), as :meth:`masks`
        gives it, feeding each draft once. Computed once per round: :func:`cut` and
        :func:`mask_chain` both ask."""
        if self._chain is not None and self._chain[0] == tuple(drafts):
            return self._chain[1]
        allowed = torch.empty(len(drafts) + 1, self.grammar_vocab, dtype=torch.bool)  # [n+1, V']
        unfinished: list[int] = []
        fed = 0
        for j in range(len(drafts) + 1):
            if j:
                fed += self._feed(drafts[j - 1 : j])
            self._mask_row(allowed, j, unfinished)
        if fed:
            self.matcher.rollback(fed)
        self._chain = tuple(drafts), self._checked(allowed, unfinished)
        return self._chain[1]

    def _mask_row(self, allowed: torch.Tensor, i: int, unfinished: list[int]) -> None:
        # one byte per token (0: forbidden); unpacking llguidance's bitmask in torch is slower
        allowed[i] = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) != 0
        if not (self.matcher.is_accepting() or self.matcher.is_stopped()):
            unfinished.append(i)

    def _checked(self, allowed: torch.Tensor, unfinished: list[int]) -> torch.Tensor:
        allowed = allowed[:, : self.vocab_size]  # [rows, V]: the tokenizer's extra ids are never sampled
        # llguidance offers EOS at a dead end (nothing in the vocabulary continues the grammar);
        # EOS is never right before the grammar is complete
        allowed[torch.tensor(unfinished, dtype=torch.long)[:, None], torch.tensor(sorted(self.eos))] = False
        if not allowed.any(dim=-1).all():  # a ValueError: the request's grammar, not the engine, is at fault
            raise ValueError("the grammar allows no token of this model's vocabulary here")
        return allowed

    def consume(self, tokens: list[int]) -> None:
        """Advance past committed tokens."""
        self._chain = None
        self._feed(tokens)

    def _feed(self, tokens: list[int]) -> int:
        """Consume ``tokens``; an EOS once the grammar is complete is taken as it is, not fed
        (llguidance stops a matcher that nothing can extend). Returns how many were fed (what
        a rollback undoes)."""
        fed = 0
        for t in tokens:
            if t in self.eos and self.matcher.is_stopped():
                continue
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"the grammar refused token {t}: {self.matcher.get_error()}")
            fed += 1
        return fed


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's view of ``tokenizer``'s vocabulary (built once per tokenizer, about a second
    for a 150k vocabulary): every token's bytes, the special tokens marked, the
    end-of-generation ids as its EOS. ``vocab_size`` is the width of the target's logits."""
    tokens = [tokenizer.token_bytes(i) for i in range(len(tokenizer))]
    eos = sorted(tokenizer.eos_token_ids)
    if not eos:
        raise ValueError("structured outputs need a tokenizer with an end-of-generation id")
    source = _Vocabulary(tokens, eos[0], tokenizer.bos_token_id, sorted(tokenizer.special_token_ids),
                         lambda text: tokenizer.encode(text, add_special_tokens=False))
    return LLTokenizer(TokenizerWrapper(source), n_vocab=max(vocab_size, len(tokens)), eos_token=eos)


@dataclass
class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer."""

    tokens: list[bytes]
    eos_token_id: int
    bos_token_id: int | None
    special_token_ids: list[int]
    encode: Any

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)


# ---- the engine's calls ----------------------------------------------------------------------


def start(grammar: Grammar | None, tokenizer: Tokenizer, vocab_size: int) -> Constraint | None:
    """A new request's constraint (None without a grammar)."""
    if grammar is None:
        return None
    return Constraint(grammar, grammar_tokenizer(tokenizer, vocab_size), vocab_size)


def cut(seq: Sequence, proposal: Proposal) -> Proposal:
    """The chain without its first draft the grammar forbids and everything after it, each kept
    draft's q masked by the grammar's state before it and renormalised (a tree is verified
    whole, see :func:`mask_tree`).

    Why q changes: a sampled draft d_j ~ q_j is kept only if the grammar allows it, so a kept
    d_j is distributed as q_j restricted to the allowed tokens, and that is the q the
    acceptance test and the residual must use. Verifying with q as drafted while cutting on
    the drawn value is not exact (the residual max(p - q, 0) would assume the forbidden
    draws, which never reach verification, could still be rejected into it). A deterministic
    drafter (q one-hot) needs no change."""
    c = seq.constraint
    if c is None or proposal.parents is not None or not proposal.tokens:
        return proposal
    n = c.allowed_prefix(proposal.tokens)
    if n == len(proposal.tokens) and proposal.probs is None:
        return proposal
    c.drafts_cut += len(proposal.tokens) - n
    tokens, probs = proposal.tokens[:n], proposal.probs
    if probs is not None and n:
        allowed = c.chain_masks(tokens)[:n].to(probs.device)  # [n, V]: row j for d_{j+1}
        probs = probs[:n] * allowed
        probs = probs / probs.sum(dim=-1, keepdim=True)  # > 0: each kept draft is allowed and was drawn
    elif probs is not None:
        probs = probs[:0]
    aux = proposal.aux if n == len(proposal.tokens) else None  # a branch laid out for the cut drafts: dropped
    return dataclasses.replace(proposal, tokens=tokens, probs=probs, aux=aux)


def mask_chain(seq: Sequence, drafts: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [1, n+1, V] of ``[t, d_1..d_n]`` with row j masked by the grammar's state after
    ``d_1..d_j`` (the drafts were cut by :func:`cut`); unchanged without a grammar."""
    c = seq.constraint
    if c is None:
        return logits
    allowed = c.chain_masks(drafts).to(logits.device)  # [n+1, V]
    return logits.masked_fill(~allowed[None], float("-inf"))


def mask_tree(seq: Sequence, parents: tuple[int, ...], tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
    """A tree's node logits [N, V] (node 0 the root, node i + 1 = ``tokens[i]`` with parent
    ``parents[i]``), each masked by the grammar's state after its path from the root. A node
    whose path holds a forbidden draft is left unmasked: it is never reached, since a forbidden
    draft has masked p = 0 and is never accepted (nor the masked argmax)."""
    c = seq.constraint
    if c is None:
        return logits
    paths: list[list[int] | None] = [[]]
    for parent, token in zip(parents, tokens):
        above = paths[parent]
        paths.append(None if above is None else [*above, token])
    reachable = [i for i, path in enumerate(paths) if path is not None and c.allowed_prefix(path) == len(path)]
    allowed = torch.ones(logits.shape, dtype=torch.bool)  # [N, V]
    allowed[reachable] = c.masks([paths[i] for i in reachable])
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def commit(seq: Sequence, committed: list[int]) -> None:
    """The matcher consumes the tokens the round committed (and only those)."""
    if seq.constraint is not None:
        seq.constraint.consume(committed)
