"""The autograd composites that the fused functions replace, and :func:`reference`, which runs the
package on them: the tests compare the two, in outputs and every gradient.

Each composite is written in plain torch from ``norms.normalize`` (the one N(x), ops.py) and never
calls the fused code, so a fused function that drifts from the math fails against it:

* :func:`head_norm`, :func:`qkv_norm`: ``[R](a * N_head(x))`` (layers/fused.py);
* :func:`glu_norm`: ``act(a_g N(gate)) * a_u N(up)``, per-expert vectors by row (layers/glu.py);
* :func:`fold_weight` in :func:`linear_forward_impl`: the local linear's weight mode with
  ``W_eff = diag(a) W diag(gamma)`` built by autograd (which keeps ``W_eff``), in place of
  ``_FoldedLinear`` (layers/linear.py).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron_scalevec import sharding
from megatron_scalevec.layers import fused, glu, linear
from megatron_scalevec.norms import normalize


def _rope(y, cos, sin, interleaved: bool):
    """``y * cos + J y * sin`` on the first ``cos.shape[-1]`` entries (J: pairs (x1, x2) ->
    (-x2, x1), halves or adjacent entries); the rest passes through."""
    rot = cos.shape[-1]
    head, tail = y[..., :rot], y[..., rot:]
    if interleaved:
        pairs = head.unflatten(-1, (-1, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    else:
        x1, x2 = head.chunk(2, -1)
        turned = torch.cat((-x2, x1), -1)
    return torch.cat((head * cos + turned * sin, tail), -1)


def head_norm(x, a: Optional[torch.Tensor], eps: float, normalization: str, rope=None,
              interleaved: bool = False):
    y = normalize(x, normalization, eps)
    y = (y * a if a is not None else y).to(x.dtype)
    return y if rope is None else _rope(y, *rope, interleaved).to(x.dtype)


def qkv_norm(mixed, vectors, eps: float, normalization: str, qpg: int, rope_q=None,
             rope_k=None, interleaved: bool = False):
    """Split megatron-core's mixed QKV [..., groups, (qpg + 2) * hd], then three head norms."""
    q, k, v = (t.flatten(-3, -2)
               for t in mixed.unflatten(-1, (qpg + 2, -1)).split([qpg, 1, 1], dim=-2))
    return (head_norm(q, vectors[0], eps, normalization, rope_q, interleaved),
            head_norm(k, vectors[1], eps, normalization, rope_k, interleaved),
            head_norm(v, vectors[2], eps, normalization))


def glu_norm(z, a_g, a_u, act, *, gated: bool, normalization: str, eps: float, group=None,
             width: Optional[int] = None, experts=None):
    n = width or z.shape[-1] // (2 if gated else 1) * sharding.group_size(group)
    if experts is not None:  # each row its expert's vectors
        a_g, a_u = (None if a is None else a[experts.ids] for a in (a_g, a_u))
    gate, up = z.chunk(2, dim=-1) if gated else (None, z)
    nu = (normalize(up, normalization, eps, group, n) * a_u).to(z.dtype)
    if not gated:
        return act(nu)
    return act((normalize(gate, normalization, eps, group, n) * a_g).to(z.dtype)) * nu


def fold_weight(weight, row, col, layout: tuple):
    """``diag(a) W diag(gamma)`` per slot; ``row`` [S, r], ``col`` [S, in], either None;
    ``layout`` = (groups, slots, r). The scale in float32, cast to the weight's dtype."""
    if row is None and col is None:
        return weight
    scale = (1 if row is None else row[..., None]) * (1 if col is None else col[:, None, :])
    return (weight.view(*layout, -1) * scale.to(weight.dtype)).view_as(weight)


def linear_forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                        allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                        wgrad_deferral_limit=None, tp_group=None, **kwargs):
    """``ScaleVecColumnParallelLinear._forward_impl`` with the weight folded by autograd."""
    if self.has_scale_vectors and self.scalevec_mode == "weight":
        if grad_output_buffer is not None:
            raise NotImplementedError("deferred wgrad compute with folded scale vectors")
        weight = fold_weight(weight, *self.fold_vectors(), self.fold_layout)
        gradient_accumulation_fusion, wgrad_deferral_limit = False, None
    return super(linear.ScaleVecColumnParallelLinear, self)._forward_impl(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit, tp_group=tp_group, **kwargs)


SWAPS = ((fused, "head_norm", head_norm), (fused, "qkv_norm", qkv_norm),
         (glu, "glu_norm", glu_norm),
         (linear.ScaleVecColumnParallelLinear, "_forward_impl", linear_forward_impl))


@contextlib.contextmanager
def reference():
    """The package's fused entry points (:data:`SWAPS`: the attributes its call sites read)
    replaced by the composites above for the duration, restored after."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in SWAPS]
    try:
        for owner, name, ref in SWAPS:
            setattr(owner, name, ref)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
