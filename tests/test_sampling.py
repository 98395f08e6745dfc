"""Tests for :mod:`verispec.sampling`: exact transform semantics, batching and sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from torch import Tensor

from verispec import sampling
from verispec.sampling import logits_to_probs, make_generator, sample


def _log(values: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly ``values`` (which sum to 1)."""
    return torch.tensor(values, dtype=torch.float64).log().to(torch.float32)


def _assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- single transforms


def test_plain_softmax() -> None:
    probs = logits_to_probs(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0)
    _assert_probs(probs, [0.1, 0.2, 0.3, 0.4])


def test_temperature_scaling() -> None:
    # logits log([1, 4]): T = 2 -> [1, 2] / 3 ; T = 0.5 -> [1, 16] / 17
    logits = torch.tensor([0.0, math.log(4.0)])
    _assert_probs(logits_to_probs(logits, temperature=2.0), [1 / 3, 2 / 3])
    _assert_probs(logits_to_probs(logits, temperature=0.5), [1 / 17, 16 / 17])


def test_top_k_exact() -> None:
    probs = logits_to_probs(torch.tensor([0.0, 1.0, 2.0, 3.0]), temperature=1.0, top_k=2)
    e = math.e
    _assert_probs(probs, [0.0, 0.0, 1 / (1 + e), e / (1 + e)])


@pytest.mark.parametrize("k", [0, -1, 4, 100])
def test_top_k_disabled_or_too_large(k: int) -> None:
    probs = logits_to_probs(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, top_k=k)
    _assert_probs(probs, [0.1, 0.2, 0.3, 0.4])


def test_top_k_keeps_ties_at_boundary() -> None:
    # Like HF / vLLM: every token tied with the k-th largest logit survives.
    probs = logits_to_probs(torch.tensor([1.0, 2.0, 2.0, 0.0]), temperature=1.0, top_k=1)
    _assert_probs(probs, [0.0, 0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, [0.0, 0.0, 0.0, 1.0]),  # tiny p: only the top token
        (0.35, [0.0, 0.0, 0.0, 1.0]),  # 0.4 >= 0.35
        (0.5, [0.0, 0.0, 3 / 7, 4 / 7]),  # 0.4 < 0.5 <= 0.7
        (0.65, [0.0, 0.0, 3 / 7, 4 / 7]),
        (0.75, [0.0, 2 / 9, 3 / 9, 4 / 9]),  # 0.7 < 0.75 <= 0.9
        (0.95, [0.1, 0.2, 0.3, 0.4]),  # needs every token
        (1.0, [0.1, 0.2, 0.3, 0.4]),  # disabled
    ],
)
def test_top_p(top_p: float, expected: list[float]) -> None:
    probs = logits_to_probs(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, top_p=top_p)
    _assert_probs(probs, expected)


def test_top_p_zero_still_keeps_top_token() -> None:
    probs = logits_to_probs(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, top_p=0.0)
    _assert_probs(probs, [0.0, 0.0, 0.0, 1.0])


def test_top_p_ties_prefer_lowest_index() -> None:
    # Uniform: mass before each sorted token is 0, .25, .5, .75 -> keep 2 tokens for p = .5;
    # the stable sort makes them the two lowest indices.
    probs = logits_to_probs(torch.zeros(4), temperature=1.0, top_p=0.5)
    _assert_probs(probs, [0.5, 0.5, 0.0, 0.0])


def test_top_p_applies_to_distribution_after_top_k() -> None:
    logits = _log([0.1, 0.2, 0.3, 0.4])
    # Without top-k the top token has 0.4 < 0.42, so two tokens are needed ...
    _assert_probs(logits_to_probs(logits, 1.0, top_p=0.42), [0.0, 0.0, 3 / 7, 4 / 7])
    # ... after top-k = 3 it has 4/9 = 0.444 >= 0.42, so it alone suffices.
    _assert_probs(logits_to_probs(logits, 1.0, top_k=3, top_p=0.42), [0.0, 0.0, 0.0, 1.0])
    _assert_probs(logits_to_probs(logits, 1.0, top_k=3, top_p=0.5), [0.0, 0.0, 3 / 7, 4 / 7])


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, [0.1, 0.2, 0.3, 0.4]),  # disabled
        (0.3, [0.0, 2 / 9, 3 / 9, 4 / 9]),  # threshold 0.12
        (0.6, [0.0, 0.0, 3 / 7, 4 / 7]),  # threshold 0.24
        (1.0, [0.0, 0.0, 0.0, 1.0]),  # only the max
    ],
)
def test_min_p(min_p: float, expected: list[float]) -> None:
    probs = logits_to_probs(_log([0.1, 0.2, 0.3, 0.4]), temperature=1.0, min_p=min_p)
    _assert_probs(probs, expected)


def test_min_p_uses_scaled_distribution() -> None:
    # T = 0.5 squares the ratios: [1, 4, 9, 16] / 30; min_p = 0.3 -> threshold 16/30 * .3 = .16
    probs = logits_to_probs(_log([0.1, 0.2, 0.3, 0.4]), temperature=0.5, min_p=0.3)
    _assert_probs(probs, [0.0, 0.0, 9 / 25, 16 / 25])


def test_all_filters_combined() -> None:
    logits = _log([0.05, 0.05, 0.1, 0.2, 0.25, 0.35])
    # top-k 5 keeps everything: both 0.05 tie with the 5th largest and ties are kept.
    # top-p 0.75 on the full distribution: mass before 0.1 is .8 -> keep .35, .25, .2
    # min-p 0.6: threshold .21 -> drop .2 -> keep .35, .25
    probs = logits_to_probs(logits, 1.0, top_k=5, top_p=0.75, min_p=0.6)
    _assert_probs(probs, [0.0, 0.0, 0.0, 0.0, 25 / 60, 35 / 60])


# ---------------------------------------------------------------- greedy


def test_temperature_zero_is_one_hot_at_argmax() -> None:
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), temperature=0.0)
    _assert_probs(probs, [0.0, 1.0, 0.0, 0.0])  # tie -> lowest index


def test_temperature_zero_ignores_filters() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0])
    probs = logits_to_probs(logits, temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)
    _assert_probs(probs, [0.0, 1.0, 0.0, 0.0])


def test_negative_temperature_rejected() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(torch.zeros(3), temperature=-1.0)


# ---------------------------------------------------------------- batching / dtypes


def _random_logits(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * 3.0


_ROW_PARAMS = {
    "temperature": [0.0, 0.5, 1.0, 1.3, 0.7, 2.0, 0.0, 1.0],
    "top_k": [0, 5, 0, 10, 3, -1, 7, 0],
    "top_p": [1.0, 0.9, 0.5, 1.0, 0.8, 0.95, 0.3, 1.0],
    "min_p": [0.0, 0.0, 0.1, 0.05, 0.0, 0.2, 0.5, 0.0],
}


def test_batched_per_row_params_equal_row_by_row() -> None:
    logits = _random_logits(8, 50)  # [batch, vocab]
    batched = logits_to_probs(
        logits,
        temperature=torch.tensor(_ROW_PARAMS["temperature"]),
        top_k=torch.tensor(_ROW_PARAMS["top_k"]),
        top_p=torch.tensor(_ROW_PARAMS["top_p"]),
        min_p=torch.tensor(_ROW_PARAMS["min_p"]),
    )
    for i in range(logits.shape[0]):
        single = logits_to_probs(
            logits[i],
            temperature=_ROW_PARAMS["temperature"][i],
            top_k=_ROW_PARAMS["top_k"][i],
            top_p=_ROW_PARAMS["top_p"][i],
            min_p=_ROW_PARAMS["min_p"][i],
        )
        torch.testing.assert_close(batched[i], single, atol=0.0, rtol=0.0)


def test_per_request_params_broadcast_over_positions() -> None:
    # [batch, k, vocab] logits with [batch] params: one setting per request for all positions.
    logits = _random_logits(8, 3, 40, seed=1)
    batched = logits_to_probs(
        logits,
        temperature=torch.tensor(_ROW_PARAMS["temperature"]),
        top_k=torch.tensor(_ROW_PARAMS["top_k"]),
        top_p=torch.tensor(_ROW_PARAMS["top_p"]),
        min_p=torch.tensor(_ROW_PARAMS["min_p"]),
    )
    assert batched.shape == (8, 3, 40)
    for i in range(8):
        for j in range(3):
            single = logits_to_probs(
                logits[i, j],
                temperature=_ROW_PARAMS["temperature"][i],
                top_k=_ROW_PARAMS["top_k"][i],
                top_p=_ROW_PARAMS["top_p"][i],
                min_p=_ROW_PARAMS["min_p"][i],
            )
            torch.testing.assert_close(batched[i, j], single, atol=0.0, rtol=0.0)


def test_per_position_params() -> None:
    logits = _random_logits(2, 3, 20, seed=2)
    temperature = torch.tensor([[0.0, 1.0, 0.5], [2.0, 0.0, 1.0]])  # [batch, k]
    top_k = torch.tensor([[0, 3, 5], [1, 0, 0]])
    batched = logits_to_probs(logits, temperature=temperature, top_k=top_k)
    for i in range(2):
        for j in range(3):
            single = logits_to_probs(logits[i, j], float(temperature[i, j]), int(top_k[i, j]))
            torch.testing.assert_close(batched[i, j], single, atol=0.0, rtol=0.0)


def test_mixed_greedy_rows() -> None:
    logits = _random_logits(4, 30, seed=3)
    probs = logits_to_probs(logits, temperature=torch.tensor([0.0, 1.0, 0.0, 0.8]), top_p=0.9)
    argmax = logits.argmax(-1)
    for i in (0, 2):
        assert probs[i, argmax[i]] == 1.0 and probs[i].sum() == 1.0
    for i in (1, 3):
        assert (probs[i] > 0).sum() > 1


def test_bad_param_shape_rejected() -> None:
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(2, 5), temperature=torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_input_dtypes_give_float32(dtype: torch.dtype) -> None:
    logits = _random_logits(3, 16, seed=4).to(dtype)
    probs = logits_to_probs(logits, temperature=0.9, top_k=8, top_p=0.9)
    assert probs.dtype == torch.float32
    expected = logits_to_probs(logits.to(torch.float32), temperature=0.9, top_k=8, top_p=0.9)
    torch.testing.assert_close(probs, expected, atol=0.0, rtol=0.0)


def test_rows_sum_to_one() -> None:
    logits = _random_logits(64, 1000, seed=5)
    gen = torch.Generator().manual_seed(6)
    probs = logits_to_probs(
        logits,
        temperature=torch.rand(64, generator=gen) * 2,
        top_k=torch.randint(-1, 50, (64,), generator=gen),
        top_p=torch.rand(64, generator=gen).clamp_min(0.05),
        min_p=torch.rand(64, generator=gen) * 0.3,
    )
    torch.testing.assert_close(probs.sum(-1), torch.ones(64), atol=1e-5, rtol=0.0)
    assert bool((probs >= 0).all())


def test_neg_inf_logits_get_zero_probability() -> None:
    logits = torch.tensor([1.0, float("-inf"), 0.5, float("-inf")])
    for kwargs in ({}, {"top_k": 3}, {"top_p": 0.99}, {"min_p": 0.01}):
        probs = logits_to_probs(logits, temperature=1.0, **kwargs)
        assert probs[1] == 0.0 and probs[3] == 0.0
        assert not torch.isnan(probs).any()


def test_fast_path_does_not_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def _no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("sorted although every filter is disabled")

    monkeypatch.setattr(torch, "sort", _no_sort)
    monkeypatch.setattr(torch, "argsort", _no_sort)
    logits = _random_logits(4, 32, seed=7)
    logits_to_probs(logits, temperature=0.7)
    logits_to_probs(logits, temperature=torch.tensor([0.7, 0.0, 1.0, 2.0]),
                    top_k=torch.tensor([0, -1, 0, 0]), top_p=torch.ones(4), min_p=torch.zeros(4))
    # Only top-p needs the sorted order: top-k uses topk, min-p a threshold on the logits.
    logits_to_probs(logits, temperature=0.7, top_k=5)
    logits_to_probs(logits, temperature=0.7, top_k=torch.tensor([0, 3, 40, 1]), min_p=0.1)


def test_top_k_path_matches_sort_path() -> None:
    # top-k alone (topk threshold) and top-k with a no-op top-p in the batch (sort path)
    # must give bit-identical rows.
    logits = _random_logits(6, 64, seed=13)
    k = torch.tensor([1, 2, 5, 17, 64, 100])
    alone = logits_to_probs(logits, temperature=0.9, top_k=k, min_p=0.01)
    sorted_path = logits_to_probs(logits, temperature=0.9, top_k=k, min_p=0.01,
                                  top_p=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.999999]))
    torch.testing.assert_close(alone[:5], sorted_path[:5], atol=0.0, rtol=0.0)


# ---------------------------------------------------------------- sampling


def test_sample_shape_and_dtype() -> None:
    probs = logits_to_probs(_random_logits(2, 3, 10, seed=8), temperature=1.0)
    tokens = sample(probs, make_generator(0, "cpu"))
    assert tokens.shape == (2, 3) and tokens.dtype == torch.int64


def test_sample_same_seed_same_tokens() -> None:
    probs = logits_to_probs(_random_logits(64, 1000, seed=9), temperature=1.0)
    a = sample(probs, make_generator(1234, "cpu"))
    b = sample(probs, make_generator(1234, "cpu"))
    c = sample(probs, make_generator(4321, "cpu"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_unseeded_generators_differ() -> None:
    probs = torch.full((64, 1000), 1e-3)
    a = sample(probs, make_generator(None, "cpu"))
    b = sample(probs, make_generator(None, "cpu"))
    assert not torch.equal(a, b)


def test_sample_one_hot_and_zero_probability() -> None:
    probs = logits_to_probs(_random_logits(500, 20, seed=10), temperature=0.0)
    tokens = sample(probs, make_generator(0, "cpu"))
    assert torch.equal(tokens, probs.argmax(-1))

    masked = logits_to_probs(_random_logits(500, 20, seed=11), temperature=1.0, top_k=3)
    tokens = sample(masked, make_generator(1, "cpu"))
    assert bool((masked.gather(-1, tokens[:, None]) > 0).all())


@pytest.mark.parametrize("top_k", [0, 4])
def test_sample_matches_distribution_chi_square(top_k: int) -> None:
    draws = 20_000
    probs = logits_to_probs(_random_logits(10, seed=12), temperature=1.0, top_k=top_k)  # [10]
    tokens = sample(probs.expand(draws, -1), make_generator(2024, "cpu"))  # [draws]
    counts = torch.bincount(tokens, minlength=probs.numel()).to(torch.float64)
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].to(torch.float64)
    expected = expected / expected.sum() * draws  # exact float64 normalisation for scipy
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result


def _chi_square_pvalue(tokens: Tensor, weights: Tensor) -> float:
    support = weights > 0
    counts = torch.bincount(tokens, minlength=weights.numel()).to(torch.float64)[support]
    expected = weights[support].to(torch.float64)
    expected = expected / expected.sum() * tokens.numel()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def test_sample_draws_unnormalised_weights_in_proportion() -> None:
    """Verification draws from a residual max(p - q, 0), whose sum is below 1."""
    weights = torch.tensor([0.02, 0.0, 0.11, 0.05, 0.0, 0.07, 0.01, 0.04])  # sums to 0.3
    tokens = sample(weights.expand(40_000, -1), make_generator(77, "cpu"))
    assert set(tokens.tolist()) == {0, 2, 3, 5, 6, 7}  # never a token of weight zero
    assert _chi_square_pvalue(tokens, weights) > 1e-3


def test_the_chi_square_test_catches_a_draw_five_percent_off() -> None:
    """Negative control: draws from weights with 5% of the mass moved between two tokens fail."""
    weights = torch.tensor([0.02, 0.0, 0.11, 0.05, 0.0, 0.07, 0.01, 0.04])
    off = weights.clone()
    off[2] -= 0.015
    off[6] += 0.015
    tokens = sample(off.expand(40_000, -1), make_generator(77, "cpu"))
    assert _chi_square_pvalue(tokens, weights) < 1e-6


def test_a_temperature_too_small_to_divide_by_is_greedy_not_nan() -> None:
    """1e-40 is subnormal in float32: logits / t overflow, and softmax of inf would be NaN."""
    logits = torch.tensor([[3.0, 5.0, -1.0, float("-inf")], [0.5, 0.25, 0.0, 1.0]])
    for t in (1e-40, 1e-44):
        probs = logits_to_probs(logits, t, top_k=2, top_p=0.9)
        assert torch.equal(probs, logits_to_probs(logits, 0.0))
        assert torch.equal(logits_to_probs(logits, t), logits_to_probs(logits, 0.0))
    # a small but safe temperature is left as it is (not one-hot)
    assert logits_to_probs(logits[1:], 0.5).max() < 1.0


# ---------------------------------------------------------------- top-p among candidates


def _top_p_rows() -> tuple[Tensor, Tensor]:
    """Rows whose nucleus ends among a few candidates, rows whose nucleus is wider, ties at the
    nucleus's end, rows cut by top-k to fewer tokens than the candidates, and rows without top-p."""
    gen = torch.Generator().manual_seed(21)
    peaked = torch.randn(6, 300, generator=gen) * 4
    flat = torch.randn(4, 300, generator=gen) * 0.1
    ties = torch.zeros(2, 300)
    ties[:, 50:60] = 8.0  # ten tied tokens hold nearly all the mass: the nucleus ends inside the tie
    ties[1, 3] = 8.0  # one more tied token, with a lower id than the others
    logits = torch.cat([peaked, flat, ties])
    p = torch.tensor([0.9, 0.5, 0.99, 0.0, 0.95, 1.0, 0.9, 0.5, 0.99, 0.7, 0.3, 0.45])
    return logits, p


@pytest.mark.parametrize("candidates", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("top_k", [0, 5])
def test_top_p_among_candidates_equals_sorting_whole_rows(monkeypatch: pytest.MonkeyPatch, candidates: int,
                                                         top_k: int) -> None:
    logits, p = _top_p_rows()
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 10**6)  # every row sorted in full
    whole = logits_to_probs(logits, 0.8, top_k=top_k, top_p=p)
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    fast = logits_to_probs(logits, 0.8, top_k=top_k, top_p=p)
    torch.testing.assert_close(fast, whole, atol=0.0, rtol=0.0)


def test_top_p_ties_at_the_end_of_the_nucleus_keep_the_lowest_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.zeros(300)
    logits[[3, 50, 51, 52, 53]] = 5.0  # five tied tokens hold nearly all the mass
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 4)  # fewer candidates than tied tokens
    probs = logits_to_probs(logits, 1.0, top_p=0.5)  # each tied token 0.143: the mass before the 4th is 0.43
    assert probs.nonzero().flatten().tolist() == [3, 50, 51, 52]


def test_only_rows_whose_nucleus_is_wider_than_the_candidates_are_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, p = _top_p_rows()
    sorted_rows: list[int] = []
    real_sort = torch.sort

    def spy(x, *args, **kwargs):
        sorted_rows.append(x.shape[0])
        return real_sort(x, *args, **kwargs)

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 64)
    alone = [logits_to_probs(logits[i], 0.8, top_p=p[i]) for i in range(len(p))]
    monkeypatch.setattr(torch, "sort", spy)
    batch = logits_to_probs(logits, 0.8, top_p=p)
    assert sorted_rows == [4]  # the four flat rows (nuclei of 135-296 tokens); the others end among 64
    for i, row in enumerate(alone):  # a row's result does not depend on which rows were sorted
        torch.testing.assert_close(batch[i], row, atol=0.0, rtol=0.0)
