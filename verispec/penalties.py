"""Penalties, ``logit_bias`` and ``min_tokens``: the target's logits as the request changes them.

Which tokens count. A verified position's logits score the next token given every token before
it: the prompt, the committed output, and (in a verify pass) the round's drafts up to and
including that position's input. Row ``j`` of a chain's pass ``[t, d_1..d_n]`` scores the token
after ``d_j``, so it counts the committed output plus ``d_1..d_j`` (row 0 counts the output
alone); a tree's node counts the drafts on its path from the root, itself included. Those are
exactly the tokens plain decoding would have committed before that position had the drafts been
accepted, and a row's scores are only used when they were: speculation changes nothing. Greedy
output is token-identical with and without speculation, and sampled output has plain decoding's
distribution.

The transforms, in vLLM's order, on float32 logits of one row (``c[v]``: how many times token v
occurs in the output counted for the row; ``seen[v]``: v occurs in the prompt or in that output)::

    logit_bias          logits[v] += bias[v]                                     (OpenAI)
    min_tokens          logits[v] = -inf for EOS (unless ignore_eos) and every stop token id,
                        while fewer than min_tokens tokens precede the row          (vLLM)
    repetition_penalty  where seen[v]: logits[v] / r if logits[v] > 0 else logits[v] * r
                                                                           (vLLM, HF's CTRL rule)
    frequency_penalty   logits[v] -= f * c[v]                                       (OpenAI)
    presence_penalty    logits[v] -= p * (c[v] > 0)                                 (OpenAI)

Presence and frequency count output tokens only (OpenAI's and vLLM's definition); repetition
counts the prompt too. The result goes to :func:`verispec.sampling.logits_to_probs` (or to the
greedy argmax) in place of the raw logits. Logprobs stay the raw logits' (vLLM's default).

The drafter's q is used as drafted: rejection sampling is exact for any q. The draft model
(:mod:`verispec.speculative.draft_model`) applies the same transforms to its own logits with
:func:`penalize_next`, counting the output and its drafts so far, so that its drafts follow the
penalised target (without them a greedy draft repeats what the target now avoids, and is never
accepted); the other drafters (n-grams, suffix trees, the tree draft model, learned heads)
propose as they would without them, which changes their acceptance only.

Everything is vectorised over the pass's rows: one ``bincount`` of the output, the drafts as
one-hot rows summed along each row's path with one matrix product, no loop over the vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec.sequence import Sequence

__all__ = ["penalize", "penalize_next", "preceding_counts"]


def penalize(seq: Sequence, drafts: list[int], logits: Tensor, parents: tuple[int, ...] | None = None) -> Tensor:
    """``logits`` of one verify pass of ``seq`` with its penalties, bias and min_tokens applied.

    Args:
        seq: the sequence (its params, prompt, committed output and EOS ids are read).
        drafts: the pass's drafts ``d_1..d_n`` (a tree's node tokens, nodes 1..n).
        logits: ``[..., n+1, V]`` raw target logits, row 0 the input t (the last committed token).
        parents: a tree's parent of each node 1..n (0 is the root), as in ``Proposal.parents``;
            None for a chain.

    Returns ``logits`` itself when the request changes nothing, else a new float32 tensor of the
    same shape.
    """
    if not seq.params.changes_logits:
        return logits
    vocab = logits.shape[-1]
    x = logits.reshape(-1, vocab).to(torch.float32, copy=True)  # [R, V], R = n+1
    counts, depth = preceding_counts(seq.output_ids, drafts, parents, vocab, x.device)  # [R, V], [R]
    return _transform(seq, x, counts, len(seq.output_ids) + depth).view(logits.shape)


def penalize_next(seq: Sequence, drafts: list[int], logits: Tensor) -> Tensor:
    """A draft model's ``[V]`` logits for the token after ``drafts`` (this round's drafts so
    far), with ``seq``'s penalties applied as the target's row there gets them."""
    if not seq.params.changes_logits:
        return logits
    vocab = logits.shape[-1]
    x = logits.reshape(1, vocab).to(torch.float32, copy=True)  # [1, V]
    counts, _ = preceding_counts(seq.output_ids + drafts, [], None, vocab, x.device)  # [1, V]
    return _transform(seq, x, counts, torch.tensor([len(seq.output_ids) + len(drafts)])).view(logits.shape)


def _transform(seq: Sequence, x: Tensor, counts: Tensor, generated: Tensor) -> Tensor:
    """The transforms of the module doc on ``x`` ``[R, V]`` float32 (changed in place or
    replaced), given each row's output ``counts`` ``[R, V]`` and how many tokens precede it in the
    output, ``generated`` ``[R]``."""
    p = seq.params
    device, vocab = x.device, x.shape[-1]
    if p.logit_bias:
        if p.logit_bias[-1][0] >= vocab:  # (sorted by id)
            raise ValueError(f"logit_bias token id {p.logit_bias[-1][0]} is outside the vocabulary [0, {vocab})")
        ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
        bias = torch.tensor([b for _, b in p.logit_bias], device=device)
        x[:, ids] += bias
    if p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_token_ids))
        stops = sorted(t for t in stops if t < vocab)
        early = (generated < p.min_tokens).nonzero().flatten()  # rows before min_tokens
        if stops and early.numel():
            x[early[:, None], torch.tensor(stops, device=device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = counts > 0  # [R, V]
        seen[:, torch.tensor(seq.prompt_ids, device=device)] = True
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if p.frequency_penalty:
        x -= p.frequency_penalty * counts
    if p.presence_penalty:
        x -= p.presence_penalty * (counts > 0).to(torch.float32)
    return x


def preceding_counts(output_ids: list[int], drafts: list[int], parents: tuple[int, ...] | None, vocab: int,
                     device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """How often each token occurs in the output counted for each row of a verify pass, and how
    many drafts precede each row.

    Row i counts ``output_ids`` plus the drafts on node i's path from the root, node i included
    (the root is row 0, the last committed token, already in the output). A chain ``d_1..d_n`` is
    the tree whose node j's parent is j - 1. Example, output [5], drafts [7, 5] (a chain)::

        row 0: {5: 1}          depth 0
        row 1: {5: 1, 7: 1}    depth 1
        row 2: {5: 2, 7: 1}    depth 2

    Returns ``counts`` ``[n+1, V]`` float32 and ``depth`` ``[n+1]`` int64.
    """
    n = len(drafts)
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=device), minlength=vocab)[:vocab]
    if n == 0:
        return base[None].to(torch.float32), torch.zeros(1, dtype=torch.long, device=device)
    if parents is None:
        parents = tuple(range(n))  # node j's parent is j - 1
    on_path = torch.eye(n + 1, dtype=torch.bool)  # [n+1, n+1]: on_path[i, a] = a is i or an ancestor of i
    for i, parent in enumerate(parents, start=1):  # a loop over the nodes, parents first
        on_path[i] |= on_path[parent]
    path = on_path[:, 1:].to(device=device, dtype=torch.float32)  # [n+1, n] drafts on each row's path
    onehot = torch.nn.functional.one_hot(torch.tensor(drafts, device=device), vocab).to(torch.float32)  # [n, V]
    counts = base[None].to(torch.float32) + path @ onehot  # [n+1, V]
    return counts, path.sum(dim=1).to(torch.long)
