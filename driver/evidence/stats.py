"""Small statistics over per-sample values: a least-squares slope, Spearman's rank correlation, a paired 95 %
interval (Student's t), each a plain function over numbers (numpy only: the runtime does not depend on scipy)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

LEVEL = 0.95  # every interval of the report


def finite(x) -> bool:
    """A real, finite number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sigmoid(d: float) -> float:
    """1 / (1 + e^-d), without overflow for large |d|."""
    if d >= 0:
        return 1.0 / (1.0 + math.exp(-d))
    e = math.exp(d)
    return e / (1.0 + e)


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and its standard error (sample standard deviation / sqrt(n); None for one value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), (float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else None)


def slope(x: Sequence[float], y: Sequence[float]) -> float:
    """The least-squares slope of y against x (numpy.polyfit(x, y, 1)[0]); NaN when x does not vary."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx = x - x.mean()
    spread = float(dx @ dx)
    return float(dx @ (y - y.mean())) / spread if spread > 0 else math.nan


def ranks(values: Sequence[float]) -> np.ndarray:
    """1-based ranks, ties sharing their mean rank (as scipy.stats.rankdata)."""
    a = np.asarray(values, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    out = np.empty(len(a))
    sorted_a = a[order]
    start = 0
    for end in range(1, len(a) + 1):
        if end == len(a) or sorted_a[end] != sorted_a[start]:
            out[order[start:end]] = (start + end + 1) / 2
            start = end
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks); NaN when either side is constant."""
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    norm = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / norm if norm > 0 else math.nan


def _two_sided(t: float, df: int) -> float:
    """P(|T| < t) for Student's T with `df` degrees of freedom (Abramowitz & Stegun 26.7.3-4, exact for whole df)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:
        term, total = math.cos(theta), 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c2 * (2 * k) / (2 * k + 1)
        return (2 / math.pi) * (theta + s * total) if df > 1 else 2 * theta / math.pi
    term, total = 1.0, 0.0
    for k in range(1, df // 2 + 1):
        total += term
        term *= c2 * (2 * k - 1) / (2 * k)
    return s * total


@functools.lru_cache(maxsize=256)
def t_critical(df: int, level: float = LEVEL) -> float:
    """The two-sided critical value of Student's t (scipy.stats.t.ppf((1 + level) / 2, df)), by bisection on the
    exact distribution; above 2000 degrees of freedom the normal's with Cornish-Fisher's first terms."""
    if df > 2000:
        z = _normal_quantile((1 + level) / 2)
        return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    lo, hi = 0.0, 1.0
    while _two_sided(hi, df) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _two_sided(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def _normal_quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(-mid / math.sqrt(2)) < p else (lo, mid)
    return (lo + hi) / 2


def paired(after: Sequence[float], before: Sequence[float], level: float = LEVEL) -> dict | None:
    """The change `after - before` over paired samples: {mean, stderr, low, high, n} (a paired t interval at
    `level`); None with fewer than 2 pairs. Identical pairs give a zero-width interval at the mean."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    if len(d) < 2:
        return None
    mean, stderr = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    half = t_critical(len(d) - 1, level) * stderr
    return {"mean": mean, "stderr": stderr, "low": mean - half, "high": mean + half, "n": len(d)}


def excludes_zero(interval: dict | None) -> bool:
    """Whether a change's interval lies wholly on one side of 0 (a change beyond noise)."""
    return interval is not None and (interval["low"] > 0 or interval["high"] < 0)
