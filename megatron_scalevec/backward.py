"""An identity whose backward does one thing to the gradient: the one such autograd Function.

Several places need work done at a point of the backward pass and nothing in the forward: sum
a partial gradient over a group (sharding.py ``reduce_grad``), refold a released weight before
its GEMM's backward (layers/fold.py), enrol a step's close (vectors.py), make a gradient
contiguous for ``grouped_mm`` (layers/grouped.py). Each is :func:`on_backward` with its own
small function, written beside its caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _OnBackward(torch.autograd.Function):
    """``x`` unchanged (a view, so autograd gets a node); backward returns ``fn(grad)``."""

    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


def on_backward(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x``; in the backward, the gradient reaching it becomes ``fn(gradient)``."""
    return _OnBackward.apply(x, fn)
