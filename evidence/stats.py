"""Small statistics for paired-seed comparisons (no SciPy): mean, sample std, Student-t
intervals and the number of seeds a measured spread needs to resolve an effect."""

from __future__ import annotations

import math

# two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30; beyond that the normal 1.96 + tail
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.96 + 2.4 / df  # within 0.003 of the exact quantile for df > 30


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def std(xs) -> float:
    """Sample standard deviation (n - 1); nan for fewer than two values."""
    xs = list(xs)
    if len(xs) < 2:
        return math.nan
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def t_interval(xs) -> tuple:
    """(mean, half-width of the 95% t-interval); half-width nan for one value."""
    xs = list(xs)
    n = len(xs)
    return mean(xs), t975(n - 1) * std(xs) / math.sqrt(n) if n > 1 else math.nan


def seeds_needed(effect: float, sd: float, max_n: int = 100000) -> float:
    """Smallest n with t_{0.975,n-1} * sd / sqrt(n) < |effect|: how many paired seeds would
    make a 95% interval of the paired difference exclude zero if the measured mean and spread
    held. nan when either is unknown, inf when it needs more than ``max_n``."""
    if not (math.isfinite(effect) and math.isfinite(sd)) or effect == 0:
        return math.nan
    if sd == 0:
        return 2
    n = max(2, math.ceil((1.96 * sd / abs(effect)) ** 2))
    while n <= max_n:
        if t975(n - 1) * sd / math.sqrt(n) < abs(effect):
            return n
        n += 1
    return math.inf
