"""Chunking and merging: pure functions, no cluster."""

from __future__ import annotations

import random

import pytest

from driver.schedule import Merge, cut


def _check_partition(chunks, n):
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == list(range(n))  # every request in exactly one chunk


def test_families_stay_whole_and_longest_come_first():
    rng = random.Random(0)
    costs = [rng.randint(5, 60) for _ in range(200)]
    families = [list(range(i, min(i + 4, 200))) for i in range(0, 200, 4)]
    chunks = cut(costs, families, workers=4, max_tokens=400, min_tokens=50)
    _check_partition(chunks, 200)
    where = {i: n for n, c in enumerate(chunks) for i in c}
    for f in families:  # each family fits max_tokens: never split, even where the shrinking budget is smaller
        assert len({where[i] for i in f}) == 1
    longest = [max(costs[i] for i in c) for c in chunks]
    assert longest == sorted(longest, reverse=True)


def test_budget_bounds_and_shrinks_toward_the_end():
    costs = [10] * 1000
    chunks = cut(costs, [[i] for i in range(1000)], workers=2, max_tokens=300, min_tokens=20)
    _check_partition(chunks, 1000)
    sizes = [sum(costs[i] for i in c) for c in chunks]
    assert max(sizes) <= 300 and min(sizes[:-1]) >= 20
    assert sizes[0] > sizes[-2]  # guided: later chunks are smaller
    assert sizes == sorted(sizes, reverse=True)


def test_a_family_over_budget_is_split_in_order():
    costs = [10] * 30
    chunks = cut(costs, [list(range(30))], workers=1, max_tokens=100, min_tokens=100)
    assert cut(costs, [list(range(30))], workers=1, max_tokens=300, min_tokens=10) == [list(range(30))]
    assert chunks == [list(range(i, i + 10)) for i in range(0, 30, 10)]


def test_more_workers_mean_more_chunks():
    costs = [10] * 400
    families = [[i] for i in range(400)]
    one = cut(costs, families, workers=1, max_tokens=10_000, min_tokens=10)
    four = cut(costs, families, workers=4, max_tokens=10_000, min_tokens=10)
    assert len(four) > len(one) >= 8


def test_merge_places_by_index_and_refuses_duplicates_and_gaps():
    m = Merge(5)
    m.add([3, 1], ["d", "b"])
    m.add([0, 2], ["a", "c"])
    with pytest.raises(AssertionError, match="never arrived"):
        m.result()
    with pytest.raises(AssertionError, match="arrived twice"):
        m.add([1], ["again"])
    m.add([4], ["e"])
    assert m.result() == ["a", "b", "c", "d", "e"]
    assert m.missing() == []
