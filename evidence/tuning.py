"""Learning-rate tuning for fair comparisons: a log-spaced grid per strategy, the best LR (flagged
when it sits on the grid's edge, where the true optimum may lie outside), the strongest of
several baselines, and how many paired seeds an effect of a given size needs.

A strategy compared at someone else's learning rate measures the LR as much as the strategy, so
every comparison here is at each strategy's own best LR. The LR floor scales with the peak
(``min_lr = ratio * lr``): a fixed floor would make a low-LR run decay relatively less than a
high-LR one. Tuning seeds and comparison seeds are disjoint, so the comparison is not biased by
having picked the LR on the same noise (the winner's curse).
"""

from __future__ import annotations

import math

from evidence import stats

TUNE_SEED0 = 1000  # tuning seeds are TUNE_SEED0 + 1.., comparison seeds 1..


def lr_grid(center: float, points: int, factor: float = 2.0) -> list:
    """``points`` learning rates ``center * factor**k``, log-spaced and centred (an even count
    puts one more point above the centre)."""
    if points < 1 or factor <= 1 or center <= 0:
        raise ValueError(f"LR grid needs points >= 1, factor > 1, centre > 0 (got {points}, "
                         f"{factor}, {center})")
    lo = -((points - 1) // 2)
    return [_round(center * factor ** k) for k in range(lo, lo + points)]


def _round(x: float) -> float:
    return float(f"{x:.4g}")  # stable run keys: 3e-3 * 2 ** -1 -> 0.0015, not 0.0015000000001


def extend(grid: list, edge: str, factor: float = 2.0) -> list:
    """The grid with one more point beyond ``edge`` ('low' or 'high')."""
    g = sorted(grid)
    return sorted(g + [_round(g[0] / factor if edge == "low" else g[-1] * factor)])


def best_lr(losses: dict) -> tuple:
    """{lr: [final val losses over tuning seeds]} -> (best lr, edge): edge is '' (interior),
    'low' or 'high' (the best is the smallest / largest LR tried), 'only' for a single LR.
    Non-finite losses (a diverged run) lose to any finite one; ties go to the smaller LR."""
    if not losses:
        raise ValueError("no tuning runs to pick a learning rate from")
    lrs = sorted(losses)

    def score(lr):
        m = stats.mean(losses[lr])
        return m if math.isfinite(m) else math.inf

    best = min(lrs, key=lambda lr: (score(lr), lr))
    if len(lrs) == 1:
        return best, "only"
    return best, "low" if best == lrs[0] else "high" if best == lrs[-1] else ""


def strongest(means: dict) -> str:
    """The baseline with the lowest mean final validation loss: {name: mean} -> name."""
    finite = {k: v for k, v in means.items() if math.isfinite(v)}
    if not finite:
        raise ValueError("no baseline has a finished comparison run")
    return min(finite, key=lambda k: (finite[k], k))


def seeds_for_effects(paired_sd: float, effects=(0.02, 0.03)) -> dict:
    """{effect: paired seeds needed} for a 95% t-interval of half-width below each effect, given
    the measured standard deviation of the per-seed paired difference (nan if unknown)."""
    return {e: stats.seeds_needed(e, paired_sd) for e in effects}


def edge_note(edge: str) -> str:
    return {"low": "best at the grid's low edge", "high": "best at the grid's high edge",
            "only": "one LR only (not tuned)"}.get(edge, "")
