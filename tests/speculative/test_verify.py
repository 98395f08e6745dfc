"""Tests for verispec.speculative.verify: literal cases plus statistical checks of losslessness.

The statistical tests use a synthetic target whose distribution at position j does not
depend on the prefix (``p_j`` is fixed), so the tokens emitted by a lossless step must be
independent draws from ``p_0, p_1, ...``.  Every statistical test runs one batched call
with tens of thousands of rows, then checks a chi-square goodness-of-fit p-value and the
total-variation distance between the empirical and the target distribution.  A
negative control swaps in a wrong recovery rule and must fail the same check, which shows
the check has power.  Seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest, chisquare
from torch import Tensor

from verispec.speculative import verify as verify_mod
from verispec.speculative.verify import PAD_TOKEN, VerifyResult, verify_greedy, verify_stochastic

VOCAB = 10
K = 3
TRIALS = 200_000
PASS_PVALUE = 1e-3
FAIL_PVALUE = 1e-6
TV_BOUND = 0.01
# The joint over VOCAB**2 = 100 cells has an expected empirical TV of about 0.008 from
# sampling noise alone at 200k trials, hence the looser bound.
TV_BOUND_JOINT = 0.02


# --------------------------------------------------------------------------- helpers


def _one_hot_logits(argmax_ids: list[list[int]], vocab: int) -> Tensor:
    """Logits whose argmax at [b, i] is argmax_ids[b][i]."""
    ids = torch.tensor(argmax_ids, dtype=torch.int64)  # [batch, k+1]
    logits = torch.zeros(*ids.shape, vocab)  # [batch, k+1, vocab]
    logits.scatter_(-1, ids.unsqueeze(-1), 5.0)
    return logits


def _fit(samples: Tensor, probs: Tensor, name: str) -> tuple[float, float]:
    """Chi-square p-value and TV distance of integer samples against ``probs``.

    Cells with zero probability are left out of the chi-square (which cannot take a zero
    expectation) after asserting that none of them was ever sampled.

    Args:
        samples: ``[n]`` int64 category ids in ``0 .. len(probs)-1``.
        probs: ``[categories]`` probabilities (renormalised here in float64).
        name: label for the printed summary.
    """
    probs = probs.to(torch.float64)  # [categories]
    probs = probs / probs.sum()  # exact in float64, so the chi-square totals agree
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).to(torch.float64)  # [categories]
    support = probs > 0  # [categories]
    assert counts[~support].sum().item() == 0, f"{name}: zero-probability category sampled"
    expected = probs[support] * n  # [support]
    pvalue = float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)
    tv = 0.5 * float((counts / n - probs).abs().sum())
    print(f"[verify-stats] {name}: chi2 p={pvalue:.4g} TV={tv:.4f} (n={n})")
    return pvalue, tv


def _assert_matches(samples: Tensor, probs: Tensor, name: str, tv_bound: float = TV_BOUND) -> None:
    pvalue, tv = _fit(samples, probs, name)
    assert pvalue > PASS_PVALUE, f"{name}: chi-square p-value {pvalue:.3g}"
    assert tv < tv_bound, f"{name}: total variation {tv:.4f}"


def _target_and_draft(seed: int) -> tuple[Tensor, Tensor]:
    """A target p ([K+1, VOCAB]) and a deliberately mismatched draft q ([K, VOCAB]).

    Token 0 is impossible under p but the drafter likes it; token VOCAB-1 is possible
    under p but the drafter never proposes it.
    """
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, VOCAB, generator=g) + 0.1  # [K+1, VOCAB]
    p[:, 0] = 0.0
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(K, VOCAB, generator=g) ** 3  # [K, VOCAB] skewed, unlike p
    q[:, 0] = 1.0
    q[:, VOCAB - 1] = 0.0
    q = q / q.sum(-1, keepdim=True)
    return p, q


def _sample_rows(probs: Tensor, n: int, g: torch.Generator) -> Tensor:
    """Independent draws per position: probs ``[positions, vocab]`` -> ``[n, positions]``."""
    draws = [torch.multinomial(row, n, replacement=True, generator=g) for row in probs]
    return torch.stack(draws, dim=1)  # [n, positions]


def _complete(result: VerifyResult, p: Tensor, g: torch.Generator) -> Tensor:
    """Continue every row past its emitted tokens with fresh target samples.

    Because p_j does not depend on the prefix, a lossless step followed by plain target
    sampling must give i.i.d. draws from p_0 .. p_K in every column.

    Worked example, K = 3, num_accepted = 1: tokens ``[a, r, -1, -1]`` becomes
    ``[a, r, f2, f3]`` with f2 ~ p_2, f3 ~ p_3.

    Returns:
        ``[n, K+1]`` int64.
    """
    n = result.tokens.shape[0]
    fresh = _sample_rows(p, n, g)  # [n, K+1]
    positions = torch.arange(K + 1)  # [K+1]
    emitted = positions.unsqueeze(0) <= result.num_accepted.unsqueeze(1)  # [n, K+1]
    return torch.where(emitted, result.tokens, fresh)  # [n, K+1]


def _check_lossless(result: VerifyResult, p: Tensor, g: torch.Generator, label: str) -> None:
    """Every column of the completed output follows p_j; the first two are jointly p0 x p1."""
    tokens = result.tokens  # [n, K+1]
    # The first output token is always emitted, so it alone must already follow p_0.
    _assert_matches(tokens[:, 0], p[0], f"{label} first token")
    completed = _complete(result, p, g)  # [n, K+1]
    for j in range(1, K + 1):  # column 0 is the first token, checked above
        _assert_matches(completed[:, j], p[j], f"{label} completed position {j}")
    pair = completed[:, 0] * VOCAB + completed[:, 1]  # [n] joint cell id
    joint = (p[0].unsqueeze(1) * p[1].unsqueeze(0)).flatten()  # [VOCAB * VOCAB]
    _assert_matches(pair, joint, f"{label} joint of first two", TV_BOUND_JOINT)


# --------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_plus_bonus() -> None:
    drafts = torch.tensor([[3, 1, 4]])  # [1, 3]
    target = _one_hot_logits([[3, 1, 4, 7]], vocab=8)  # [1, 4, 8]
    result = verify_greedy(drafts, target)
    assert result.num_accepted.tolist() == [3]
    assert result.tokens.tolist() == [[3, 1, 4, 7]]
    assert result.committed(0) == [3, 1, 4, 7]


def test_greedy_first_mismatch() -> None:
    drafts = torch.tensor([[3, 1, 4]])  # [1, 3]
    target = _one_hot_logits([[3, 2, 4, 7]], vocab=8)  # mismatch at index 1
    result = verify_greedy(drafts, target)
    assert result.num_accepted.tolist() == [1]
    # The draft 4 at index 2 matches the target but comes after a rejection: not accepted.
    assert result.tokens.tolist() == [[3, 2, PAD_TOKEN, PAD_TOKEN]]
    assert result.committed(0) == [3, 2]


def test_greedy_mismatch_at_position_zero() -> None:
    drafts = torch.tensor([[5, 1, 4], [3, 1, 4]])  # [2, 3]
    target = _one_hot_logits([[3, 1, 4, 7], [3, 1, 4, 6]], vocab=8)
    result = verify_greedy(drafts, target)
    assert result.num_accepted.tolist() == [0, 3]
    assert result.tokens.tolist() == [[3, -1, -1, -1], [3, 1, 4, 6]]
    assert result.num_accepted.dtype == torch.int64
    assert result.tokens.dtype == torch.int64


def test_greedy_per_row_num_draft() -> None:
    # Row 0 proposes 1 draft, row 1 proposes 0, row 2 proposes 2 with a mismatch at 1,
    # row 3 proposes all 3.  Padding slots hold -1 (and row 0's padding even "matches").
    drafts = torch.tensor([[3, 1, -1], [-1, -1, -1], [3, 5, -1], [3, 1, 4]])  # [4, 3]
    target = _one_hot_logits(
        [[3, 1, 4, 7], [2, 1, 4, 7], [3, 1, 4, 7], [3, 1, 4, 7]], vocab=8
    )  # [4, 4, 8]
    num_draft = torch.tensor([1, 0, 2, 3])  # [4]
    result = verify_greedy(drafts, target, num_draft=num_draft)
    assert result.num_accepted.tolist() == [1, 0, 1, 3]
    assert result.tokens.tolist() == [
        [3, 1, -1, -1],  # bonus from index 1 == num_draft[0]
        [2, -1, -1, -1],  # no drafts: just the bonus from index 0
        [3, 1, -1, -1],  # recovered token at the mismatch
        [3, 1, 4, 7],
    ]


def test_greedy_accepts_probabilities_and_zero_drafts() -> None:
    probs = torch.softmax(_one_hot_logits([[6]], vocab=8), dim=-1)  # [1, 1, 8]
    result = verify_greedy(torch.zeros(1, 0, dtype=torch.int64), probs)
    assert result.num_accepted.tolist() == [0]
    assert result.tokens.tolist() == [[6]]


def test_shape_validation() -> None:
    with pytest.raises(ValueError):
        verify_greedy(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, 8))
    with pytest.raises(ValueError):
        verify_greedy(torch.zeros(2, 3), torch.zeros(2, 4, 8))
    with pytest.raises(ValueError):
        verify_stochastic(
            torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, 7), torch.zeros(2, 4, 8)
        )
    with pytest.raises(ValueError):
        verify_stochastic(
            torch.zeros(2, 3, dtype=torch.int64),
            None,
            torch.zeros(2, 4, 8),
            num_draft=torch.zeros(3, dtype=torch.int64),
        )


# --------------------------------------------------------------------------- stochastic: literal


def test_stochastic_q_equal_p_accepts_everything() -> None:
    n = 5_000
    g = torch.Generator().manual_seed(0)
    p, _ = _target_and_draft(seed=1)
    drafts = _sample_rows(p[:K], n, g)  # [n, K]
    p_batch = p.expand(n, K + 1, VOCAB)  # [n, K+1, VOCAB]
    result = verify_stochastic(drafts, p_batch[:, :K], p_batch, g)
    assert bool((result.num_accepted == K).all())
    assert torch.equal(result.tokens[:, :K], drafts)
    _assert_matches(result.tokens[:, K], p[K], "q == p bonus", tv_bound=0.03)


def test_stochastic_one_hot_q_on_impossible_token_always_rejected() -> None:
    n = 20_000
    g = torch.Generator().manual_seed(0)
    p, _ = _target_and_draft(seed=2)  # p[:, 0] == 0
    banned = 0
    drafts = torch.full((n, K), banned, dtype=torch.int64)  # [n, K]
    q = torch.zeros(n, K, VOCAB)  # [n, K, VOCAB] one-hot at the banned token
    q[..., banned] = 1.0
    p_batch = p.expand(n, K + 1, VOCAB)  # [n, K+1, VOCAB]
    for draft_probs in (q, None):
        result = verify_stochastic(drafts, draft_probs, p_batch, g)
        assert bool((result.num_accepted == 0).all())
        assert bool((result.tokens[:, 0] != banned).all())
        assert bool((result.tokens[:, 1:] == PAD_TOKEN).all())
        # The residual max(p - onehot, 0) is p itself here.
        _assert_matches(result.tokens[:, 0], p[0], "one-hot q on impossible token", 0.02)


def test_stochastic_residual_all_zero_falls_back_to_p() -> None:
    # q == p, and the draft token has probability 0 under both, so it is rejected and the
    # residual max(p - q, 0) is identically zero: the recovered token must come from p.
    n = 20_000
    g = torch.Generator().manual_seed(3)
    p, _ = _target_and_draft(seed=3)
    drafts = torch.zeros(n, K, dtype=torch.int64)  # token 0 has p == q == 0
    p_batch = p.expand(n, K + 1, VOCAB)  # [n, K+1, VOCAB]
    result = verify_stochastic(drafts, p_batch[:, :K], p_batch, g)
    assert bool((result.num_accepted == 0).all())
    _assert_matches(result.tokens[:, 0], p[0], "all-zero residual fallback", 0.02)


def test_stochastic_per_row_num_draft_bonus_index() -> None:
    # Target one-hot at token 2 + j for position j; q == p, so every real draft is accepted
    # and the bonus must come from index num_draft[b], not from index K.
    vocab = 8
    p = torch.zeros(K + 1, vocab)  # [K+1, vocab]
    p[torch.arange(K + 1), torch.arange(K + 1) + 2] = 1.0
    num_draft = torch.tensor([0, 1, 2, 3])  # [4]
    drafts = torch.tensor([[-1, -1, -1], [2, -1, -1], [2, 3, -1], [2, 3, 4]])  # [4, K]
    p_batch = p.expand(4, K + 1, vocab)  # [4, K+1, vocab]
    g = torch.Generator().manual_seed(0)
    for draft_probs in (p_batch[:, :K], None):
        result = verify_stochastic(drafts, draft_probs, p_batch, g, num_draft=num_draft)
        assert result.num_accepted.tolist() == [0, 1, 2, 3]
        assert result.tokens.tolist() == [
            [2, -1, -1, -1],
            [2, 3, -1, -1],
            [2, 3, 4, -1],
            [2, 3, 4, 5],
        ]
        assert [result.committed(b) for b in range(4)] == [[2], [2, 3], [2, 3, 4], [2, 3, 4, 5]]


def test_stochastic_zero_drafts_is_plain_sampling() -> None:
    n = 20_000
    g = torch.Generator().manual_seed(4)
    p, _ = _target_and_draft(seed=4)
    p_batch = p[:1].expand(n, 1, VOCAB)  # [n, 1, VOCAB]
    result = verify_stochastic(torch.zeros(n, 0, dtype=torch.int64), None, p_batch, g)
    assert result.tokens.shape == (n, 1)
    assert bool((result.num_accepted == 0).all())
    _assert_matches(result.tokens[:, 0], p[0], "zero drafts", 0.02)


def test_same_seed_same_result() -> None:
    n = 4_096
    p, q = _target_and_draft(seed=5)
    drafts = _sample_rows(q, n, torch.Generator().manual_seed(9))  # [n, K]
    p_batch = p.expand(n, K + 1, VOCAB)  # [n, K+1, VOCAB]
    q_batch = q.expand(n, K, VOCAB)  # [n, K, VOCAB]
    runs = [
        verify_stochastic(drafts, q_batch, p_batch, torch.Generator().manual_seed(seed))
        for seed in (123, 123, 124)
    ]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert torch.equal(runs[0].num_accepted, runs[1].num_accepted)
    assert not torch.equal(runs[0].tokens, runs[2].tokens)


def test_half_precision_inputs() -> None:
    n = 2_000
    p, q = _target_and_draft(seed=6)
    drafts = _sample_rows(q, n, torch.Generator().manual_seed(1))  # [n, K]
    result = verify_stochastic(
        drafts,
        q.expand(n, K, VOCAB).to(torch.bfloat16),
        p.expand(n, K + 1, VOCAB).to(torch.bfloat16),
        torch.Generator().manual_seed(2),
    )
    assert result.tokens.dtype == torch.int64
    assert bool((result.tokens[:, 0] != 0).all())  # p(0) == 0 stays exactly 0 in bf16


# --------------------------------------------------------------------------- stochastic: identity


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_distribution_identity_sampled_drafter(dtype: torch.dtype) -> None:
    p, q = _target_and_draft(seed=10)
    g = torch.Generator().manual_seed(11)
    drafts = _sample_rows(q, TRIALS, g)  # [TRIALS, K]
    p_batch = p.to(dtype).expand(TRIALS, K + 1, VOCAB)  # [TRIALS, K+1, VOCAB]
    q_batch = q.to(dtype).expand(TRIALS, K, VOCAB)  # [TRIALS, K, VOCAB]
    result = verify_stochastic(drafts, q_batch, p_batch, g)

    _check_lossless(result, p, g, f"sampled drafter {dtype}")

    # Acceptance rate at position 0 is sum_v min(p0, q0).
    accepted0 = int((result.num_accepted >= 1).sum())
    rate = float(torch.minimum(p[0], q[0]).sum())
    assert binomtest(accepted0, TRIALS, rate).pvalue > PASS_PVALUE

    # Given that both of the first two outputs were emitted (draft 0 accepted), the first
    # is distributed as normalize(min(p0, q0)) and the second independently as p1.
    both = result.num_accepted >= 1  # [TRIALS]
    first_two = result.tokens[both][:, :2]  # [accepted, 2]
    accepted_dist = torch.minimum(p[0], q[0]) / rate  # [VOCAB]
    joint = (accepted_dist.unsqueeze(1) * p[1].unsqueeze(0)).flatten()  # [VOCAB * VOCAB]
    _assert_matches(first_two[:, 1], p[1], f"sampled drafter {dtype} second | emitted")
    _assert_matches(
        first_two[:, 0] * VOCAB + first_two[:, 1],
        joint,
        f"sampled drafter {dtype} first two | emitted",
        TV_BOUND_JOINT,
    )


def test_distribution_identity_per_row_num_draft() -> None:
    p, q = _target_and_draft(seed=12)
    g = torch.Generator().manual_seed(13)
    drafts = _sample_rows(q, TRIALS, g)  # [TRIALS, K]
    num_draft = torch.randint(0, K + 1, (TRIALS,), generator=g)  # [TRIALS]
    slot = torch.arange(K)  # [K]
    drafts = torch.where(slot < num_draft.unsqueeze(1), drafts, torch.full_like(drafts, -1))
    result = verify_stochastic(
        drafts,
        q.expand(TRIALS, K, VOCAB),
        p.expand(TRIALS, K + 1, VOCAB),
        g,
        num_draft=num_draft,
    )
    assert bool((result.num_accepted <= num_draft).all())
    _check_lossless(result, p, g, "per-row num_draft")


@pytest.mark.parametrize("proposal", ["fixed", "sampled"])
def test_distribution_identity_deterministic_drafter(proposal: str) -> None:
    p, q = _target_and_draft(seed=14)
    g = torch.Generator().manual_seed(15)
    if proposal == "fixed":
        # Include token 0, which the target never emits, and the target's favourite.
        fixed = torch.tensor([0, int(p[1].argmax()), 5])  # [K]
        drafts = fixed.expand(TRIALS, K).clone()  # [TRIALS, K]
    else:
        drafts = _sample_rows(q, TRIALS, g)  # [TRIALS, K]  q is NOT passed to verify
    result = verify_stochastic(drafts, None, p.expand(TRIALS, K + 1, VOCAB), g)
    _check_lossless(result, p, g, f"deterministic drafter ({proposal})")


# --------------------------------------------------------------------------- negative control


def _wrong_recovery(p: Tensor, q: Tensor) -> Tensor:
    """Deliberately wrong: sample the recovered token from p instead of the residual."""
    return p


@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
def test_negative_control_wrong_recovery_rule_fails(
    drafter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, q = _target_and_draft(seed=10)
    g = torch.Generator().manual_seed(11)
    drafts = _sample_rows(q, TRIALS, g)  # [TRIALS, K]
    draft_probs = q.expand(TRIALS, K, VOCAB) if drafter == "sampled" else None
    p_batch = p.expand(TRIALS, K + 1, VOCAB)  # [TRIALS, K+1, VOCAB]

    monkeypatch.setattr(verify_mod, "_recovery_distribution", _wrong_recovery)
    result = verify_stochastic(drafts, draft_probs, p_batch, g)
    pvalue, tv = _fit(result.tokens[:, 0], p[0], f"NEGATIVE CONTROL ({drafter}) first token")
    assert pvalue < FAIL_PVALUE
    assert tv > TV_BOUND


# --------------------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_on_cuda() -> None:
    device = torch.device("cuda")
    n = 1_024
    p, q = _target_and_draft(seed=16)
    g = torch.Generator(device=device).manual_seed(0)
    drafts = _sample_rows(q, n, torch.Generator().manual_seed(1)).to(device)  # [n, K]
    p_batch = p.to(device).expand(n, K + 1, VOCAB)  # [n, K+1, VOCAB]
    q_batch = q.to(device).expand(n, K, VOCAB)  # [n, K, VOCAB]
    num_draft = torch.full((n,), K - 1, dtype=torch.int64, device=device)  # [n]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verify_stochastic(drafts, q_batch, p_batch, g, num_draft=num_draft)
        verify_stochastic(drafts, None, p_batch, g)
        verify_greedy(drafts, p_batch, num_draft=num_draft)
    finally:
        torch.cuda.set_sync_debug_mode("default")
