"""Tests for verispec.speculative.ngram: literal cases and a brute-force reference comparison."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from verispec.speculative.ngram import NgramIndex


def _reference_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Obviously-correct (and slow) definition of the proposal.

    For n from max_n down to min_n: take the suffix of length n and scan start positions
    from the newest earlier one (length - n - 1) down to 0; the first match wins and the
    tokens after it are proposed.  Start length - n is the suffix itself and is skipped.
    """
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + k])
    return []


# --------------------------------------------------------------------------- literal cases


def test_simple_repetition() -> None:
    index = NgramIndex([1, 2, 3, 4, 1, 2], min_n=1, max_n=3)
    assert index.propose(2) == [3, 4]
    assert index.propose(10) == [3, 4, 1, 2]  # copies up to the end of the sequence


def test_longest_match_preferred_over_shorter() -> None:
    # (1, 2) last occurred at 5..6 (followed by 8), but (5, 1, 2) occurred at 0..2.
    tokens = [5, 1, 2, 7, 3, 1, 2, 8, 5, 1, 2]
    assert NgramIndex(tokens, min_n=1, max_n=3).propose(4) == [7, 3, 1, 2]
    # With max_n = 2 only the bigram is tried: its most recent occurrence wins.
    assert NgramIndex(tokens, min_n=1, max_n=2).propose(4) == [8, 5, 1, 2]


def test_most_recent_occurrence() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    assert NgramIndex(tokens, min_n=2, max_n=2).propose(2) == [4, 9]


def test_k_truncation_at_end_of_sequence() -> None:
    index = NgramIndex([7, 8, 9, 7], min_n=1, max_n=1)
    assert index.propose(1) == [8]
    assert index.propose(3) == [8, 9, 7]
    assert index.propose(50) == [8, 9, 7]
    assert index.propose(0) == []


def test_overlapping_continuation() -> None:
    # Suffix (a, b) at 4..5; the most recent earlier occurrence is 2..3, which leaves only
    # two tokens to copy.
    a, b = 10, 11
    index = NgramIndex([a, b, a, b, a, b], min_n=2, max_n=2)
    assert index.propose(5) == [a, b]
    # A run of one token: suffix (a, a) at 2..3 overlaps its earlier occurrence at 1..2.
    assert NgramIndex([a, a, a, a], min_n=2, max_n=3).propose(4) == [a]


def test_no_match_returns_empty() -> None:
    assert NgramIndex([1, 2, 3, 4], min_n=1, max_n=3).propose(3) == []
    assert NgramIndex([], min_n=1, max_n=3).propose(3) == []
    assert NgramIndex([5], min_n=1, max_n=3).propose(3) == []


def test_min_n_respected() -> None:
    tokens = [1, 2, 3, 4, 5, 3]  # only the unigram (3,) repeats
    assert NgramIndex(tokens, min_n=1, max_n=3).propose(2) == [4, 5]
    assert NgramIndex(tokens, min_n=2, max_n=3).propose(2) == []


def test_suffix_itself_is_not_a_match() -> None:
    index = NgramIndex([1, 2, 3], min_n=1, max_n=3)
    assert index.propose(3) == []
    index.extend([1])
    assert index.propose(3) == [2, 3, 1]


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        NgramIndex([], min_n=0, max_n=2)
    with pytest.raises(ValueError):
        NgramIndex([], min_n=3, max_n=2)
    index = NgramIndex([1, 2, 3], min_n=1, max_n=2)
    with pytest.raises(ValueError):
        index.truncate(4)
    with pytest.raises(ValueError):
        index.truncate(-1)


# --------------------------------------------------------------------------- incremental


def test_incremental_extend_equals_build_from_scratch() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(4) for _ in range(300)]
    incremental = NgramIndex(tokens[:10], min_n=1, max_n=4)
    position = 10
    while position < len(tokens):
        step = rng.randrange(0, 5)
        incremental.extend(tokens[position : position + step])
        position = min(position + step, len(tokens))
        scratch = NgramIndex(tokens[:position], min_n=1, max_n=4)
        assert len(incremental) == position
        assert incremental.tokens == scratch.tokens
        for k in (1, 3, 8):
            assert incremental.propose(k) == scratch.propose(k)


def test_truncate_equals_build_from_scratch() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(3) for _ in range(120)]
    index = NgramIndex(tokens, min_n=2, max_n=4)
    for length in (119, 80, 80, 33, 2, 0):
        index.truncate(length)
        assert index.tokens == tuple(tokens[:length])
        assert index.propose(5) == NgramIndex(tokens[:length], 2, 4).propose(5)
    # Extending after a rollback keeps working.
    index.extend(tokens[:50])
    assert index.propose(5) == _reference_propose(tokens[:50], 5, 2, 4)


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("alphabet", [2, 3, 5])
@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_matches_brute_force_reference(alphabet: int, min_n: int, max_n: int) -> None:
    rng = random.Random(1000 * alphabet + 10 * min_n + max_n)
    for _ in range(20):
        length = rng.randrange(0, 60)
        tokens = [rng.randrange(alphabet) for _ in range(length)]
        index = NgramIndex([], min_n=min_n, max_n=max_n)
        # Check after every single appended token, so every prefix is compared.
        for position, token in enumerate(tokens):
            index.extend([token])
            prefix = tokens[: position + 1]
            for k in (1, 2, 5):
                assert index.propose(k) == _reference_propose(prefix, k, min_n, max_n), (
                    prefix,
                    k,
                )
