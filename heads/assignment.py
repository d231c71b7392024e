"""Exact minimum-cost assignment (Hungarian method), for matching box slots to targets.

The detection loss matches each image's few target boxes (n <= max_boxes, usually < 10) to the
head's box slots. Sets this small make a pure-python O(n^2 m) solver cheap (tens of
microseconds), and it keeps `heads/` free of scipy.
"""

from __future__ import annotations

import math
from typing import Sequence

_INF = float("inf")


def linear_sum_assignment(cost: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """Minimum-cost matching of every row to a distinct column.

    cost: n rows x m columns (a nested list, or anything with `.tolist()`), finite values.
    With n <= m every row is matched; with n > m every column is. Returns (row, col) pairs
    sorted by row. Same answer as `scipy.optimize.linear_sum_assignment` up to ties.
    """
    if hasattr(cost, "tolist"):
        cost = cost.tolist()
    cost = [list(map(float, row)) for row in cost]
    n = len(cost)
    m = len(cost[0]) if n else 0
    if n == 0 or m == 0:
        return []
    if any(len(row) != m for row in cost):
        raise ValueError("cost: all rows must have the same length")
    if not all(math.isfinite(x) for row in cost for x in row):
        # An inf/nan entry would leave no finite augmenting path and the search would not end.
        raise ValueError("cost: entries must be finite (nan/inf found; diverged predictions?)")
    if n > m:  # the solver below needs rows <= columns; solve the transpose
        pairs = linear_sum_assignment([[cost[i][j] for i in range(n)] for j in range(m)])
        return sorted((i, j) for j, i in pairs)
    return _shortest_augmenting_path(cost, n, m)


def _shortest_augmenting_path(cost: list[list[float]], n: int, m: int) -> list[tuple[int, int]]:
    """Kuhn-Munkres with potentials (1-based arrays, column 0 a sentinel); n <= m.

    Adds rows one at a time; each addition grows a shortest augmenting path (Dijkstra on
    reduced costs kept non-negative by the potentials u, v), so the total is O(n^2 m).
    """
    u = [0.0] * (n + 1)  # row potentials
    v = [0.0] * (m + 1)  # column potentials
    row_of = [0] * (m + 1)  # row_of[j]: the row matched to column j (0 = none)
    way = [0] * (m + 1)  # previous column on the shortest path, to walk the augmentation back
    for i in range(1, n + 1):
        row_of[0] = i
        j0 = 0
        min_to = [_INF] * (m + 1)
        used = [False] * (m + 1)
        while True:
            used[j0] = True
            i0 = row_of[j0]
            delta, j1 = _INF, 0
            row = cost[i0 - 1]
            for j in range(1, m + 1):
                if used[j]:
                    continue
                reduced = row[j - 1] - u[i0] - v[j]
                if reduced < min_to[j]:
                    min_to[j], way[j] = reduced, j0
                if min_to[j] < delta:
                    delta, j1 = min_to[j], j
            for j in range(m + 1):
                if used[j]:
                    u[row_of[j]] += delta
                    v[j] -= delta
                else:
                    min_to[j] -= delta
            j0 = j1
            if row_of[j0] == 0:
                break
        while j0:  # flip the matched / unmatched edges along the path
            j1 = way[j0]
            row_of[j0] = row_of[j1]
            j0 = j1
    return sorted((row_of[j] - 1, j - 1) for j in range(1, m + 1) if row_of[j])
