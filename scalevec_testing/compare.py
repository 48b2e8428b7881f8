"""Small helpers the unit tests compare with: a difference relative to the reference's scale,
and seeded random tensors independent of the global RNG."""

from __future__ import annotations

import torch


def rel(a, b) -> float:
    """max |a - b| / max |b|; infinite where ``a`` is missing (no gradient where the reference
    has one)."""
    if a is None:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
