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

Only top-p needs the tokens in sorted order, and only as far as its nucleus reaches: it looks
among the ``TOP_P_CANDIDATES`` largest logits (:func:`torch.topk`) and sorts the whole row only
where the nucleus does not end among them (a flat distribution). Sorting a whole row of a
150k-token vocabulary costs a sizeable part of a decode step, and a verify pass pays it once per
row; the candidates cost a small fraction of that. Both ways give the same set, so a row's result
depends on its own logits only (see :func:`_top_p_mask`). top-k uses :func:`torch.topk` for its
threshold and min-p needs no order at all. Each mask is computed with the same arithmetic on
every path, so a row's result does not depend on which other rows share the batch. With every
filter disabled the result is a plain softmax.

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

    if use_k:
        k = _row_param(top_k, lead, torch.int64, device)  # [..., 1]
        k_max = min(int(k.max()), vocab)
        top_vals = torch.topk(scaled, k_max, dim=-1).values  # [..., k_max], descending
        kth = top_vals.gather(-1, (k - 1).clamp(0, k_max - 1))  # [..., 1]
        keep &= (scaled >= kth) | (k <= 0)

    if use_p:
        p = _row_param(top_p, lead, torch.float32, device)  # [..., 1]
        keep &= _top_p_mask(scaled.masked_fill(~keep, _NEG_INF), p)

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


TOP_P_CANDIDATES = 256  # the largest logits among which top-p first looks for its nucleus


def _nucleus(probs_sorted: Tensor, p: Tensor) -> Tensor:
    """Top-p on probabilities in descending order ``[R, n]``: keep a token while the mass strictly
    before it is below ``p`` (the first always); rows with ``p >= 1`` keep all. ``[R, n]`` bool.
    The cumulative sum runs along the row, so its first values are the same whether the row is
    cut after the candidates or not."""
    cum = probs_sorted.cumsum(dim=-1)  # [R, n]
    before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)  # mass before each token
    keep = (before < p) | (p >= 1)
    keep[..., 0] = True
    return keep


def _top_p_mask(x: Tensor, p: Tensor) -> Tensor:
    """The top-p keep mask ``[..., vocab]`` of scaled logits ``x`` (-inf where top-k dropped a
    token) for ``p [..., 1]``.

    The order is descending ``x``, ties by lowest token id (a stable sort); the probabilities are
    ``softmax(x)`` in vocabulary order. The nucleus is first looked for among the
    ``TOP_P_CANDIDATES`` largest logits, put in that order. If it ends at a token whose logit is
    above the smallest candidate's, every token that precedes a kept one in the full order is a
    candidate (a token left out has a logit at most the smallest candidate's), so the candidates
    give exactly the full sort's set. Where the smallest candidate is -inf, every token left out
    has probability zero. Other rows (a nucleus wider than the candidates) sort in full.
    """
    vocab = x.shape[-1]
    flat = x.reshape(-1, vocab)  # [R, V]
    probs = torch.softmax(flat, dim=-1)  # [R, V], vocabulary order
    p = p.reshape(-1, 1)  # [R, 1]
    keep = torch.zeros_like(flat, dtype=torch.bool)  # [R, V]
    n = min(TOP_P_CANDIDATES, vocab)
    vals, ids = torch.topk(flat, n, dim=-1)  # [R, n] descending; ties in no set order
    ids, order = ids.sort(dim=-1)  # put ties by lowest id: ids ascending, then a stable sort on x
    vals, order = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)  # [R, n] in the full sort's order, as far as it goes
    kept = _nucleus(probs.gather(-1, ids), p)  # [R, n]
    count = kept.sum(dim=-1, keepdim=True)  # [R, 1]
    last = vals.gather(-1, count - 1)  # [R, 1] the logit of the last kept token
    whole = p >= 1  # [R, 1] rows without top-p keep every token
    exact = whole | (n == vocab) | (vals[:, -1:] == _NEG_INF) | ((count < n) & (last > vals[:, -1:]))  # [R, 1]
    keep.scatter_(-1, ids, kept & exact)
    keep |= whole
    rest = (~exact[:, 0]).nonzero().flatten()  # rows whose nucleus reaches past the candidates
    if rest.numel():
        _, order = torch.sort(flat[rest], dim=-1, descending=True, stable=True)  # [r, V]
        kept = _nucleus(probs[rest].gather(-1, order), p[rest])
        keep[rest] = torch.zeros_like(kept).scatter_(-1, order, kept)
    return keep.view(x.shape)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row of ``probs`` (``[..., vocab]`` non-negative weights -> ``[...]``
    int64): token ``i`` with probability ``probs[i] / sum(probs)``.

    By inverting the cumulative distribution: one uniform ``u`` per row from ``generator``
    (which must live on ``probs.device``, so the same seed gives the same tokens), and the first
    token whose cumulative weight (a float64 running sum) exceeds ``u * sum``. No host
    synchronisation. A token of weight zero adds nothing to the sum, so it is never the first to
    exceed it and is never drawn; a one-hot row always yields its hot index. It replaced the
    exponential race (``argmax(probs / E)``), which draws an exponential variate per token and
    was over ten times slower on a 150k-token vocabulary.
    """
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = probs.to(dtype).cumsum(dim=-1)  # [..., vocab]
    u = torch.rand((*probs.shape[:-1], 1), generator=generator, device=probs.device, dtype=dtype)  # [..., 1]
    token = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)  # [..., 1]
    return token.clamp_max_(probs.shape[-1] - 1).squeeze(-1)  # [...]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a ``torch.Generator`` on ``device`` for one request.

    ``seed`` gives a reproducible stream; ``None`` draws a fresh 63-bit seed from the operating
    system's entropy source, so unseeded requests do not share a random stream.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63) if seed is None else int(seed))
    return gen
