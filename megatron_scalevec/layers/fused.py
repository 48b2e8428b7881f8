"""Lean fused DNP: the output-side norms fused with what follows them, keeping for backward
no full-size tensor that the stock layer does not keep already.

* ``head_norm``: ``R(a * N_head(x))`` for q and k (``R`` = RoPE), ``a * N_head(x)`` for v. It
  keeps only its output (which attention keeps anyway) and a per-row ``1/rms``; backward undoes
  the rotation (RoPE is orthogonal up to its scale, so ``R^-1 = R^T / (cos^2 + sin^2)``) and
  the scale (``N(x) = y / a``; ``a`` must have no zero entry, a zero shows as NaN gradients).
* ``glu_norm`` (layers/glu.py): the FFN-width norms of gate and up fused with the GLU, on the
  same machinery.

The element-wise bodies are plain tensor functions, compiled or not by compile.py (the
one place that applies ``torch.compile``). The tests compare these functions with the autograd
composites they replace (scalevec_testing/reference.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_scalevec import compile, ops

# ---------------------------------------------------------------- RoPE pieces (last dim)

def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """J x: pairs (x1, x2) -> (-x2, x1); halves, or adjacent entries when interleaved."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.view(*x.shape[:-1], -1, 2)
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def _rope(y, cos, sin, interleaved: bool, transpose: bool = False):
    """R y (or R^T y) on the first ``cos.shape[-1]`` entries; the rest passes through."""
    rot = cos.shape[-1]
    head, tail = y[..., :rot], y[..., rot:]
    turned = _rotate_half(head, interleaved) * sin
    head = head * cos - turned if transpose else head * cos + turned
    return torch.cat((head, tail), dim=-1) if tail.shape[-1] else head


def _unrope(y, cos, sin, interleaved: bool):
    """R^-1 y = R^T y / (cos^2 + sin^2) (cos, sin are equal within each rotated pair)."""
    rot = cos.shape[-1]
    back = _rope(y, cos, sin, interleaved, transpose=True)
    head = back[..., :rot] / (cos * cos + sin * sin)
    tail = back[..., rot:]
    return torch.cat((head, tail), dim=-1) if tail.shape[-1] else head


# ---------------------------------------------------------------- per-head norm (+ RoPE)

def _head_fwd(x, a, cos, sin, eps: float, layer: bool, interleaved: bool):
    mean, rstd = ops.row_stats([x], layer, eps, x.shape[-1])
    y = ops.scale_free(x, mean, rstd)
    if a is not None:
        y = y * a
    if cos is not None:
        y = _rope(y, cos, sin, interleaved)
    return y.to(x.dtype), rstd


def _head_bwd(dy, out, rstd, a, cos, sin, layer: bool, interleaved: bool):
    dy, y = dy.float(), out.float()
    if cos is not None:
        dy = _rope(dy, cos, sin, interleaved, transpose=True)  # grad wrt the unrotated output
        y = _unrope(y, cos, sin, interleaved)
    xhat = y / a if a is not None else y
    g = dy * a if a is not None else dy
    da = (dy * xhat).flatten(0, -2).sum(0) if a is not None else None
    mean_g = g.mean(-1, keepdim=True) if layer else None
    return ops.scale_free_grad(g, xhat, rstd, (g * xhat).mean(-1, keepdim=True), mean_g), da


class _HeadNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, cos, sin, eps, layer, interleaved):
        out, rstd = compile.kernel(_head_fwd)(x, a, cos, sin, eps, layer, interleaved)
        ctx.save_for_backward(out, rstd, a, cos, sin)
        ctx.layer, ctx.interleaved = layer, interleaved
        return out

    @staticmethod
    def backward(ctx, dy):
        out, rstd, a, cos, sin = ctx.saved_tensors
        kernel = compile.kernel(_head_bwd)
        dx, da = kernel(dy, out, rstd, a, cos, sin, ctx.layer, ctx.interleaved)
        return dx.to(out.dtype), da, None, None, None, None, None


def rope_cos_sin(freqs: torch.Tensor, mscale: float, dtype):
    """cos/sin of megatron-core's rotary frequencies, as its unfused RoPE builds them."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def head_norm(x, a: Optional[torch.Tensor], eps: float, normalization: str, rope=None,
              interleaved: bool = False):
    """``[R](a * N_head(x))`` over the last dim; ``rope`` = (cos, sin) from rope_cos_sin."""
    layer = ops.is_layer_norm(normalization)
    cos, sin = rope if rope is not None else (None, None)
    return _HeadNorm.apply(x, a, cos, sin, eps, layer, interleaved)


def _slots(x, qpg: int):
    """q, k, v of megatron-core's mixed QKV [..., groups, (qpg + 2) * hd] as
    [..., groups, qpg | 1 | 1, hd] views."""
    x = x.view(*x.shape[:-1], qpg + 2, -1)
    return x[..., :qpg, :], x[..., qpg:qpg + 1, :], x[..., qpg + 1:, :]


def _qkv_fwd(mixed, a_q, a_k, a_v, rope_q, rope_k, eps: float, layer: bool, interleaved: bool,
             qpg: int):
    """The three per-head norms (q and k with RoPE) on the mixed QKV, in one function."""
    q, k, v = _slots(mixed, qpg)
    (q, rq), (k, rk) = (_head_fwd(t, a, *_per_slot(r), eps, layer, interleaved)
                        for t, a, r in ((q, a_q, rope_q), (k, a_k, rope_k)))
    v, rv = _head_fwd(v, a_v, None, None, eps, layer, interleaved)
    return q.flatten(-3, -2), k.flatten(-3, -2), v.flatten(-3, -2), rq, rk, rv


def _qkv_bwd(dq, dk, dv, q, k, v, rq, rk, rv, a_q, a_k, a_v, rope_q, rope_k, layer: bool,
             interleaved: bool, qpg: int):
    """_head_bwd of each slot, written back into the mixed QKV layout in one pass."""
    parts = []
    for dy, y, r, a, rope, n in ((dq, q, rq, a_q, rope_q, qpg), (dk, k, rk, a_k, rope_k, 1),
                                 (dv, v, rv, a_v, None, 1)):
        dy, y = (t.reshape(*t.shape[:-2], -1, n, t.shape[-1]) for t in (dy, y))
        parts.append(_head_bwd(dy, y, r, a, *_per_slot(rope), layer, interleaved))
    dx = torch.cat([d for d, _ in parts], dim=-2).flatten(-2).to(dq.dtype)
    return (dx, *(da for _, da in parts))


def _per_slot(rope):
    """(cos, sin) [s, 1, 1, rot] broadcast over [s, b, groups, slot, hd]; (None, None)."""
    return (None, None) if rope is None else tuple(t.unsqueeze(-2) for t in rope)


class _QKVNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, a_q, a_k, a_v, rope_q, rope_k, eps, layer, interleaved, qpg):
        kernel = compile.kernel(_qkv_fwd)
        q, k, v, rq, rk, rv = kernel(mixed, a_q, a_k, a_v, rope_q, rope_k, eps, layer,
                                     interleaved, qpg)
        ctx.save_for_backward(q, k, v, rq, rk, rv, a_q, a_k, a_v,
                              *(rope_q or (None, None)), *(rope_k or (None, None)))
        ctx.layer, ctx.interleaved, ctx.qpg = layer, interleaved, qpg
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        *saved, cq, sq, ck, sk = ctx.saved_tensors
        rope_q = None if cq is None else (cq, sq)
        rope_k = None if ck is None else (ck, sk)
        kernel = compile.kernel(_qkv_bwd)
        dx, daq, dak, dav = kernel(dq, dk, dv, *saved, rope_q, rope_k, ctx.layer,
                                   ctx.interleaved, ctx.qpg)
        return dx, daq, dak, dav, None, None, None, None, None, None


def qkv_norm(mixed, vectors, eps: float, normalization: str, qpg: int, rope_q=None,
             rope_k=None, interleaved: bool = False):
    """megatron-core's mixed QKV ``[s, b, groups, (qpg + 2) * hd]`` -> q ``[s, b, groups * qpg,
    hd]``, k, v ``[s, b, groups, hd]``, each ``[R](a * N_head(.))`` (``vectors`` = (a_q, a_k,
    a_v)): one function for the three, with no split copy, as head_norm keeps only its
    outputs and per-row 1/rms."""
    layer = ops.is_layer_norm(normalization)
    return _QKVNorm.apply(mixed, *vectors, rope_q, rope_k, eps, layer, interleaved, qpg)

