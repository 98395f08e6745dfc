"""The heads' training objectives, the target frozen.

**Medusa-1.** Head i at base position t reads the target's final state h_t and is scored on
x_{t+i+2}, weighted ``decay**i`` (:func:`medusa_loss`).

**EAGLE-3's training-time test.** The head is unrolled ``steps`` times over every base position
(:func:`eagle_unrolled`): step 0 reads the target's features f_t, step j the head's own output
state of step j - 1, so training sees the inputs drafting will see. Each step attends as the
drafter's cache will when it drafts that far (:func:`_unrolled_attention`): causally over the
committed positions, plus the same base position's earlier steps. Step j is scored on x_{t+j+2},
weighted ``decay**j`` (:func:`eagle_loss`).

Both losses leave out target tokens outside a reduced draft vocabulary (the head cannot propose
them), and base positions before ``first_base`` (a prompt's positions, when only answers count).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from verispec.speculative.eagle_head import Eagle3Head
from verispec.speculative.medusa import MedusaHeads


def medusa_loss(heads: MedusaHeads, hidden: Tensor, rows: Tensor, decay: float = 0.8,
                shared_head: Callable[[Tensor], Tensor] | None = None, first_base: int = 0) -> Tensor:
    """Medusa's loss: head i at position t is scored on token t + i + 2, weighted ``decay**i``.
    ``hidden`` ``[N, T, H]`` are the target's features of ``rows`` ``[N, T]``; positions before
    ``first_base`` are not scored, nor are tokens outside a reduced draft vocabulary (the heads
    cannot propose them)."""
    n, t, h = hidden.shape
    logits = heads(hidden.reshape(n * t, h), shared_head).reshape(heads.num_heads, n, t, -1)  # [K, N, T, V_draft]
    labels = heads.draft_labels(rows)  # [N, T]
    total = hidden.new_zeros(())
    for i in range(heads.num_heads):
        shift = i + 2
        if first_base + shift >= t:
            break
        target = labels[:, first_base + shift:].reshape(-1)
        if not bool((target >= 0).any()):
            continue
        pred = logits[i, :, first_base : t - shift].reshape(-1, logits.shape[-1])
        total = total + decay ** i * F.cross_entropy(pred, target, ignore_index=-100)
    return total


def _unrolled_attention(q: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Attention of unrolled step j = len(keys) - 1 (the training-time test).

    q ``[N, nh, n, D]``; ``keys[0]``/``values[0]`` ``[N, nkv, >= n, D]`` are step 0's, read
    causally (the committed positions, from the target's features); ``keys[i]`` for i >= 1 are
    step i's at the *same* base position only (that position's own draft chain). This is what
    the drafter's cache holds when it drafts token j + 1 after base position t.
    """
    n, g = q.shape[2], q.shape[1] // keys[0].shape[1]
    scale = q.shape[-1] ** -0.5
    k0 = keys[0][:, :, :n].repeat_interleave(g, 1)
    v0 = values[0][:, :, :n].repeat_interleave(g, 1)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]  # [N, nh, n, n]
    own = [(q * k[:, :, :n].repeat_interleave(g, 1)).sum(-1, keepdim=True) * scale for k in keys[1:]]
    p = torch.softmax(torch.cat(scores + own, dim=-1), dim=-1)
    out = p[..., :n] @ v0
    for i, v in enumerate(values[1:]):
        out = out + p[..., n + i : n + i + 1] * v[:, :, :n].repeat_interleave(g, 1)
    return out


def eagle_unrolled(head: Eagle3Head, features: Tensor, rows: Tensor, embeds: Tensor, steps: int) -> list[Tensor]:
    """Run the head ``steps`` times over every base position (module doc, training-time test):
    step j at base t reads token x_{t+j+1} with step j - 1's output state at t (step 0: the
    target's features f_t) at position t + j, and predicts x_{t+j+2}. ``features``
    ``[N, T, F]``, ``rows`` ``[N, T]``, ``embeds`` ``[N, T, H]`` (the token embeddings).
    Returns each step's draft logits ``[N, T - 1 - j, V_draft]``."""
    n_rows, t = rows.shape
    hidden = head.fc(features[:, : t - 1])
    keys: list[Tensor] = []
    values: list[Tensor] = []
    logits = []
    for j in range(steps):
        n = t - 1 - j
        if n < 1:
            break
        positions = (torch.arange(n, device=rows.device) + j).expand(n_rows, -1)
        q, k, v, residual = head.qkv(embeds[:, 1 + j : 1 + j + n], hidden[:, :n], positions)
        keys.append(k)
        values.append(v)
        out = head.finish(_unrolled_attention(q, keys, values), residual)
        logits.append(head.logits(out))
        hidden = out
    return logits


def eagle_loss(head: Eagle3Head, features: Tensor, rows: Tensor, embeds: Tensor, steps: int = 3,
               decay: float = 0.8) -> Tensor:
    """Cross-entropy of every unrolled step on the token it predicts, weighted ``decay**j``
    (:func:`unrolled_loss` of :func:`eagle_unrolled`)."""
    return unrolled_loss(head, eagle_unrolled(head, features, rows, embeds, steps), rows, decay)


def unrolled_loss(head: Eagle3Head, unrolled: list[Tensor], rows: Tensor, decay: float = 0.8,
                  first_base: int = 0) -> Tensor:
    """:func:`eagle_loss` from the unrolled logits; target tokens outside the draft vocabulary
    are left out (the head cannot propose them), and so are base positions before
    ``first_base``."""
    c = head.config
    to_draft = torch.full((c.vocab_size,), -100, dtype=torch.long, device=rows.device)
    to_draft[head.target_ids(torch.arange(c.draft_vocab_size, device=rows.device))] = torch.arange(
        c.draft_vocab_size, device=rows.device)
    total = unrolled[0].new_zeros(()) if unrolled else torch.zeros(())
    for j, logits in enumerate(unrolled):
        n = logits.shape[1] - 1  # the last base position has no token j + 2 places ahead
        if n <= first_base:
            break
        labels = to_draft[rows[:, first_base + j + 2 : j + 2 + n]]
        if bool((labels >= 0).any()):
            total = total + decay**j * F.cross_entropy(logits[:, first_base:n].reshape(-1, logits.shape[-1]),
                                                       labels.reshape(-1), ignore_index=-100)
    return total


@torch.no_grad()
def eagle_step_hits(head: Eagle3Head, logits: list[Tensor], rows: Tensor, steps: int) -> Tensor:
    """``[steps, usable]`` bool: whether unrolled step j's top token at base t is x_{t+j+2}, for
    the base positions where every step's token exists (one row; ``logits`` from
    :func:`eagle_unrolled`)."""
    usable = rows.shape[1] - steps - 1
    if usable <= 0:
        return torch.zeros(steps, 0, dtype=torch.bool)
    return torch.stack([head.target_ids(logits[j][0, :usable].argmax(-1)) == rows[0, j + 2 : j + 2 + usable]
                        for j in range(steps)])
