"""The two MILPs of LoRAFusion's packing (EuroSys'26, equations 3 and 4) on HiGHS through
`scipy.optimize.milp` (the `packing` extra; `flexserve.finetune.packing` falls back to greedy
packing without it).

Variables, per item s, group a and bin b: x[s, b] in {0, 1} (s is in b), k[a, b] >= 0 integer
(a's tokens in b, in padding multiples P), and in stage 1 z[b] in {0, 1} (b is used).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import lil_matrix


def _model(items: Sequence, groups: list[str], num_bins: int, capacity: int,
           max_bin_blocks: int | None, multiple: int, with_z: bool):
    """(number of variables, constraint rows as (matrix, lb, ub)) shared by both stages."""
    n, g = len(items), len(groups)
    num_x, num_k = n * num_bins, g * num_bins
    num_vars = num_x + num_k + (num_bins if with_z else 0)
    group_index = {a: i for i, a in enumerate(groups)}

    def x(s: int, b: int) -> int:
        return s * num_bins + b

    def k(a: int, b: int) -> int:
        return num_x + a * num_bins + b

    def z(b: int) -> int:
        return num_x + num_k + b

    rows = n + g * num_bins + num_bins * (2 if with_z else 1) + (
        num_bins if max_bin_blocks is not None else 0) + (num_bins - 1 if with_z else 0)
    a_matrix = lil_matrix((rows, num_vars))
    lb, ub = np.zeros(rows), np.zeros(rows)
    row = 0
    for s in range(n):  # every item in exactly one bin
        for b in range(num_bins):
            a_matrix[row, x(s, b)] = 1
        lb[row] = ub[row] = 1
        row += 1
    for a in range(g):  # a group's tokens in a bin fit its padded multiples
        for b in range(num_bins):
            for s, item in enumerate(items):
                if group_index[item.group] == a:
                    a_matrix[row, x(s, b)] = item.num_tokens
            a_matrix[row, k(a, b)] = -multiple
            lb[row], ub[row] = -np.inf, 0
            row += 1
    for b in range(num_bins):  # capacity (and, in stage 1, a used bin holds something)
        for a in range(g):
            a_matrix[row, k(a, b)] = multiple
        if with_z:
            a_matrix[row, z(b)] = -capacity
        lb[row], ub[row] = -np.inf, 0 if with_z else capacity
        row += 1
        if with_z:
            for a in range(g):
                a_matrix[row, k(a, b)] = multiple
            a_matrix[row, z(b)] = -1
            lb[row], ub[row] = 0, np.inf
            row += 1
    if max_bin_blocks is not None:
        for b in range(num_bins):
            for s, item in enumerate(items):
                a_matrix[row, x(s, b)] = item.num_blocks
            if with_z:
                a_matrix[row, z(b)] = -max_bin_blocks
            lb[row], ub[row] = -np.inf, 0 if with_z else max_bin_blocks
            row += 1
    if with_z:
        for b in range(num_bins - 1):  # used bins come first
            a_matrix[row, z(b + 1)] = 1
            a_matrix[row, z(b)] = -1
            lb[row], ub[row] = -np.inf, 0
            row += 1
    return num_vars, num_x, num_k, LinearConstraint(a_matrix.tocsr(), lb, ub)


def _solve(c: np.ndarray, integrality: np.ndarray, upper: np.ndarray,
           constraint: LinearConstraint, lower: np.ndarray, time_limit_s: float):
    if time_limit_s <= 0:
        return None
    result = milp(c, integrality=integrality, bounds=Bounds(lower, upper),
                  constraints=constraint, options={"time_limit": time_limit_s, "disp": False})
    return None if result.x is None else np.rint(result.x).astype(np.int64)


def min_bins(items: Sequence, groups: list[str], num_bins: int, capacity: int,
             max_bin_blocks: int | None, time_limit_s: float, multiple: int) -> int | None:
    """Stage 1 (equation 3): the fewest bins, at most `num_bins`; None without a solution."""
    num_vars, num_x, num_k, constraint = _model(items, groups, num_bins, capacity,
                                                max_bin_blocks, multiple, with_z=True)
    c = np.zeros(num_vars)
    c[num_x + num_k:] = 1
    lower = np.zeros(num_vars)
    total = sum(item.num_tokens for item in items)
    lower[num_x + num_k:num_x + num_k + min(-(-total // capacity), num_bins)] = 1
    upper = np.ones(num_vars)
    upper[num_x:num_x + num_k] = -(-capacity // multiple)
    solution = _solve(c, np.ones(num_vars), upper, constraint, lower, time_limit_s)
    return None if solution is None else int(solution[num_x + num_k:].sum())


def min_smallest_bin(items: Sequence, groups: list[str], num_bins: int, capacity: int,
                     max_bin_blocks: int | None, time_limit_s: float, multiple: int
                     ) -> list[list[int]] | None:
    """Stage 2 (equation 4): `num_bins` bins whose smallest is as small as possible (the last
    bin's load is minimized: the bins are interchangeable); None without a solution."""
    num_vars, num_x, num_k, constraint = _model(items, groups, num_bins, capacity,
                                                max_bin_blocks, multiple, with_z=False)
    c = np.zeros(num_vars)
    for a in range(len(groups)):
        c[num_x + a * num_bins + num_bins - 1] = multiple
    upper = np.ones(num_vars)
    upper[num_x:num_x + num_k] = -(-capacity // multiple)
    solution = _solve(c, np.ones(num_vars), upper, constraint, np.zeros(num_vars), time_limit_s)
    if solution is None:
        return None
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for s in range(len(items)):
        b = int(np.argmax(solution[s * num_bins:(s + 1) * num_bins]))
        bins[b].append(s)
    return bins
