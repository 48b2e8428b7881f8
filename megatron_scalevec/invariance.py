"""Scale-invariant magnitudes: input-side vectors whose overall scale the model cannot see.

Under DNP every output of ``linear_qkv`` (q, k, v: per-head norms) and of ``linear_fc1`` (gate
and up: FFN-width norms) is normalized. Scaling an input-side vector ``gamma`` of those
projections by ``c`` scales their outputs by ``c``, which the norm removes (up to its
epsilon). Under OR (``gamma = beta * sqrt(m) * u / |u|``) or ER (``exp(alpha + ...)``) that
scale is one parameter, ``beta`` or ``alpha``: it gets no gradient, while IWD, which decays
Input-Norm vectors, shrinks it every step (each parameterization names its magnitude part,
parameterizations.py), ``beta_t = beta_0 * prod(1 - lr_t * wd)``, about
``exp(-lr * wd * t)``. Harmless until ``beta^2 * mean(z^2)`` nears the norm's epsilon; with
projections of unit scale, ``beta ~ sqrt(eps)``: at lr 3e-3, wd 0.1 and eps 1e-5 after about
19k steps. That is the bound for decay alone: in practice Adam turns their rounding-level
gradient into full steps, and at 30 x the LR (the default vector multiplier) for 2.5 times that
horizon they stayed far from it (docs/RESULTS.md, "Default"). :func:`invariant_magnitudes`
names them; :func:`summary_line` says when epsilon would start to matter by decay alone
(trainer start-up summary).
"""

from __future__ import annotations

import math

from torch import nn

from megatron_scalevec.declared import declared

__all__ = ["invariant_magnitudes", "steps_until_epsilon", "summary_line"]


def invariant_magnitudes(model: nn.Module) -> list:
    """Names of the OR magnitudes / ER alphas of input-side vectors feeding a projection whose
    every output branch DNP normalizes (module doc), from what the modules declare
    (declared.py); each parameter once, by its registered name (its owner's)."""
    owner = {id(d.vector): d.name for d in declared(model, owned=True)}
    inputs: dict = {}  # id(projection) -> (projection, [input vectors])
    normalized: dict = {}  # id(projection) -> {branches whose rows a norm follows}
    for d in declared(model):
        if d.target is None:
            continue
        if d.side == "in":
            inputs.setdefault(id(d.target), (d.target, []))[1].append(d.vector)
        elif d.side == "norm":
            normalized.setdefault(id(d.target), set()).add(d.branch)
    names = set()
    for key, (projection, vectors) in inputs.items():
        if key not in normalized or not set(projection.slots) <= normalized[key]:
            continue  # a branch left unnormalized (an output gate; an ungated gate)
        for vec in vectors:
            magnitude = vec.scheme.magnitude if vec.scheme is not None else None
            if magnitude is not None and id(vec) in owner:
                names.add(f"{owner[id(vec)]}.{magnitude}")
    return sorted(names)


def steps_until_epsilon(lr: float, wd: float, eps: float) -> float:
    """Steps at a constant ``lr`` until ``exp(-lr * wd * t)`` reaches ``sqrt(eps)``."""
    if lr <= 0 or wd <= 0:
        return math.inf
    return 0.5 * math.log(1.0 / eps) / (lr * wd)


def summary_line(names: list, lr: float, wd: float, eps: float, train_iters: int) -> str:
    """One start-up line: how many such magnitudes, and when epsilon would matter."""
    if not names:
        return ""
    steps = steps_until_epsilon(lr, wd, eps)
    shrink = math.exp(-lr * wd * train_iters)
    when = "never (no decay)" if math.isinf(steps) else f"after ~{steps:,.0f} steps at lr {lr:g}"
    return (f"scale-invariant magnitudes: {len(names)} (OR/ER scales of input vectors whose "
            f"projections DNP normalizes) get no gradient and decay with wd {wd:g}; by decay "
            f"alone the norm's epsilon {eps:g} would start to matter {when}, and this run's "
            f"{train_iters:,} steps would shrink them to {shrink:.3g}x")
