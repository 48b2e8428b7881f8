"""SPEC.md's math in plain torch, the oracle the layer tests compare the package against: N(x)
with torch's own norms, and a vector's gamma from its parts. Nothing here imports
``megatron_scalevec``, so a change in the package cannot move the oracle with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def normalize(t: torch.Tensor, normalization: str, eps: float) -> torch.Tensor:
    """N over the last dim, no weight: ``RMSNorm`` or ``LayerNorm``."""
    if normalization == "RMSNorm":
        return F.rms_norm(t, (t.shape[-1],), eps=eps)
    return F.layer_norm(t, (t.shape[-1],), eps=eps)


def gamma(parts: dict) -> torch.Tensor:
    """gamma of one whole vector from its parameters by part name (SPEC.md): plain
    ``weight``; OR ``magnitude * sqrt(m) * direction / |direction|``; ER
    ``exp(alpha + logit - mean(logit))``."""
    if "weight" in parts:
        return parts["weight"]
    if "direction" in parts:
        u = parts["direction"]
        return parts["magnitude"] * u.numel() ** 0.5 * u / torch.linalg.vector_norm(u)
    v = parts["logit"]
    return torch.exp(parts["alpha"] + v - v.mean())
