"""Turning logits into a probability distribution, and drawing tokens from it.

:func:`logits_to_probs` is the single place where sampling parameters are applied. Plain
decoding calls it on the target model's logits; speculative verification calls it on both the
target logits (``p``) and the draft logits (``q``). Rejection sampling is only lossless if ``p``
here is exactly the distribution plain decoding would sample from, so the function is pure
(no randomness, no hidden state) and deterministic: the same logits and parameters always give
the same float32 probabilities.

Order of transforms (the same as Hugging Face ``generate`` and vLLM)::

    temperature scaling -> top-k -> top-p -> min-p -> renormalise

* **temperature** ``t``: logits are divided by ``t``. ``t == 0`` means greedy: the row becomes a
  one-hot vector at ``argmax(logits)`` (ties go to the lowest index, as :func:`torch.argmax`),
  and the other filters are ignored for that row.
* **top-k** ``k``: keep the tokens whose scaled logit is at least the ``k``-th largest one (a tie
  at the boundary keeps every tied token, as HF and vLLM do). ``k <= 0`` disables it.
* **top-p** ``p``: on the distribution left after top-k (renormalised), keep the smallest set of
  highest-probability tokens whose cumulative probability is ``>= p``; the most likely token is
  always kept. Ties inside the sorted order are broken by the lowest token index (stable
  sort). ``p >= 1`` disables it.
* **min-p** ``m``: drop the tokens whose probability is ``< m * max_prob``. The ratio of a
  token's probability to the maximum does not change under renormalisation (and the most
  likely token survives top-k and top-p), so it is evaluated on the scaled logits as
  ``logit < max_logit + log(m)``. ``m <= 0`` disables it.

Only top-p needs the tokens in sorted order, so the logits are sorted (once) only when some
row uses top-p; top-k alone uses :func:`torch.topk` for its threshold and min-p needs no
order at all. Each mask is computed with the same arithmetic on every path, so a row's result
does not depend on which other rows share the batch. With every filter disabled the result
is a plain softmax.

Parameters may be Python scalars (shared by every row) or tensors giving one value per row.
A tensor parameter is matched against the leading dimensions of ``logits`` *from the left*:
for logits ``[batch, k, vocab]`` a ``[batch]`` tensor gives one value per request, applied to
all ``k`` positions, and a ``[batch, k]`` tensor gives one value per position.
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

__all__ = ["logits_to_probs", "sample", "make_generator"]

_NEG_INF = float("-inf")


def _row_param(value: float | int | Tensor, lead_shape: torch.Size, dtype: torch.dtype,
               device: torch.device) -> Tensor:
    """Return ``value`` as a tensor of shape ``[*lead_shape, 1]`` (broadcast from the left)."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() > len(lead_shape):
        raise ValueError(
            f"sampling parameter has shape {tuple(t.shape)}, which has more dimensions than "
            f"the leading dimensions {tuple(lead_shape)} of the logits"
        )
    # Left-aligned broadcasting: [batch] against [batch, k] means one value per batch row.
    t = t.reshape(tuple(t.shape) + (1,) * (len(lead_shape) - t.dim()))
    try:
        t = t.expand(lead_shape)
    except RuntimeError as exc:
        raise ValueError(
            f"sampling parameter of shape {tuple(t.shape)} cannot be broadcast to the leading "
            f"dimensions {tuple(lead_shape)} of the logits"
        ) from exc
    return t.unsqueeze(-1)  # [..., 1]


def _any(value: float | int | Tensor, predicate) -> bool:
    """``predicate(value)`` for a scalar, ``predicate(value).any()`` for a tensor."""
    if isinstance(value, Tensor):
        return bool(predicate(value).any())
    return bool(predicate(value))


def logits_to_probs(
    logits: Tensor,
    temperature: float | Tensor,
    top_k: int | Tensor = 0,
    top_p: float | Tensor = 1.0,
    min_p: float | Tensor = 0.0,
) -> Tensor:
    """Apply temperature, top-k, top-p and min-p to ``logits`` and return probabilities.

    Args:
        logits: ``[..., vocab]`` in any floating dtype; computed in float32. ``-inf`` entries
            (e.g. padded vocabulary slots) get probability zero.
        temperature: scalar or per-row tensor; ``0`` means greedy (one-hot at the argmax).
        top_k: scalar or per-row tensor; ``<= 0`` disables.
        top_p: scalar or per-row tensor; ``>= 1`` disables.
        min_p: scalar or per-row tensor; ``<= 0`` disables.

    Returns:
        float32 ``[..., vocab]`` probabilities; each row sums to 1.

    See the module docstring for the exact semantics and the order of the transforms.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the vocabulary)")
    x = logits.to(torch.float32)  # [..., vocab]
    vocab = x.shape[-1]
    lead = x.shape[:-1]
    device = x.device

    temp = _row_param(temperature, lead, torch.float32, device)  # [..., 1]
    if bool((temp < 0).any()):
        raise ValueError("temperature must be >= 0")
    greedy = temp == 0  # [..., 1]
    # Greedy rows are divided by 1 (their result is replaced by the one-hot below).
    scaled = x / torch.where(greedy, torch.ones_like(temp), temp)  # [..., vocab]
    # A temperature so small that a finite logit divided by it overflows is greedy: that is the
    # limit of the distribution as t -> 0, and softmax of infinities would be NaN.
    greedy = greedy | (torch.isinf(scaled) & torch.isfinite(x)).any(dim=-1, keepdim=True)
    any_greedy = bool(greedy.any())
    all_greedy = any_greedy and bool(greedy.all())

    if any_greedy:
        onehot = torch.zeros_like(x)  # [..., vocab]
        onehot.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        if all_greedy:
            return onehot

    use_k = _any(top_k, lambda v: v > 0)
    use_p = _any(top_p, lambda v: v < 1)
    use_m = _any(min_p, lambda v: v > 0)
    if not (use_k or use_p or use_m):
        probs = torch.softmax(scaled, dim=-1)  # [..., vocab]
        return torch.where(greedy, onehot, probs) if any_greedy else probs

    keep = torch.ones_like(scaled, dtype=torch.bool)  # [..., vocab], vocabulary order

    sorted_logits: Tensor | None = None
    sorted_idx: Tensor | None = None
    if use_p:  # only top-p needs the full sorted order
        sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
        # sorted_logits, sorted_idx: [..., vocab]

    if use_k:
        k = _row_param(top_k, lead, torch.int64, device)  # [..., 1]
        if sorted_logits is not None:
            kth = sorted_logits.gather(-1, (k - 1).clamp(0, vocab - 1))  # [..., 1]
        else:
            k_max = min(int(k.max()), vocab)
            top_vals = torch.topk(scaled, k_max, dim=-1).values  # [..., k_max], descending
            kth = top_vals.gather(-1, (k - 1).clamp(0, k_max - 1))  # [..., 1]
        # The k-th largest value is the same whichever way it is found.
        keep &= (scaled >= kth) | (k <= 0)

    if sorted_logits is not None and sorted_idx is not None:  # top-p
        p = _row_param(top_p, lead, torch.float32, device)  # [..., 1]
        keep_sorted = keep.gather(-1, sorted_idx)  # [..., vocab], top-k mask in sorted order
        # Distribution left after top-k, in sorted order.
        probs_sorted = torch.softmax(
            sorted_logits.masked_fill(~keep_sorted, _NEG_INF), dim=-1
        )  # [..., vocab]
        cum = probs_sorted.cumsum(dim=-1)  # [..., vocab]
        # Probability mass strictly above each token (exclusive cumulative sum).
        before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
        keep_p_sorted = (before < p) | (p >= 1)
        keep_p_sorted[..., 0] = True  # always keep the most likely token
        keep &= torch.empty_like(keep).scatter_(-1, sorted_idx, keep_p_sorted)

    if use_m:
        m = _row_param(min_p, lead, torch.float32, device)  # [..., 1]
        # p_i >= m * p_max  <=>  logit_i >= max_logit + log(m). Done on logits it does not
        # depend on the token order or on renormalisation (the max token survives top-k and
        # top-p, so the max is the same before and after them).
        max_logit = scaled.max(dim=-1, keepdim=True).values  # [..., 1]
        keep &= (scaled >= max_logit + torch.log(m)) | (m <= 0)

    scaled = scaled.masked_fill(~keep, _NEG_INF)
    probs = torch.softmax(scaled, dim=-1)  # [..., vocab]
    if any_greedy:
        probs = torch.where(greedy, onehot, probs)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row of ``probs`` (``[..., vocab]`` -> ``[...]`` int64).

    Uses the exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. picks
    token ``i`` with probability ``probs[i] / sum(probs)``, needs no host synchronisation and
    draws its noise from ``generator`` (which must live on ``probs.device``), so the same seed
    gives the same tokens. Tokens with probability zero are never drawn; a one-hot row always
    yields its hot index.
    """
    probs = probs.to(torch.float32)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)  # [..., vocab]
    # Guard against an exact zero draw (0 / 0 = nan for a zero-probability token).
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)  # [...]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a ``torch.Generator`` on ``device`` for one request.

    ``seed`` gives a reproducible stream; ``None`` draws a fresh 63-bit seed from the operating
    system's entropy source, so unseeded requests do not share a random stream.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return gen
