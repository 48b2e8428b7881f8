"""The scale-free normalization N(x), written once: its statistics, its value, its gradient.

``N(x) = (x - mean(x)) / sqrt(var(x) + eps)`` over the last dim (LayerNorm), or
``x / sqrt(mean(x^2) + eps)`` (RMSNorm), in float32. Every path builds on these three pieces:
the Pre-Norm and final norm (norms.py), the per-head DNP norms with RoPE (layers/fused.py), the
FFN-width DNP norms fused with the GLU (layers/glu.py), and :func:`normalize`, the autograd
composite the tests compare them with. A width split over ranks (DNP over a tensor-parallel FFN)
passes ``reduce``, which sums a partial row statistic over those ranks, so the result equals
the unsplit one. Pure tensor math (``reduce`` aside): safe inside ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch

NORMALIZATIONS = ("RMSNorm", "LayerNorm")


def is_layer_norm(normalization: str) -> bool:
    """True for LayerNorm, False for RMSNorm; one clear error for anything else."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"scale-vector norms support normalization RMSNorm or LayerNorm, "
                         f"got {normalization!r}")
    return normalization == "LayerNorm"


def _row_sums(ts) -> torch.Tensor:
    return torch.cat([t.sum(-1, keepdim=True) for t in ts], -1)


def row_stats(parts: Sequence[torch.Tensor], layer: bool, eps: float, n: int,
              reduce: Optional[Callable] = None) -> tuple:
    """Per row of each part: (mean [..., P] for LayerNorm else None, 1/sqrt(var + eps)
    [..., P]), float32, over a logical width ``n`` (the last dim times the ranks of a split).
    Several parts (a GLU's gate and up) share one ``reduce`` per statistic."""
    xs = [p.float() for p in parts]
    mean = None
    if layer:
        sums = _row_sums(xs)
        mean = (reduce(sums) if reduce is not None else sums) / n
        xs = [x - mean[..., i:i + 1] for i, x in enumerate(xs)]
    squares = _row_sums([x * x for x in xs])
    var = (reduce(squares) if reduce is not None else squares) / n
    return mean, torch.rsqrt(var + eps)


def scale_free(x: torch.Tensor, mean: Optional[torch.Tensor], rstd: torch.Tensor,
               i: int = 0) -> torch.Tensor:
    """N(x) in float32 from part ``i``'s statistics (:func:`row_stats`)."""
    x = x.float()
    if mean is not None:
        x = x - mean[..., i:i + 1]
    return x * rstd[..., i:i + 1]


def scale_free_grad(g: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor,
                    dot: torch.Tensor, mean_g: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dL/dx through N from ``g`` = dL/dN(x): ``rstd * (g - xhat * dot - mean_g)``, with
    ``dot`` the row mean of ``g * xhat`` and ``mean_g`` the row mean of ``g`` (LayerNorm only),
    both over the logical width (reduced over a split's ranks by the caller)."""
    d = g - xhat * dot
    if mean_g is not None:
        d = d - mean_g
    return d * rstd


def normalize(x: torch.Tensor, normalization: str, eps: float, n: Optional[int] = None,
              reduce: Optional[Callable] = None) -> torch.Tensor:
    """N(x) over the last dim as a plain autograd composite, in float32: the reference the
    fused paths are tested against. ``reduce`` must then be differentiable
    (``sharding.all_reduce_sum``)."""
    mean, rstd = row_stats([x], is_layer_norm(normalization), eps, n or x.shape[-1], reduce)
    return scale_free(x, mean, rstd)
