"""Verification of drafted tokens against the target model (the lossless core).

One speculative step proposes ``k`` draft tokens ``x_0 .. x_{k-1}``; the target model then
scores the prefix plus all drafts in a single forward pass, which yields ``k + 1``
next-token distributions (one per draft position, plus one after the last draft).  This
module decides which drafts to keep and which token to emit after them.  It is pure tensor
code: no model, no tokenizer, no host synchronisation in the hot path.

Convention (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): **p is the target distribution and q is the draft distribution**.  ``p_i`` is
the target's distribution for position ``i`` given the prefix and ``x_0 .. x_{i-1}``;
``q_i`` is the distribution the drafter sampled ``x_i`` from.

Glossary
--------
accepted
    Draft tokens that are kept.  Acceptance is sequential: draft ``i`` can only be
    accepted if drafts ``0 .. i-1`` were, so the first rejection ends the run.
recovered
    The token emitted at the first rejected position ``j``.  In stochastic mode it is
    sampled from the residual ``normalize(max(p_j - q_j, 0))``; in greedy mode it is the
    target's argmax at ``j``.
bonus
    The extra token emitted when every proposed draft is accepted: sampled from (or, in
    greedy mode, the argmax of) the target distribution at the position right after the
    last draft.  This is why a step always emits at least one token.

Why the stochastic rule is lossless, for one position with draft token ``x ~ q``::

    P(emit t) = P(x = t) * P(accept t) + P(reject) * residual(t)
              = q(t) * min(1, p(t)/q(t)) + (1 - sum_v min(p(v), q(v))) * residual(t)
              = min(p(t), q(t))          + max(p(t) - q(t), 0)
              = p(t)

(the rejection mass ``1 - sum_v min(p, q)`` equals the residual's total mass
``sum_v max(p - q, 0)``, so it cancels the normalisation).  Applied position by position,
the emitted sequence is distributed exactly as if it had been sampled from the target.

A deterministic drafter (prompt lookup, a greedy draft model) is the special case of a
one-hot ``q`` at the draft token: the draft is accepted with probability ``p(x)`` and the
recovered token is sampled from ``p`` with ``x`` removed.  The identity above still holds
for every ``x``, however ``x`` was chosen, so the result stays exact.

Output layout (``k = 3``, worked example)::

    draft tokens           [ 11, 12, 13 ]
    first rejection at 2   -> num_accepted = 2
    tokens                 [ 11, 12,  R, -1 ]    R = recovered token, sampled at index 2
    all 3 accepted         -> num_accepted = 3
    tokens                 [ 11, 12, 13,  B ]    B = bonus token, from p at index 3

Per-row draft counts: a row may propose fewer than ``k`` drafts (``num_draft[b] < k``); its
draft slots from ``num_draft[b]`` on are padding and are never accepted, and if all real
drafts are accepted the bonus comes from ``p`` at index ``num_draft[b]``::

    k = 3, num_draft[b] = 1, draft row [ 11, pad, pad ], draft 11 accepted
    num_accepted[b] = 1,  tokens[b] = [ 11, B, -1, -1 ]   B from p at index 1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.sampling import sample

__all__ = ["PAD_TOKEN", "VerifyResult", "verify_greedy", "verify_stochastic"]

PAD_TOKEN = -1
"""Value written into ``VerifyResult.tokens`` after the recovered-or-bonus token."""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one batch of drafts.

    Attributes:
        num_accepted: ``[batch]`` int64, in ``0 .. num_draft[b]`` (at most ``k``): how many
            draft tokens were accepted in each row.
        tokens: ``[batch, k+1]`` int64.  Row ``b`` holds the accepted drafts at indices
            ``0 .. num_accepted[b]-1``, the recovered-or-bonus token at index
            ``num_accepted[b]``, and ``PAD_TOKEN`` (-1) after that.  Each row therefore
            commits ``num_accepted[b] + 1`` tokens.
    """

    num_accepted: Tensor  # [batch] int64
    tokens: Tensor  # [batch, k+1] int64

    def committed(self, b: int) -> list[int]:
        """Tokens row ``b`` commits to the sequence: ``tokens[b, :num_accepted[b] + 1]``.

        This reads the tensors back to the host (it synchronises on a GPU); it is meant for
        callers that are about to hand tokens to Python code anyway.
        """
        n = int(self.num_accepted[b])
        return [int(t) for t in self.tokens[b, : n + 1].tolist()]


def verify_greedy(
    draft_tokens: Tensor,
    target_logits_or_probs: Tensor,
    num_draft: Tensor | None = None,
) -> VerifyResult:
    """Greedy verification: keep drafts while they equal the target's argmax.

    Args:
        draft_tokens: ``[batch, k]`` int64 draft tokens.  Slots at or after
            ``num_draft[b]`` are padding and may hold any value (e.g. -1).
        target_logits_or_probs: ``[batch, k+1, vocab]`` target scores; logits,
            log-probabilities or probabilities all have the same argmax.  Position ``i``
            scores the token that follows draft ``i-1`` (position 0 follows the prefix).
        num_draft: optional ``[batch]`` int64 number of real drafts per row, each in
            ``0 .. k``; ``None`` means every row proposes ``k``.

    Returns:
        A ``VerifyResult``.  The token at index ``num_accepted[b]`` is the target's argmax
        there: the recovered token at the first mismatch, or the bonus token when every
        real draft matched.  Ties in the argmax resolve to the lowest token id.
    """
    batch, k = _check_common(draft_tokens, target_logits_or_probs, num_draft)
    draft_tokens = draft_tokens.to(torch.int64)  # [batch, k]
    proposed = _proposed_mask(num_draft, batch, k, draft_tokens.device)  # [batch, k] bool

    target_argmax = target_logits_or_probs.argmax(dim=-1)  # [batch, k+1] int64
    accept = (draft_tokens == target_argmax[:, :k]) & proposed  # [batch, k] bool
    num_accepted = _count_leading_true(accept)  # [batch] int64

    # The argmax at the first mismatch (or at the bonus index) is the final token.
    final_token = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    tokens = _assemble_tokens(draft_tokens, num_accepted, final_token)  # [batch, k+1]
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


def verify_stochastic(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    generator: torch.Generator | None = None,
    num_draft: Tensor | None = None,
) -> VerifyResult:
    """Speculative-sampling verification (rejection sampling against the target).

    Draft ``i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``, in order,
    until the first rejection.  At the first rejected position ``j`` the recovered token is
    sampled from ``normalize(max(p_j - q_j, 0))`` (from ``p_j`` itself if that residual is
    all zero); if every real draft is accepted, the bonus token is sampled from ``p`` at
    index ``num_draft[b]`` (index ``k`` when ``num_draft`` is ``None``).

    The acceptance test is ``u * q < p`` with ``u`` uniform on ``[0, 1)``: it needs no
    division (``q`` may be 0 for a token the drafter did not expect) and, being strict, it
    never accepts a token with ``p = 0`` even when ``u`` is exactly 0.

    Args:
        draft_tokens: ``[batch, k]`` int64 draft tokens.  Slots at or after
            ``num_draft[b]`` are padding and may hold any value (e.g. -1).
        draft_probs: ``[batch, k, vocab]`` draft distributions ``q`` that the drafts were
            sampled from, or ``None`` for a deterministic drafter (``q`` is one-hot at the
            draft token; the result is still exact).
        target_probs: ``[batch, k+1, vocab]`` target distributions ``p``, already after
            temperature / top-k / top-p / min-p (probabilities, not logits).
        generator: random source; it must live on the tensors' device.  ``None`` uses the
            global default generator.
        num_draft: optional ``[batch]`` int64 number of real drafts per row, each in
            ``0 .. k``; ``None`` means every row proposes ``k``.

    Returns:
        A ``VerifyResult``.

    Randomness: exactly two calls on ``generator`` per invocation, ``[batch, k]`` acceptance
    uniforms and then ``[batch, vocab]`` uniforms for the recovered/bonus draw, so the same
    seed and inputs give the same result.
    """
    batch, k = _check_common(draft_tokens, target_probs, num_draft)
    draft_tokens = draft_tokens.to(torch.int64)  # [batch, k]
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must have shape [batch, k, vocab] = {(batch, k, vocab)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    # Accept/reject arithmetic runs in at least float32 even for half-precision inputs;
    # only gathered entries and one [batch, vocab] slice are converted, never the full p.
    work_dtype = torch.promote_types(target_probs.dtype, torch.float32)

    proposed = _proposed_mask(num_draft, batch, k, device)  # [batch, k] bool
    num_proposed = _num_proposed(num_draft, batch, k, device)  # [batch] int64
    # Padding slots may hold -1; point them at token 0 so gathers stay in range.  Their
    # values never matter because `proposed` masks them out.
    safe_draft = torch.where(proposed, draft_tokens, torch.zeros_like(draft_tokens))  # [batch, k]

    # p_i(x_i) and q_i(x_i) for every draft position.
    p_at_draft = (
        target_probs[:, :k].gather(-1, safe_draft.unsqueeze(-1)).squeeze(-1).to(work_dtype)
    )  # [batch, k]
    if draft_probs is None:
        q_at_draft = torch.ones_like(p_at_draft)  # [batch, k]  one-hot q puts mass 1 on x_i
    else:
        q_at_draft = (
            draft_probs.gather(-1, safe_draft.unsqueeze(-1)).squeeze(-1).to(work_dtype)
        )  # [batch, k]

    uniforms = torch.rand(
        (batch, k), generator=generator, device=device, dtype=work_dtype
    )  # [batch, k] in [0, 1)
    accept = (uniforms * q_at_draft < p_at_draft) & proposed  # [batch, k] bool
    num_accepted = _count_leading_true(accept)  # [batch] int64, in 0..num_proposed[b]
    rejected = num_accepted < num_proposed  # [batch] bool; False means "bonus row"

    # Target distribution at the index the final token is drawn for: the first rejected
    # position, or the bonus index (num_proposed[b] == num_accepted[b] there).
    rows = torch.arange(batch, device=device)  # [batch]
    p_final = target_probs[rows, num_accepted].to(work_dtype)  # [batch, vocab]

    # Draft distribution at the same index, zeroed on bonus rows so the residual there is
    # p itself.  Worked example, k = 3: num_accepted = 3 (bonus) would index past q's last
    # slot 2, hence the clamp; the clamped row is then zeroed by `rejected`.
    if k == 0:
        q_final = torch.zeros_like(p_final)  # [batch, vocab]  no drafts: always a bonus
    else:
        q_index = num_accepted.clamp(max=k - 1)  # [batch]
        if draft_probs is None:
            rejected_token = safe_draft[rows, q_index]  # [batch]
            q_final = torch.zeros_like(p_final).scatter_(
                -1, rejected_token.unsqueeze(-1), 1.0
            )  # [batch, vocab] one-hot
        else:
            q_final = draft_probs[rows, q_index].to(work_dtype)  # [batch, vocab]
        q_final = torch.where(rejected.unsqueeze(-1), q_final, torch.zeros_like(q_final))

    weights = _recovery_distribution(p_final, q_final)  # [batch, vocab], unnormalised
    final_token = sample(weights, generator)  # [batch] int64 (no host sync; never a token of weight zero)

    tokens = _assemble_tokens(draft_tokens, num_accepted, final_token)  # [batch, k+1]
    return VerifyResult(num_accepted=num_accepted, tokens=tokens)


# --------------------------------------------------------------------------- helpers


def _recovery_distribution(p: Tensor, q: Tensor) -> Tensor:
    """Unnormalised distribution for the recovered (or bonus) token.

    Args:
        p: ``[batch, vocab]`` target probabilities at the final index.
        q: ``[batch, vocab]`` draft probabilities there (all zero on bonus rows).

    Returns:
        ``[batch, vocab]`` non-negative weights: ``max(p - q, 0)``, or ``p`` on rows where
        that residual has no mass (``p == q`` numerically; bonus rows get ``p`` either way).
    """
    residual = (p - q).clamp_min(0.0)  # [batch, vocab]
    has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [batch, 1]
    return torch.where(has_mass, residual, p)  # [batch, vocab]


def _count_leading_true(mask: Tensor) -> Tensor:
    """Length of the leading run of True in each row.

    Worked example: ``[[T, T, F, T], [F, T, T, T]]`` -> cumprod ``[[1, 1, 0, 0],
    [0, 0, 0, 0]]`` -> ``[2, 0]``; the True after the first False does not count.

    Args:
        mask: ``[batch, k]`` bool.

    Returns:
        ``[batch]`` int64 in ``0 .. k``.
    """
    return mask.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [batch]


def _assemble_tokens(draft_tokens: Tensor, num_accepted: Tensor, final_token: Tensor) -> Tensor:
    """Lay out accepted drafts, then the final token, then padding.

    Worked example, k = 3, num_accepted = 1, drafts ``[11, 12, 13]``, final 42:
    ``[11, 42, -1, -1]`` (index 0 keeps the draft, index 1 == num_accepted takes the final
    token, the rest is padding).

    Args:
        draft_tokens: ``[batch, k]`` int64.
        num_accepted: ``[batch]`` int64.
        final_token: ``[batch]`` int64 recovered-or-bonus token.

    Returns:
        ``[batch, k+1]`` int64.
    """
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device)  # [k+1]
    pad_column = draft_tokens.new_full((batch, 1), PAD_TOKEN)  # [batch, 1]
    drafts_padded = torch.cat([draft_tokens, pad_column], dim=1)  # [batch, k+1]
    accepted_count = num_accepted.unsqueeze(1)  # [batch, 1]
    tokens = torch.where(
        positions < accepted_count, drafts_padded, torch.full_like(drafts_padded, PAD_TOKEN)
    )  # [batch, k+1]
    return torch.where(
        positions == accepted_count, final_token.unsqueeze(1).to(tokens.dtype), tokens
    )  # [batch, k+1]


def _num_proposed(num_draft: Tensor | None, batch: int, k: int, device: torch.device) -> Tensor:
    """``[batch]`` int64 count of real drafts per row, clamped into ``0 .. k``."""
    if num_draft is None:
        return torch.full((batch,), k, dtype=torch.int64, device=device)  # [batch]
    return num_draft.to(device=device, dtype=torch.int64).clamp(0, k)  # [batch]


def _proposed_mask(num_draft: Tensor | None, batch: int, k: int, device: torch.device) -> Tensor:
    """``[batch, k]`` bool, True where the draft slot holds a real (proposed) token."""
    positions = torch.arange(k, device=device)  # [k]
    counts = _num_proposed(num_draft, batch, k, device)  # [batch]
    return positions.unsqueeze(0) < counts.unsqueeze(1)  # [batch, k]


def _check_common(
    draft_tokens: Tensor, target: Tensor, num_draft: Tensor | None
) -> tuple[int, int]:
    """Validate shapes and dtypes (metadata only, no device sync); return ``(batch, k)``."""
    if draft_tokens.dim() != 2:
        raise ValueError(
            f"draft_tokens must be [batch, k], got shape {tuple(draft_tokens.shape)}"
        )
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be int64 or int32, got {draft_tokens.dtype}")
    batch, k = draft_tokens.shape
    if target.dim() != 3 or tuple(target.shape[:2]) != (batch, k + 1):
        raise ValueError(
            f"target must have shape [batch, k+1, vocab] with batch={batch}, k+1={k + 1}, "
            f"got {tuple(target.shape)}"
        )
    if num_draft is not None and tuple(num_draft.shape) != (batch,):
        raise ValueError(
            f"num_draft must have shape [batch] = ({batch},), got {tuple(num_draft.shape)}"
        )
    return batch, k
