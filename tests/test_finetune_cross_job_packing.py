"""Packing of several jobs' sequences into bins (LoRAFusion's two-stage MILP with its greedy
fallback) and LobRA's length buckets, pure Python.

- Whatever the items, a packing places every item exactly once, never exceeds the token or
  KV-block capacity (an item over the capacity is a bin of its own), and has no more bins than
  first-fit decreasing (property tests).
- The MILP path wins where first-fit decreasing is not optimal: fewer bins, or an emptier
  smallest bin; the greedy path runs where scipy is missing, the time limit is 0, or greedy meets
  the lower bounds already.
- The bucketing DP's padding equals a brute force over every choice of boundaries.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexserve.finetune import packing
from flexserve.finetune.bucketing import bucket_lengths
from flexserve.finetune.packing import (
    PackItem,
    greedy_packing,
    pack_items,
    pack_jobs,
    pack_round,
)


def check_packing(items: list[PackItem], bins: list[list[int]], capacity: int,
                  max_blocks: int | None) -> None:
    placed = sorted(i for members in bins for i in members)
    assert placed == list(range(len(items))), "every item exactly once"
    for members in bins:
        assert members == sorted(members) and members
        tokens = sum(items[i].num_tokens for i in members)
        if len(members) > 1 or items[members[0]].num_tokens <= capacity:
            assert tokens <= capacity
            if max_blocks is not None:
                assert sum(items[i].num_blocks for i in members) <= max_blocks
        else:
            assert len(members) == 1  # an item over the capacity runs alone


ITEMS = st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 40)), min_size=1,
                 max_size=12)


@settings(max_examples=60, deadline=None)
@given(ITEMS, st.integers(8, 64), st.sampled_from([None, 6, 12]),
       st.sampled_from([0.0, 0.2]))
def test_packings_respect_capacity_and_place_every_item_once(raw, capacity, max_blocks,
                                                             time_limit):
    items = [PackItem(group, n, -(-n // 4)) for group, n in raw]
    if max_blocks is not None:
        # A bin must be able to hold any item that fits the token capacity.
        max_blocks = max(max_blocks, max(it.num_blocks for it in items))
    packed = pack_items(items, capacity, max_blocks, time_limit_s=time_limit)
    check_packing(items, packed.bins, capacity, max_blocks)
    fitting = [it for it in items if it.num_tokens <= capacity]
    greedy = greedy_packing(fitting, capacity, max_blocks) if fitting else []
    assert len(packed.bins) <= len(greedy) + len(items) - len(fitting)
    if time_limit == 0.0:
        assert packed.method == "greedy"


@settings(max_examples=40, deadline=None)
@given(ITEMS, st.integers(8, 64), st.integers(1, 4), st.sampled_from([1, 8, 256]))
def test_rounds_with_length_buckets_respect_capacity(raw, capacity, max_buckets, interval):
    items = [PackItem(group, n, 0) for group, n in raw]
    packed = pack_round(items, capacity, None, 0.2, max_buckets, interval)
    check_packing(items, packed.bins, capacity, None)


def test_the_milp_packs_fewer_bins_than_first_fit_decreasing():
    lengths = [3, 4, 2, 2, 2, 5, 2, 9]  # 29 tokens, capacity 10: FFD needs 4 bins, 3 suffice
    items = [PackItem("ab"[i % 2], n) for i, n in enumerate(lengths)]
    assert len(greedy_packing(items, 10)) == 4
    packed = pack_items(items, 10, time_limit_s=5.0)
    assert packed.method == "milp" and len(packed.bins) == 3
    check_packing(items, packed.bins, 10, None)


def test_the_milp_leaves_the_smallest_bin_as_empty_as_it_can():
    lengths = [3, 4, 5, 6] * 4  # 72 tokens into bins of 64: FFD leaves 9 in its second bin
    items = [PackItem("a", n) for n in lengths]
    greedy = greedy_packing(items, 64)
    assert sorted(sum(lengths[i] for i in b) for b in greedy) == [9, 63]
    packed = pack_items(items, 64, time_limit_s=5.0)
    assert packed.method == "milp"
    # The least a second bin can hold is 72 - 64 = 8; the smaller bin runs last.
    assert [sum(lengths[i] for i in b) for b in packed.bins] == [64, 8]


def test_greedy_stands_where_it_is_optimal_or_no_solver_runs(monkeypatch):
    items = [PackItem("a", n, -(-n // 4)) for n in (10, 3, 5, 4, 9)]
    # 31 tokens in 2 bins of 16 and a smallest bin of 15 = 31 - 16: nothing to improve.
    assert pack_items(items, 16) == packing.Packing([[0, 2], [1, 3, 4]], "greedy")
    hard = [PackItem("a", n) for n in (3, 4, 2, 2, 2, 5, 2, 9)]
    assert pack_items(hard, 10, time_limit_s=0).method == "greedy"

    def no_scipy(*args, **kwargs):
        raise ImportError("no scipy")

    monkeypatch.setattr(packing, "_import_solver", no_scipy)
    packed = pack_items(hard, 10, time_limit_s=5.0)
    assert packed.method == "greedy" and len(packed.bins) == 4


def test_items_over_the_capacity_run_alone_first():
    items = [PackItem("a", 20), PackItem("b", 2), PackItem("a", 3), PackItem("b", 30)]
    assert pack_items(items, 16).bins == [[3], [0], [1, 2]]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        pack_items([PackItem("a", 3)], 0)
    with pytest.raises(ValueError, match="at least one token"):
        pack_items([PackItem("a", 0)], 8)
    with pytest.raises(ValueError, match="max_buckets"):
        bucket_lengths([3], 0)


def brute_force_padding(lengths: list[int], max_buckets: int, interval: int) -> int:
    longest = max(lengths)
    candidates = sorted({min(-(-n // interval) * interval, longest) for n in lengths})
    best = None
    for r in range(1, max_buckets + 1):
        for cut in itertools.combinations(candidates[:-1], r - 1):
            bounds = list(cut) + [candidates[-1]]
            padding = sum(next(b for b in bounds if n <= b) - n for n in lengths)
            best = padding if best is None else min(best, padding)
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=10), st.integers(1, 4),
       st.sampled_from([1, 4, 16]))
def test_bucketing_dp_matches_brute_force(lengths, max_buckets, interval):
    buckets = bucket_lengths(lengths, max_buckets, interval)
    assert buckets.padding == brute_force_padding(lengths, max_buckets, interval)
    assert len(buckets.boundaries) <= max_buckets
    assert buckets.padding == sum(buckets.boundaries[b] - n
                                  for n, b in zip(lengths, buckets.bucket_of))
    for n, b in zip(lengths, buckets.bucket_of):  # the tightest bucket that holds it
        assert n <= buckets.boundaries[b] and (b == 0 or n > buckets.boundaries[b - 1])


def test_bucketing_examples():
    # Two clear groups: short ones pad to 5, long ones to 100.
    assert bucket_lengths([3, 5, 4, 100, 98], 2).boundaries == (5, 100)
    assert bucket_lengths([3, 5, 4, 100, 98], 2).padding == 2 + 1 + 2
    assert bucket_lengths([3, 5, 4, 100, 98], 1).padding == 97 + 95 + 96 + 2
    # 256-token intervals: everything below 256 shares one interval, hence one bucket.
    assert bucket_lengths([3, 200, 40], 4, 256).boundaries == (200,)


@settings(max_examples=40, deadline=None)
@given(ITEMS, st.dictionaries(st.sampled_from("abc"), st.sampled_from([None, 16, 40]),
                              min_size=3, max_size=3))
def test_a_round_of_several_jobs_keeps_each_jobs_capacity(raw, capacities):
    items = [PackItem(group, n, -(-n // 4)) for group, n in raw]
    max_blocks = max(12, max(it.num_blocks for it in items))
    packed = pack_jobs(items, capacities, max_blocks, 0.2, 2, 8)
    placed = sorted(i for members in packed.bins for i in members)
    assert placed == list(range(len(items)))
    with_capacity = [capacities[it.group] for it in items if capacities[it.group] is not None]
    for members in packed.bins:
        bounded = [i for i in members if capacities[items[i].group] is not None]
        if len(bounded) > 1:
            assert sum(items[i].num_tokens for i in bounded) <= min(with_capacity)
        if len(members) > 1:
            assert sum(items[i].num_blocks for i in members) <= max_blocks
    for group, capacity in capacities.items():
        if capacity is None:  # one item per bin, in order
            where = [k for i in range(len(items)) if items[i].group == group
                     for k, members in enumerate(packed.bins) if i in members]
            assert where == sorted(set(where))
