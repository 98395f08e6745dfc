"""Log-probabilities of emitted tokens, as vLLM defines them by default (``raw_logprobs``).

A token's logprob is the log-softmax of the target's raw logits at the position that emitted it:
before temperature, top-k, top-p and min-p, so it describes the model, not the sampler (a greedy
and a sampled request see the same values). The top ``N`` are the ``N`` largest entries of that
same row.

Speculation changes nothing here. Every emitted token has a row of target logits: a plain decode
step's, or a verify pass's (an accepted draft, the recovered token and the bonus token all sit at
a verified position). Each row is reduced on its own, in float32, so a row gives the same floats
whichever pass computed it, as long as the decoder's rows are batch invariant (see
:mod:`verispec.models.decoder`). The drafter's distribution is never used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TokenLogprob", "token_logprobs"]


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's logprob and the ``N`` most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first (ties: lower id first)


def token_logprobs(logits: Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """The logprob of ``tokens[i]`` under row ``i`` of ``logits``, and each row's top ``top_n``.

    Args:
        logits: ``[n, vocab]`` raw target logits; row ``i`` is the position that emitted
            ``tokens[i]``.
        tokens: the ``n`` emitted token ids.
        top_n: how many of the most likely tokens to list per position (0: none).
    """
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"logits must be [{len(tokens)}, vocab], got {tuple(logits.shape)}")
    out = []
    for row, token in zip(logits, tokens):
        # One row at a time: its values never depend on how many rows the pass had.
        logprobs = torch.log_softmax(row.float(), dim=-1)  # [vocab]
        top: tuple[tuple[int, float], ...] = ()
        if top_n > 0:
            values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[0]))  # [top_n] each
            top = tuple(sorted(zip(ids.tolist(), values.tolist()), key=lambda t: (-t[1], t[0])))
        out.append(TokenLogprob(token, float(logprobs[token]), top))
    return out
