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
19k steps. :func:`invariant_magnitudes` names them; :func:`summary_line` says when epsilon
would start to matter for a run (trainer start-up summary).
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["invariant_magnitudes", "steps_until_epsilon", "summary_line"]

def _normalized_inputs(module):
    """(prefix, scale_in) of the projection all of whose outputs ``module`` normalizes (an
    attention's ``linear_qkv``, an MLP's or expert's ``linear_fc1``, or the shared expert
    vectors' own ``scale_in``), else None."""
    if hasattr(module, "v_norm"):  # attention; output-gate rows are not normalized
        if getattr(module.config, "attention_output_gate", False) or \
                any(getattr(module, f"{b}_norm") is None for b in "qkv"):
            return None
        return "linear_qkv.", getattr(module.linear_qkv, "scale_in", None)
    if getattr(module, "up_norm", None) is None:
        return None
    holder = getattr(module, "linear_fc1", module)
    scale_in = getattr(holder, "scale_in", None)
    if scale_in is not None and "gate" in scale_in and module.gate_norm is None:
        return None  # a gate branch left unnormalized
    return ("linear_fc1." if holder is not module else ""), scale_in


def invariant_magnitudes(model: nn.Module) -> list:
    """Names of the OR magnitudes / ER alphas of input-side vectors feeding a projection whose
    every output DNP normalizes (module doc); each parameter once, by its registered name."""
    registered = {name for name, _ in model.named_parameters()}
    names = set()
    for prefix, module in model.named_modules():
        found = _normalized_inputs(module)
        if found is None or not found[1]:
            continue
        base = f"{prefix}.{found[0]}" if prefix else found[0]
        for branch, vec in found[1].items():
            if vec.scheme is not None and vec.scheme.magnitude is not None:
                names.add(f"{base}scale_in.{branch}.{vec.scheme.magnitude}")
    return sorted(names & registered)


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
            f"projections DNP normalizes) get no gradient and decay with wd {wd:g}; the norm's "
            f"epsilon {eps:g} starts to matter {when}; this run's {train_iters:,} steps shrink "
            f"them to >= {shrink:.3g}x")
