"""Lean fused DNP: the output-side norms fused with what follows them, keeping for backward
no full-size tensor that the stock layer does not keep already.

* ``head_norm``: ``R(a * N_head(x))`` for q and k (``R`` = RoPE), ``a * N_head(x)`` for v. It
  keeps only its output (which attention keeps anyway) and a per-row ``1/rms``; backward undoes
  the rotation (RoPE is orthogonal up to its scale, so ``R^-1 = R^T / (cos^2 + sin^2)``) and
  the scale (``N(x) = y / a``; ``a`` must have no zero entry, a zero shows as NaN gradients).
* ``glu_norm`` (layers/glu.py): the FFN-width norms of gate and up fused with the GLU, on the
  same machinery.

The element-wise bodies are plain tensor functions, run eagerly or through ``torch.compile``,
one compiled function per kernel body (``set_compile``, or ``MEGATRON_SCALEVEC_FUSED_COMPILE``
in the environment: the one switch). ``auto`` compiles on CPU and CUDA: the benchmark measured
it faster on both (eager unified +15% step time vs ``shared`` on CPU, compiled +5%). The tests
set ``off`` (compiling every shape of every test costs more than the tests). Where inductor
cannot compile (no C++ compiler), ``auto`` falls back to eager once, with one warning.
``reference()`` switches every call to the autograd composite it replaces: the tests compare
the two.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional

import torch

from megatron_scalevec import ops
from megatron_scalevec.norms import normalize

_ENV = "MEGATRON_SCALEVEC_FUSED_COMPILE"
_STATE = {"compile": os.environ.get(_ENV, "auto"), "reference": False, "broken": False}
_COMPILED: dict = {}


def set_compile(mode: str) -> None:
    """``auto`` (compiled; eager once compiling has failed), ``on`` or ``off``."""
    _check_mode(mode, "fused compile mode")
    _STATE["compile"] = mode


def _check_mode(mode: str, what: str) -> None:
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{what} must be auto, on or off, got {mode!r}")


def compile_mode() -> str:
    return _STATE["compile"]


@contextlib.contextmanager
def reference():
    """Run the unfused autograd composites instead of the fused functions (tests)."""
    saved = _STATE["reference"]
    _STATE["reference"] = True
    try:
        yield
    finally:
        _STATE["reference"] = saved


def use_reference() -> bool:
    return _STATE["reference"]


def _kernel(fn, dynamic: Optional[bool] = None):
    """``fn`` through ``torch.compile`` (or not) as set_compile says; ``dynamic=False`` for
    functions whose shapes are the weights' (a few per model), never a token count."""
    mode = _STATE["compile"]
    _check_mode(mode, f"{_ENV} / fused compile mode")
    if mode == "off" or (mode == "auto" and _STATE["broken"]):
        return fn
    key = (fn, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = _guarded(fn, torch.compile(fn, dynamic=dynamic))
    return _COMPILED[key]


def _guarded(fn, compiled):
    """``compiled``, or under ``auto`` the eager ``fn`` for good once compiling has failed."""

    def call(*args):
        if _STATE["broken"] and _STATE["compile"] == "auto":
            return fn(*args)
        try:
            return compiled(*args)
        except Exception as err:  # inductor raises many types (no compiler, unsupported op)
            if _STATE["compile"] != "auto" or not _is_compile_error(err):
                raise
            _STATE["broken"] = True
            warnings.warn(f"torch.compile of the fused DNP kernels failed ({type(err).__name__});"
                          f" running them eagerly (set {_ENV}=off to skip compiling)",
                          stacklevel=2)
            return fn(*args)

    return call


def _is_compile_error(err: Exception) -> bool:
    mod = type(err).__module__ or ""
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor")


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
        out, rstd = _kernel(_head_fwd)(x, a, cos, sin, eps, layer, interleaved)
        ctx.save_for_backward(out, rstd, a, cos, sin)
        ctx.layer, ctx.interleaved = layer, interleaved
        return out

    @staticmethod
    def backward(ctx, dy):
        out, rstd, a, cos, sin = ctx.saved_tensors
        dx, da = _kernel(_head_bwd)(dy, out, rstd, a, cos, sin, ctx.layer, ctx.interleaved)
        return dx.to(out.dtype), da, None, None, None, None, None


def rope_cos_sin(freqs: torch.Tensor, mscale: float, dtype):
    """cos/sin of megatron-core's rotary frequencies, as its unfused RoPE builds them."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def head_norm(x, a: Optional[torch.Tensor], eps: float, normalization: str, rope=None,
              interleaved: bool = False):
    """``[R](a * N_head(x))`` over the last dim; ``rope`` = (cos, sin) from rope_cos_sin."""
    layer = ops.is_layer_norm(normalization)
    cos, sin = rope if rope is not None else (None, None)
    if use_reference():
        y = _norm_reference(x, layer, eps, None, x.shape[-1])
        y = (y * a if a is not None else y).to(x.dtype)
        if cos is None:
            return y
        return _rope(y, cos, sin, interleaved).to(x.dtype)
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
        kernel = _kernel(_qkv_fwd)
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
        kernel = _kernel(_qkv_bwd)
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
    if use_reference():
        q, k, v = (t.flatten(-3, -2) for t in _slots(mixed, qpg))
        return (head_norm(q, vectors[0], eps, normalization, rope_q, interleaved),
                head_norm(k, vectors[1], eps, normalization, rope_k, interleaved),
                head_norm(v, vectors[2], eps, normalization))
    return _QKVNorm.apply(mixed, *vectors, rope_q, rope_k, eps, layer, interleaved, qpg)


# ---------------------------------------------------------------- shared helpers

def _norm_reference(x, layer: bool, eps: float, group, n: int):
    """The autograd composite N(x) the fused functions replace (float32, norms.normalize)."""
    return normalize(x, "LayerNorm" if layer else "RMSNorm", eps, group, n)
