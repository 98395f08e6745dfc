"""Tests for verispec.speculative.suffix: the counted suffix trie, the global store and the drafter."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from verispec.config import SpeculativeConfig
from verispec.speculative.base import Outcome
from verispec.speculative.suffix import SuffixDrafter, SuffixStore, SuffixTrie, make_suffix_drafter


def occurrences(seqs: list[list[int]], sub: list[int]) -> tuple[int, int]:
    """Brute force: (times ``sub`` occurs in ``seqs``, times it occurs followed by a token)."""
    n = len(sub)
    count = followed = 0
    for s in seqs:
        for i in range(len(s) - n + 1):
            if s[i : i + n] == sub:
                count += 1
                followed += i + n < len(s)
    return count, followed


def all_substrings(seqs: list[list[int]], depth: int) -> set[tuple[int, ...]]:
    return {tuple(s[i : i + n]) for s in seqs for n in range(1, depth + 1) for i in range(len(s) - n + 1)}


def assert_counts_match(trie: SuffixTrie, seqs: list[list[int]]) -> None:
    for sub in all_substrings(seqs, trie.depth):
        node = trie.find(list(sub))
        assert node is not None, sub
        count, followed = occurrences(seqs, list(sub))
        if len(sub) == trie.depth:
            followed = 0  # full-depth nodes are never extended
        assert (node.count, node.followed) == (count, followed), sub
    assert trie.num_nodes == 1 + len(all_substrings(seqs, trie.depth))


# --------------------------------------------------------------------------- trie


def test_counts_match_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    trie = SuffixTrie(depth=4)
    for s in seqs:
        trie.insert(s)
    assert_counts_match(trie, seqs)
    assert trie.find([9]) is None


def test_incremental_extend_equals_one_insert() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(3) for _ in range(40)]
    trie = SuffixTrie(depth=5)
    open_nodes: list = []
    cut = 0
    while cut < len(tokens):
        step = rng.randrange(1, 6)
        open_nodes = trie.extend(open_nodes, tokens[cut : cut + step])
        cut += step
    assert_counts_match(trie, [tokens])
    # The open suffixes are the nodes of the sequence's last 1..depth tokens.
    assert open_nodes == [trie.find(tokens[-n:]) for n in range(1, 6)]


def test_match_is_longest_followed_suffix() -> None:
    trie = SuffixTrie(depth=8)
    trie.insert([5, 1, 2, 7, 3, 1, 2, 8])
    # (1, 2) was followed (by 7 and 8); (9, 1, 2) never occurred.
    m, node = trie.match([9, 1, 2], max_length=8)
    assert m == 2 and node is trie.find([1, 2])
    # (5, 1, 2) occurred and was followed by 7.
    assert trie.match([4, 5, 1, 2], max_length=8)[0] == 3
    assert trie.match([4, 5, 1, 2], max_length=1)[0] == 1
    # The last token 8 only ends the sequence: never followed, no match.
    assert trie.match([8], max_length=8) == (0, None)


def test_draft_follows_most_frequent_and_stops_below_min_prob() -> None:
    trie = SuffixTrie(depth=8)
    for s in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 9, 9]):
        trie.insert(s)
    # After (1, 2): 3 always (p=1), then 4 (2/3), then 5 or 6 (1/2 each: path 1/3).
    d = trie.draft([1, 2], k=5, max_spec_factor=4.0, min_token_prob=0.5)
    assert d.tokens == [3, 4]
    assert d.score == pytest.approx(1 + 2 / 3)
    assert d.match_length == 2
    assert trie.draft([1, 2], k=5, max_spec_factor=4.0, min_token_prob=0.3).tokens[:2] == [3, 4]
    assert len(trie.draft([1, 2], k=5, max_spec_factor=4.0, min_token_prob=0.3).tokens) == 3


def test_draft_length_bounded_by_spec_factor_k_and_depth() -> None:
    trie = SuffixTrie(depth=6)
    trie.insert([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # match (2,) has length 1: factor 1.0 allows 1 token, factor 2.0 allows 2.
    assert trie.draft([2], k=5, max_spec_factor=1.0, min_token_prob=0.1).tokens == [3]
    assert trie.draft([2], k=5, max_spec_factor=2.0, min_token_prob=0.1).tokens == [3, 4]
    # match (1, 2, 3) of length 3 with factor 2 -> 6, but k = 2.
    assert trie.draft([1, 2, 3], k=2, max_spec_factor=2.0, min_token_prob=0.1).tokens == [4, 5]
    # k = 4 leaves room for a match of at most depth - k = 2 tokens: match + draft <= depth.
    d = trie.draft([1, 2, 3], k=4, max_spec_factor=10.0, min_token_prob=0.1)
    assert (d.match_length, d.tokens) == (2, [4, 5, 6, 7])
    assert trie.draft([1, 2, 3], k=0, max_spec_factor=1.0, min_token_prob=0.1).tokens == []


def test_remove_undoes_insert_and_frees_nodes() -> None:
    rng = random.Random(2)
    a = [rng.randrange(3) for _ in range(25)]
    b = [rng.randrange(3) for _ in range(25)]
    trie = SuffixTrie(depth=4)
    trie.insert(a)
    trie.insert(b)
    trie.remove(a)
    assert_counts_match(trie, [b])
    trie.remove(b)
    assert trie.num_nodes == 1 and not trie.root.children and trie.root.followed == 0


# --------------------------------------------------------------------------- global store


def test_store_evicts_oldest_request_first() -> None:
    store = SuffixStore(depth=4, max_requests=2, max_tokens=1000)
    outputs = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 1, 2]]
    for out in outputs:
        store.add(out)
    assert len(store) == 2 and store.num_tokens == 7
    assert_counts_match(store.trie, outputs[1:])
    assert store.trie.find([1, 2, 3]) is None  # only the evicted request held it


def test_store_memory_bound_holds_under_churn() -> None:
    """The stated bound: <= max_tokens tokens and <= depth * max_tokens + 1 trie nodes."""
    depth, max_tokens = 6, 200
    store = SuffixStore(depth=depth, max_requests=50, max_tokens=max_tokens)
    rng = random.Random(3)
    for _ in range(100):
        store.add([rng.randrange(50) for _ in range(rng.randrange(1, 120))])
        assert store.num_tokens <= max_tokens
        assert len(store) <= 50
        assert store.trie.num_nodes <= depth * store.num_tokens + 1
    store.add([rng.randrange(50) for _ in range(500)])  # longer than the bound: keep its tail
    assert len(store) == 1 and store.num_tokens == max_tokens
    assert store.trie.num_nodes <= depth * max_tokens + 1


def test_store_with_zero_capacity_holds_nothing() -> None:
    store = SuffixStore(depth=4, max_requests=0, max_tokens=100)
    store.add([1, 2, 3])
    assert len(store) == 0 and store.trie.num_nodes == 1


# --------------------------------------------------------------------------- drafter


def fake_seq(prompt: list[int], slot: int = 0) -> SimpleNamespace:
    seq = SimpleNamespace(prompt_ids=prompt, output_ids=[], slot=slot)
    seq.token_ids = prompt  # updated by commit()
    return seq


def commit(drafter: SuffixDrafter, seq: SimpleNamespace, tokens: list[int]) -> None:
    seq.output_ids = seq.output_ids + tokens
    seq.token_ids = seq.prompt_ids + seq.output_ids
    drafter.feedback(seq, Outcome(0, 0, tokens))


def test_drafter_sees_only_committed_tokens() -> None:
    drafter = SuffixDrafter(8, 10, 1000, max_spec_factor=4.0, min_token_prob=0.1)
    seq = fake_seq([1, 2, 3, 4, 9, 1, 2])
    drafter.start(seq)
    assert drafter.propose(seq, 3).tokens == [3, 4, 9]
    # The drafts were rejected and 7 committed instead: nothing of [3, 4, 9] was inserted.
    commit(drafter, seq, [7])
    trie = drafter._requests[0].trie
    assert trie.find([1, 2, 3]).count == 1 and trie.find([2, 7]).count == 1
    assert drafter.propose(seq, 3).tokens == []  # 7 never occurred before


def test_finished_output_drafts_for_the_next_request() -> None:
    drafter = SuffixDrafter(8, 10, 1000, max_spec_factor=2.0, min_token_prob=0.1)
    first = fake_seq([1, 2])
    drafter.start(first)
    commit(drafter, first, [30, 31, 32, 33, 34])
    drafter.finish(first)
    second = fake_seq([5, 6, 30, 31])
    drafter.start(second)
    assert drafter.propose(second, 3).tokens == [32, 33, 34]
    # Without the global store nothing matches.
    lonely = SuffixDrafter(8, 0, 1000, max_spec_factor=2.0, min_token_prob=0.1)
    lonely.start(second)
    assert lonely.propose(second, 3).tokens == []


# --------------------------------------------------------------------------- config


def test_config_keys_follow_vllm_names() -> None:
    cfg = SpeculativeConfig.from_dict({
        "method": "suffix", "suffix_decoding_max_tree_depth": 32, "suffix_decoding_max_cached_requests": 5,
        "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2,
    })
    drafter = make_suffix_drafter(cfg, None)
    assert (drafter.depth, drafter.store.max_requests, drafter.max_spec_factor, drafter.min_token_prob) == (
        32, 5, 2.0, 0.2)


@pytest.mark.parametrize("key,value,message", [
    ("suffix_decoding_max_tree_depth", 1, "max_tree_depth must be >= 2"),
    ("suffix_decoding_max_cached_requests", -1, "max_cached_requests must be >= 0"),
    ("suffix_decoding_max_cached_tokens", 1.5, "max_cached_tokens must be an integer"),
    ("suffix_decoding_max_spec_factor", 0, "max_spec_factor must be > 0"),
    ("suffix_decoding_min_token_prob", 1.5, r"min_token_prob must be in \[0, 1\]"),
    ("suffix_decoding_min_token_prob", "high", "min_token_prob must be a number"),
])
def test_bad_suffix_config_is_a_clear_error(key, value, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(method="suffix", **{key: value})
