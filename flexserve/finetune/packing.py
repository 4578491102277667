"""Packing of training sequences into bins under a token capacity: LoRAFusion's two-stage
packing (EuroSys'26, section 5.2, algorithm 1) over the sequences of every running job.

A bin is what the fine-tuning scheduler runs at once: its sequences hold KV blocks and
activations together, and the next bin starts after the last backward window of this one. A bin
holds at most `capacity` tokens and, when given, `max_bin_blocks` KV blocks (each item rounds up
to whole blocks), so it always fits in an idle cache. An item longer than the capacity is a bin of
its own.

Algorithm 1, for one round (the current optimizer step of every job in it):
1. greedy packing (first-fit decreasing) gives B_g bins, the fallback;
2. stage 1, MILP_MinBins (equation 3): the fewest bins, each item in one bin, each group's tokens
   in a bin rounded up to the padding multiple, used bins contiguous from the first; kept only
   when it beats B_g;
3. stage 2, MILP_MinSmallestBin (equation 4): with B* bins, the smallest bin as small as
   possible. Bins are interchangeable, so minimizing the smallest load equals minimizing the load
   of the last bin, a linear objective;
4. the greedy packing is returned when the MILP did not beat it (same bins, a smallest bin no
   smaller).
Both MILPs share `time_limit_s` (HiGHS through `scipy.optimize.milp`, the `packing` extra): the
packing runs on the engine thread, so a round never stalls an iteration longer than that. A
solver that runs out of time without a solution, an unavailable scipy, a zero time limit or a
round too large for the solver keep the greedy packing. Where the greedy packing meets
the lower bounds already (ceil(total / capacity) bins, a smallest bin of total - (B - 1) *
capacity tokens) no solver runs. Not taken from the paper: adapter grouping and the merge across
global batches (they keep the pipeline-parallel bubble lemma; one engine has no pipeline and each
job's bins never cross its optimizer step).

`pack_round` adds LobRA's length buckets (`flexserve.finetune.bucketing`): items are bucketed by
length, each bucket is packed as above, and underfilled bins are then merged across buckets
(first-fit, longest bucket first) so the bucketing costs no more bins than the capacity forces.
`pack_jobs` packs a round of several jobs: the items of jobs with a capacity by `pack_round`,
those of a job without one one per bin, beside the others'.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flexserve.finetune.bucketing import bucket_lengths

logger = logging.getLogger(__name__)

# The MILP has items x bins binaries; past this many the round keeps the greedy packing (HiGHS
# would spend its whole time limit on the model build alone).
MAX_MILP_VARIABLES = 20_000
_scipy_missing_logged = False


@dataclass(slots=True, frozen=True)
class PackItem:
    """One sequence (or a DPO pair, packed as one) to put into a bin."""

    group: str  # the job it belongs to (LoRAFusion's adapter: padding is per group and bin)
    num_tokens: int  # its tokens
    num_blocks: int = 0  # its KV blocks (0: not bounded by blocks)


@dataclass(slots=True)
class Packing:
    """Bins of item indices, in the order they run."""

    bins: list[list[int]]  # each bin's item indices, ascending
    method: str  # "greedy" or "milp": which packing algorithm 1 returned


def _check(items: Sequence[PackItem], capacity: int, max_bin_blocks: int | None,
           padding_multiple: int) -> None:
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
    if max_bin_blocks is not None and (type(max_bin_blocks) is not int or max_bin_blocks < 1):
        raise ValueError(f"max_bin_blocks must be a positive integer or None, got "
                         f"{max_bin_blocks!r}")
    if type(padding_multiple) is not int or padding_multiple < 1:
        raise ValueError(f"padding_multiple must be a positive integer, got {padding_multiple!r}")
    for i, item in enumerate(items):
        if type(item.num_tokens) is not int or item.num_tokens < 1 or item.num_blocks < 0:
            raise ValueError(f"item {i} has {item.num_tokens} tokens and {item.num_blocks} "
                             "blocks; it needs at least one token")


def _padded_load(items: Sequence[PackItem], members: list[int], multiple: int) -> int:
    per_group: dict[str, int] = {}
    for i in members:
        per_group[items[i].group] = per_group.get(items[i].group, 0) + items[i].num_tokens
    return sum(-(-n // multiple) * multiple for n in per_group.values())


def greedy_packing(items: Sequence[PackItem], capacity: int, max_bin_blocks: int | None = None,
                   padding_multiple: int = 1) -> list[list[int]]:
    """First-fit decreasing: longest item first, into the first bin it fits (tokens padded per
    group, blocks); bins in the order they open, members ascending."""
    bins: list[list[int]] = []
    blocks: list[int] = []
    for i in sorted(range(len(items)), key=lambda i: (-items[i].num_tokens, i)):
        item = items[i]
        for k, members in enumerate(bins):
            if (max_bin_blocks is None or blocks[k] + item.num_blocks <= max_bin_blocks) and (
                    _padded_load(items, members + [i], padding_multiple) <= capacity):
                members.append(i)
                blocks[k] += item.num_blocks
                break
        else:
            bins.append([i])
            blocks.append(item.num_blocks)
    return [sorted(members) for members in bins]


def pack_items(items: Sequence[PackItem], capacity: int, max_bin_blocks: int | None = None,
               time_limit_s: float = 0.05, padding_multiple: int = 1) -> Packing:
    """Algorithm 1 of LoRAFusion for one round of items (see the module docstring); both MILP
    stages together take at most `time_limit_s`."""
    _check(items, capacity, max_bin_blocks, padding_multiple)
    deadline = time.monotonic() + time_limit_s
    # Items over the capacity are bins of their own, first (longest first); the rest is packed.
    oversized = sorted((i for i, item in enumerate(items)
                        if -(-item.num_tokens // padding_multiple) * padding_multiple > capacity),
                       key=lambda i: (-items[i].num_tokens, i))
    rest = [i for i in range(len(items)) if i not in set(oversized)]
    sub = [items[i] for i in rest]
    greedy = greedy_packing(sub, capacity, max_bin_blocks, padding_multiple)
    bins, method = greedy, "greedy"
    if sub and time_limit_s > 0 and not _greedy_is_optimal(sub, greedy, capacity,
                                                           padding_multiple):
        solved = _milp_packing(sub, greedy, capacity, max_bin_blocks, deadline,
                               padding_multiple)
        if solved is not None:
            bins, method = solved, "milp"
    return Packing([[i] for i in oversized] + [[rest[i] for i in members] for members in bins],
                   method)


def _greedy_is_optimal(items: Sequence[PackItem], bins: list[list[int]], capacity: int,
                       multiple: int) -> bool:
    if multiple != 1:
        return False
    total = sum(item.num_tokens for item in items)
    smallest = min(sum(items[i].num_tokens for i in members) for members in bins)
    smallest_bound = max(total - (len(bins) - 1) * capacity,
                         min(item.num_tokens for item in items))
    return len(bins) == -(-total // capacity) and smallest <= smallest_bound


def _milp_packing(items: Sequence[PackItem], greedy: list[list[int]], capacity: int,
                  max_bin_blocks: int | None, deadline: float, multiple: int
                  ) -> list[list[int]] | None:
    """Stages 1 and 2 (equations 3 and 4); None where the greedy packing stands (line 10)."""
    global _scipy_missing_logged
    try:
        min_bins, min_smallest_bin = _import_solver()
    except ImportError:
        if not _scipy_missing_logged:
            _scipy_missing_logged = True
            logger.info("scipy is not installed: fine-tuning sequences are packed greedily "
                        "(pip install 'flexserve[packing]' for LoRAFusion's MILP packing)")
        return None
    num_bins = len(greedy)
    groups = sorted({item.group for item in items})
    if len(items) * num_bins + len(groups) * num_bins > MAX_MILP_VARIABLES:
        return None
    best = min_bins(items, groups, num_bins, capacity, max_bin_blocks,
                    deadline - time.monotonic(), multiple)
    if best is None or best >= num_bins:
        best = num_bins
    left = deadline - time.monotonic()
    if left <= 0:
        return None
    bins = min_smallest_bin(items, groups, best, capacity, max_bin_blocks, left, multiple)
    if bins is None:
        return None
    bins = [sorted(members) for members in bins if members]
    loads = [_padded_load(items, members, multiple) for members in bins]
    greedy_smallest = min(_padded_load(items, members, multiple) for members in greedy)
    if len(bins) > num_bins or (len(bins) == num_bins and min(loads) >= greedy_smallest):
        return None
    # The fullest bins first: the smallest runs last.
    order = sorted(range(len(bins)), key=lambda k: (-loads[k], bins[k][0]))
    return [bins[k] for k in order]


def _import_solver():
    from flexserve.finetune.packing_milp import min_bins, min_smallest_bin

    return min_bins, min_smallest_bin


def load_solver() -> bool:
    """Import the MILP solver now (scipy takes ~0.5 s to import), not in the first round's
    schedule; False when it is not installed."""
    try:
        _import_solver()
        return True
    except ImportError:
        return False


def pack_round(items: Sequence[PackItem], capacity: int, max_bin_blocks: int | None = None,
               time_limit_s: float = 0.05, max_buckets: int = 1, bucket_interval: int = 256
               ) -> Packing:
    """Bins for one round of several jobs' items: length buckets (LobRA), each bucket packed by
    `pack_items`, then underfilled bins merged across buckets (first fit, longest bucket's bins
    first). With one bucket this is `pack_items`. All MILPs together take at most
    `time_limit_s`."""
    _check(items, capacity, max_bin_blocks, 1)
    deadline = time.monotonic() + time_limit_s
    buckets = bucket_lengths([item.num_tokens for item in items], max_buckets, bucket_interval)
    if len(buckets.boundaries) <= 1:
        return pack_items(items, capacity, max_bin_blocks, time_limit_s)
    bins: list[list[int]] = []
    methods = set()
    for k in reversed(range(len(buckets.boundaries))):  # the longest bucket first
        members = [i for i, b in enumerate(buckets.bucket_of) if b == k]
        packed = pack_items([items[i] for i in members], capacity, max_bin_blocks,
                            max(deadline - time.monotonic(), 0.0))
        methods.add(packed.method)
        bins.extend([members[i] for i in b] for b in packed.bins)
    bins = _merge_underfilled(items, bins, capacity, max_bin_blocks)
    return Packing(bins, "milp" if "milp" in methods else "greedy")


def _merge_underfilled(items: Sequence[PackItem], bins: list[list[int]], capacity: int,
                       max_bin_blocks: int | None) -> list[list[int]]:
    """Empty the smallest bins into earlier ones where their items fit (whole bins only, so a
    bin either stays or goes)."""
    def tokens(members: list[int]) -> int:
        return sum(items[i].num_tokens for i in members)

    def blocks(members: list[int]) -> int:
        return sum(items[i].num_blocks for i in members)

    merged = [list(members) for members in bins]
    for k in sorted(range(len(merged)), key=lambda k: (tokens(merged[k]), -k)):
        source = merged[k]
        if not source or any(items[i].num_tokens > capacity for i in source):
            continue
        moves: list[tuple[int, int]] = []
        room = {j: (capacity - tokens(m), None if max_bin_blocks is None
                    else max_bin_blocks - blocks(m))
                for j, m in enumerate(merged) if j != k and m}
        for i in sorted(source, key=lambda i: -items[i].num_tokens):
            for j in sorted(room):
                free_tokens, free_blocks = room[j]
                if items[i].num_tokens <= free_tokens and (
                        free_blocks is None or items[i].num_blocks <= free_blocks):
                    room[j] = (free_tokens - items[i].num_tokens, None if free_blocks is None
                               else free_blocks - items[i].num_blocks)
                    moves.append((i, j))
                    break
            else:
                break
        if len(moves) == len(source):
            for i, j in moves:
                merged[j].append(i)
            merged[k] = []
    return [sorted(members) for members in merged if members]


def pack_jobs(items: Sequence[PackItem], capacities: Mapping[str, int | None],
              max_bin_blocks: int | None = None, time_limit_s: float = 0.05,
              max_buckets: int = 1, bucket_interval: int = 256) -> Packing:
    """A round's bins for the items of several jobs (`PackItem.group`: the job). The items of
    jobs with a capacity are packed by `pack_round` under the smallest of their capacities; a
    job whose capacity is None runs one item per bin, in order, each beside the other jobs'
    items in the first later bin whose KV blocks still fit `max_bin_blocks`."""
    packed = [i for i, item in enumerate(items) if capacities[item.group] is not None]
    bins: list[list[int]] = []
    method = "greedy"
    if packed:
        capacity = min(capacities[items[i].group] for i in packed)
        packing = pack_round([items[i] for i in packed], capacity, max_bin_blocks, time_limit_s,
                             max_buckets, bucket_interval)
        method = packing.method
        bins = [[packed[i] for i in members] for members in packing.bins]
    blocks = [sum(items[i].num_blocks for i in members) for members in bins]
    after: dict[str, int] = {}  # a job without a capacity: the first bin its next item may join
    for i, item in enumerate(items):
        if capacities[item.group] is not None:
            continue
        k = after.get(item.group, 0)
        while k < len(bins) and max_bin_blocks is not None and (
                blocks[k] + item.num_blocks > max_bin_blocks):
            k += 1
        if k == len(bins):
            bins.append([])
            blocks.append(0)
        bins[k].append(i)
        blocks[k] += item.num_blocks
        after[item.group] = k + 1
    return Packing([sorted(members) for members in bins], method)
