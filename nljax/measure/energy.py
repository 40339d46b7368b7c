"""Energy distance between two samples, as the U-statistic (no i = i' or j = j' terms):

    E = 2 mean_{i,j} |x_i - y_j| - mean_{i != i'} |x_i - x_i'| - mean_{j != j'} |y_j - y_j'|

Zero in expectation when x and y come from the same distribution (unbiased), positive
otherwise. Computed on the host in float64, in row blocks so memory stays O(block x n).
"""

from __future__ import annotations

import numpy as np


def _distance_sum(a: np.ndarray, b: np.ndarray, same: bool, block: int = 1024) -> float:
    """Sum of |a_i - b_j| over all pairs (over i != j when `same`, a and b then being one set)."""
    b_sq = np.sum(b * b, axis=1)
    total = 0.0
    for s in range(0, len(a), block):
        blk = a[s : s + block]
        d2 = np.sum(blk * blk, axis=1)[:, None] + b_sq[None] - 2.0 * blk @ b.T  # [block, n_b]
        d = np.sqrt(np.maximum(d2, 0.0))
        if same:
            d[np.arange(len(blk)), s + np.arange(len(blk))] = 0.0  # exactly: no diagonal terms
        total += float(d.sum())
    return total


def energy_distance(x: np.ndarray, y: np.ndarray) -> float:
    """U-statistic energy distance between samples x [n, ...] and y [m, ...] (n, m >= 2)."""
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    n, m = len(x), len(y)
    if n < 2 or m < 2:
        raise ValueError(f"energy distance needs at least 2 samples on each side, got {n} and {m}")
    xy = _distance_sum(x, y, False) / (n * m)
    xx = _distance_sum(x, x, True) / (n * (n - 1))
    yy = _distance_sum(y, y, True) / (m * (m - 1))
    return 2.0 * xy - xx - yy
