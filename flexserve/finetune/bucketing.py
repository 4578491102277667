"""Length buckets for training sequences: LobRA's dynamic bucketing (VLDB'25, section 4.3).

Sequences are first sorted into U intervals of a fixed width (LobRA uses 256, 512, ...); the
dynamic program then picks R <= U bucket boundaries among the intervals' upper bounds so that
padding every sequence to its bucket's boundary costs the fewest tokens (equation 4):

    State[0][j] = 0,  State[i][0] = inf (i >= 1)
    State[i][j] = min_{i' < i} State[i'][j - 1] + sum_{i' < i'' <= i} sum_{s in I_i''} (u_i - len(s))

over the non-empty intervals 1..U in increasing order, O(R U^2) after an O(B) bucket sort. LobRA
pads each interval to its own bound before the sum; the padding inside an interval is the same
for every choice of boundaries, so both give the same optimum. Here nothing is ever padded
(variable-length rows): the buckets group sequences of similar length, so the sequences packed
together run their forward and backward windows in the same iterations and finish together
(`flexserve.finetune.packing.pack_round`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Buckets:
    """The result of `bucket_lengths`."""

    boundaries: tuple[int, ...]  # each bucket's upper length bound, ascending
    bucket_of: tuple[int, ...]  # bucket_of[i]: index into boundaries of sequence i's bucket
    padding: int  # tokens that padding every sequence to its bucket's bound would add


def bucket_lengths(lengths: list[int], max_buckets: int, interval: int = 1) -> Buckets:
    """The at most `max_buckets` buckets of least padding for sequences of these lengths, with
    bounds at multiples of `interval` (capped at the longest length; 1: any length)."""
    if type(max_buckets) is not int or max_buckets < 1:
        raise ValueError(f"max_buckets must be a positive integer, got {max_buckets!r}")
    if type(interval) is not int or interval < 1:
        raise ValueError(f"interval must be a positive integer, got {interval!r}")
    if any(type(n) is not int or n < 0 for n in lengths):
        raise ValueError("lengths must be non-negative integers")
    if not lengths:
        return Buckets((), (), 0)
    longest = max(lengths)
    # Non-empty intervals in increasing order: (upper bound, count, summed length).
    by_bound: dict[int, list[int]] = {}
    for n in lengths:
        bound = min(-(-n // interval) * interval, longest) if n else min(interval, longest)
        entry = by_bound.setdefault(bound, [0, 0])
        entry[0] += 1
        entry[1] += n
    bounds = sorted(by_bound)
    counts = [by_bound[u][0] for u in bounds]
    sums = [by_bound[u][1] for u in bounds]
    num_intervals = len(bounds)
    num_buckets = min(max_buckets, num_intervals)
    # prefix sums over intervals: sequences and their lengths in intervals [0, i)
    prefix_count, prefix_sum = [0], [0]
    for c, s in zip(counts, sums):
        prefix_count.append(prefix_count[-1] + c)
        prefix_sum.append(prefix_sum[-1] + s)

    def cost(first: int, last: int) -> int:
        """Padding of one bucket over intervals first..last (0-based, inclusive)."""
        count = prefix_count[last + 1] - prefix_count[first]
        return bounds[last] * count - (prefix_sum[last + 1] - prefix_sum[first])

    inf = float("inf")
    # state[j][i]: least padding of intervals [0, i) in j buckets; choice[j][i]: the i' it came from
    state = [[inf] * (num_intervals + 1) for _ in range(num_buckets + 1)]
    choice = [[0] * (num_intervals + 1) for _ in range(num_buckets + 1)]
    for j in range(num_buckets + 1):
        state[j][0] = 0
    for j in range(1, num_buckets + 1):
        for i in range(1, num_intervals + 1):
            for start in range(i):
                value = state[j - 1][start] + cost(start, i - 1)
                if value < state[j][i]:
                    state[j][i], choice[j][i] = value, start
    best_j = min(range(1, num_buckets + 1), key=lambda j: (state[j][num_intervals], j))
    cuts = []
    i, j = num_intervals, best_j
    while i > 0:
        cuts.append(bounds[i - 1])
        i, j = choice[j][i], j - 1
    boundaries = tuple(sorted(cuts))
    bucket_of = []
    for n in lengths:
        bucket_of.append(next(k for k, bound in enumerate(boundaries) if n <= bound))
    return Buckets(boundaries, tuple(bucket_of), int(state[best_j][num_intervals]))
