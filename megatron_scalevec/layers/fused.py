"""Lean fused DNP: the output-side norms fused with what follows them, keeping for backward
no full-size tensor that the stock layer does not keep already.

* ``head_norm``: ``R(a * N_head(x))`` for q and k (``R`` = RoPE), ``a * N_head(x)`` for v. It
  keeps only its output (which attention keeps anyway) and a per-row ``1/rms``; backward undoes
  the rotation (RoPE is orthogonal up to its scale, so ``R^-1 = R^T / (cos^2 + sin^2)``) and
  the scale (``N(x) = y / a``; ``a`` must have no zero entry, a zero shows as NaN gradients).
* ``glu_norm``: ``act(a_g * N(gate)) * (a_u * N(up))`` in one pass over fc1's output, keeping
  only that output (what megatron-core's fused GLU keeps) and two per-row ``1/rms``. ``N`` runs
  over the whole FFN width: when it is split over a tensor-parallel group, the row statistics
  of forward and backward are all-reduced.

The element-wise bodies are plain tensor functions, run eagerly or through ``torch.compile``
(``set_compile``, or ``MEGATRON_SCALEVEC_FUSED_COMPILE`` in the environment). ``auto`` compiles
on CPU and CUDA: the benchmark measured it faster on both (eager unified +15% step time vs
``shared`` on CPU, compiled +5%). The tests set ``off`` (compiling every shape of every test
costs more than the tests). Where inductor cannot compile (no C++ compiler), ``auto`` falls back
to eager once, with one warning. ``reference()`` switches every call to the autograd composite
it replaces: the tests compare the two.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_scalevec import sharding

_ENV = "MEGATRON_SCALEVEC_FUSED_COMPILE"
_STATE = {"compile": os.environ.get(_ENV, "auto"), "reference": False, "broken": False}
_COMPILED: dict = {}


def set_compile(mode: str) -> None:
    """``auto`` (compiled on CUDA tensors), ``on`` or ``off``."""
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


def _kernel(fn, x: torch.Tensor):
    mode = _STATE["compile"]
    _check_mode(mode, f"{_ENV} / fused compile mode")
    if mode == "off" or (mode == "auto" and _STATE["broken"]):
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = _guarded(fn, torch.compile(fn, dynamic=None))
    return _COMPILED[fn]


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
    pairs = x.unflatten(-1, (-1, 2))
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
    xf = x.float()
    if layer:
        xf = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = xf * rstd
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
    dx = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if layer:
        dx = dx - g.mean(-1, keepdim=True)
    return dx * rstd, da


class _HeadNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, cos, sin, eps, layer, interleaved):
        out, rstd = _kernel(_head_fwd, x)(x, a, cos, sin, eps, layer, interleaved)
        ctx.save_for_backward(out, rstd, a, cos, sin)
        ctx.layer, ctx.interleaved = layer, interleaved
        return out

    @staticmethod
    def backward(ctx, dy):
        out, rstd, a, cos, sin = ctx.saved_tensors
        dx, da = _kernel(_head_bwd, dy)(dy, out, rstd, a, cos, sin, ctx.layer, ctx.interleaved)
        return dx.to(out.dtype), da, None, None, None, None, None


def rope_cos_sin(freqs: torch.Tensor, mscale: float, dtype):
    """cos/sin of megatron-core's rotary frequencies, as its unfused RoPE builds them."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def head_norm(x, a: Optional[torch.Tensor], eps: float, normalization: str, rope=None,
              interleaved: bool = False):
    """``[R](a * N_head(x))`` over the last dim; ``rope`` = (cos, sin) from rope_cos_sin."""
    layer = _layer_norm(normalization)
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
    x = x.unflatten(-1, (qpg + 2, -1))
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
        dy, y = dy.unflatten(-2, (-1, n)), y.unflatten(-2, (-1, n))
        parts.append(_head_bwd(dy, y, r, a, *_per_slot(rope), layer, interleaved))
    dx = torch.cat([d for d, _ in parts], dim=-2).flatten(-2).to(dq.dtype)
    return (dx, *(da for _, da in parts))


def _per_slot(rope):
    """(cos, sin) [s, 1, 1, rot] broadcast over [s, b, groups, slot, hd]; (None, None)."""
    return (None, None) if rope is None else tuple(t.unsqueeze(-2) for t in rope)


class _QKVNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, a_q, a_k, a_v, rope_q, rope_k, eps, layer, interleaved, qpg):
        q, k, v, rq, rk, rv = _kernel(_qkv_fwd, mixed)(mixed, a_q, a_k, a_v, rope_q, rope_k,
                                                       eps, layer, interleaved, qpg)
        ctx.save_for_backward(q, k, v, rq, rk, rv, a_q, a_k, a_v,
                              *(rope_q or (None, None)), *(rope_k or (None, None)))
        ctx.layer, ctx.interleaved, ctx.qpg = layer, interleaved, qpg
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        *saved, cq, sq, ck, sk = ctx.saved_tensors
        rope_q = None if cq is None else (cq, sq)
        rope_k = None if ck is None else (ck, sk)
        dx, daq, dak, dav = _kernel(_qkv_bwd, dq)(dq, dk, dv, *saved, rope_q, rope_k,
                                                  ctx.layer, ctx.interleaved, ctx.qpg)
        return dx, daq, dak, dav, None, None, None, None, None, None


def qkv_norm(mixed, vectors, eps: float, normalization: str, qpg: int, rope_q=None,
             rope_k=None, interleaved: bool = False):
    """megatron-core's mixed QKV ``[s, b, groups, (qpg + 2) * hd]`` -> q ``[s, b, groups * qpg,
    hd]``, k, v ``[s, b, groups, hd]``, each ``[R](a * N_head(.))`` (``vectors`` = (a_q, a_k,
    a_v)): one function for the three, with no split copy, as head_norm keeps only its
    outputs and per-row 1/rms."""
    layer = _layer_norm(normalization)
    if use_reference():
        q, k, v = (t.flatten(-3, -2) for t in _slots(mixed, qpg))
        return (head_norm(q, vectors[0], eps, normalization, rope_q, interleaved),
                head_norm(k, vectors[1], eps, normalization, rope_k, interleaved),
                head_norm(v, vectors[2], eps, normalization))
    return _QKVNorm.apply(mixed, *vectors, rope_q, rope_k, eps, layer, interleaved, qpg)


# ---------------------------------------------------------------- GLU with FFN-width norms

def _act_and_grad(act, x):
    """act(x) and act'(x) for the activations megatron-core's GLUs use; None otherwise."""
    if act is F.silu:
        s = torch.sigmoid(x)
        return x * s, s * (1 + x * (1 - s))
    if act is F.gelu:
        cdf = 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2))))
        return x * cdf, cdf + x * torch.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    if act is F.relu:
        return F.relu(x), (x > 0).to(x.dtype)
    return None


def _act_eager(act, x):
    """Fallback for any other activation: its derivative through autograd."""
    with torch.enable_grad():
        xg = x.detach().requires_grad_(True)
        y = act(xg)
        (d,) = torch.autograd.grad(y, xg, torch.ones_like(y))
    return y.detach(), d


def _parts(z, gated: bool):
    return z.chunk(2, dim=-1) if gated else (None, z)


def _glu_sums(z, mean, gated: bool):
    """Per-row [sum] (mean is None) or [sum of squares about mean] of gate and up: [..., P]."""
    parts = [p.float() for p in _parts(z, gated) if p is not None]
    if mean is None:
        return torch.cat([p.sum(-1, keepdim=True) for p in parts], -1)
    return torch.cat([(p - mean[..., i:i + 1]).pow(2).sum(-1, keepdim=True)
                      for i, p in enumerate(parts)], -1)


def _glu_stats(z, gated, layer, eps, group, n, kernel=None):
    """(mean or None, rstd) per row and part, over the logical width n; ``kernel`` runs the
    row sums (default: _glu_sums, compiled as set_compile says)."""
    kernel = kernel or _kernel(_glu_sums, z)
    mean = None
    if layer:
        mean = sharding.all_reduce_sum(kernel(z, None, gated), group) / n
    centered = mean if mean is not None else torch.zeros(
        (*z.shape[:-1], 2 if gated else 1), dtype=torch.float32, device=z.device)
    ms = sharding.all_reduce_sum(kernel(z, centered, gated), group) / n
    return mean, torch.rsqrt(ms + eps)


def _xhat(p, mean, rstd, i):
    p = p.float()
    if mean is not None:
        p = p - mean[..., i:i + 1]
    return p * rstd[..., i:i + 1]


def _glu_fwd(z, mean, rstd, a_g, a_u, act, gated: bool):
    gate, up = _parts(z, gated)
    nu = _xhat(up, mean, rstd, 1 if gated else 0) * a_u
    if not gated:
        return act(nu).to(z.dtype)
    ng = _xhat(gate, mean, rstd, 0) * a_g
    return (act(ng) * nu).to(z.dtype)


def _vector_grad(prod, a):
    """d a: summed over rows for a vector; per row when ``a`` is given per row (experts).
    Summed in 32 row blocks, then over the blocks: inductor's CPU code for a plain column
    sum walks each column through all the rows, a slower pass over the GLU's two inputs."""
    if a.dim() > 1:
        return prod
    rows = prod.flatten(0, -2)
    blocks = 32 if rows.shape[0] % 32 == 0 else 1
    return rows.view(blocks, -1, rows.shape[-1]).sum(1).sum(0)


def _glu_bwd(dh, z, mean, rstd, a_g, a_u, act, gated: bool, dots):
    """``dots is None``: the per-row sums the norm backward needs ([..., 2P]); else (dz, da_g,
    da_u) with those sums (all-reduced, divided by the width) given."""
    gate, up = _parts(z, gated)
    dh = dh.float()
    iu = 1 if gated else 0
    uh = _xhat(up, mean, rstd, iu)
    nu = uh * a_u
    if gated:
        gh = _xhat(gate, mean, rstd, 0)
        ng = gh * a_g
        pair = _act_and_grad(act, ng) or _act_eager(act, ng)
        dng, dnu = dh * nu * pair[1], dh * pair[0]
        xs, gs = [gh, uh], [dng * a_g, dnu * a_u]
    else:
        pair = _act_and_grad(act, nu) or _act_eager(act, nu)
        dnu = dh * pair[1]
        xs, gs = [uh], [dnu * a_u]
    if dots is None:
        return torch.cat([(g * x).sum(-1, keepdim=True) for g, x in zip(gs, xs)]
                         + [g.sum(-1, keepdim=True) for g in gs], -1)
    parts = len(xs)
    dz = []
    for i, (g, x) in enumerate(zip(gs, xs)):
        d = g - x * dots[..., i:i + 1]
        if mean is not None:
            d = d - dots[..., parts + i:parts + i + 1]
        dz.append(d * rstd[..., i:i + 1])
    da_u = _vector_grad(dnu * uh, a_u)
    da_g = _vector_grad(dng * gh, a_g) if gated else None
    return torch.cat(dz, -1).to(z.dtype), da_g, da_u


def _glu_split_fwd(z, mean, rstd, a_g, a_u, ids, act, gated: bool):
    """_glu_fwd with each row's vectors (per expert when ``ids`` is given)."""
    return _glu_fwd(z, mean, rstd, *_rows(ids, a_g, a_u), act, gated)


def _glu_split_bwd(dh, z, mean, rstd, a_g, a_u, ids, act, gated: bool, dots):
    """_glu_bwd with each row's vectors; the vector gradients summed per expert."""
    out = _glu_bwd(dh, z, mean, rstd, *_rows(ids, a_g, a_u), act, gated, dots)
    return out if dots is None else _per_expert(ids, a_g, a_u, *out)


def _glu_local_fwd(z, a_g, a_u, ids, act, gated: bool, layer: bool, eps: float, n: int):
    """_glu_stats and _glu_split_fwd for an unsplit width, as one function (one kernel)."""
    mean, rstd = _glu_stats(z, gated, layer, eps, None, n, kernel=_glu_sums)
    return _glu_split_fwd(z, mean, rstd, a_g, a_u, ids, act, gated), mean, rstd


def _glu_local_bwd(dh, z, mean, rstd, a_g, a_u, ids, act, gated: bool, n: int):
    """Both _glu_split_bwd passes for an unsplit width, as one function."""
    args = (dh, z, mean, rstd, a_g, a_u, ids, act, gated)
    return _glu_split_bwd(*args, _glu_split_bwd(*args, None) / n)


def _per_expert(ids, a_g, a_u, dz, da_g, da_u):
    """Per-row vector gradients (experts) summed into each expert's vector: one small GEMM
    with the rows' one-hot expert matrix (a scatter-add would be atomic adds per element)."""
    if ids is None:
        return dz, da_g, da_u
    onehot = (ids[None, :] == torch.arange(a_u.shape[0], device=ids.device)[:, None]).float()
    return dz, None if da_g is None else onehot @ da_g, onehot @ da_u


class _GLUNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, a_g, a_u, act, gated, layer, eps, group, n, ids):
        if sharding.group_size(group) == 1:  # statistics and output in one kernel
            h, mean, rstd = _kernel(_glu_local_fwd, z)(z, a_g, a_u, ids, act, gated, layer,
                                                       eps, n)
        else:
            mean, rstd = _glu_stats(z, gated, layer, eps, group, n)
            h = _kernel(_glu_split_fwd, z)(z, mean, rstd, a_g, a_u, ids, act, gated)
        ctx.save_for_backward(z, mean, rstd, a_g, a_u, ids)
        ctx.act, ctx.gated, ctx.group, ctx.n = act, gated, group, n
        return h

    @staticmethod
    def backward(ctx, dh):
        z, mean, rstd, a_g, a_u, ids = ctx.saved_tensors
        args = (dh, z, mean, rstd, a_g, a_u, ids, ctx.act, ctx.gated)
        if sharding.group_size(ctx.group) == 1:  # row sums and gradients in one kernel
            dz, da_g, da_u = _kernel(_glu_local_bwd, z)(*args, ctx.n)
        else:
            kernel = _kernel(_glu_split_bwd, z)
            dots = sharding.all_reduce_sum(kernel(*args, None), ctx.group) / ctx.n
            dz, da_g, da_u = kernel(*args, dots)
        return dz, da_g, da_u, None, None, None, None, None, None, None


def _rows(ids, *vectors):
    """Each row's vector: ``a[ids]`` for per-expert vectors [E, f], else the vectors as given
    (inside the kernels: an indexed load, never a full-size tensor)."""
    if ids is None:
        return vectors
    return tuple(None if a is None else a[ids] for a in vectors)


def glu_norm(z, a_g, a_u, act, *, gated: bool, normalization: str, eps: float, group=None,
             width: Optional[int] = None, ids: Optional[torch.Tensor] = None):
    """``act(a_g N(gate)) * a_u N(up)`` (``act(a_u N(z))`` when not gated); ``z`` = fc1's
    local output, ``[gate, up]`` halves; N over ``width`` (the logical FFN width). With
    ``ids`` (grouped experts: row t belongs to expert ids[t]) ``a_g``, ``a_u`` are [E, f], one
    vector per expert."""
    layer = _layer_norm(normalization)
    local = z.shape[-1] // (2 if gated else 1)
    n = width or local * sharding.group_size(group)
    if use_reference():
        a_g, a_u = _rows(ids, a_g, a_u)
        gate, up = _parts(z, gated)
        nu = (_norm_reference(up, layer, eps, group, n) * a_u).to(z.dtype)
        if not gated:
            return act(nu)
        return act((_norm_reference(gate, layer, eps, group, n) * a_g).to(z.dtype)) * nu
    return _GLUNorm.apply(z, a_g, a_u, act, gated, layer, eps, group, n, ids)


# ---------------------------------------------------------------- shared helpers

def _layer_norm(normalization: str) -> bool:
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"scale-vector norms support normalization RMSNorm or LayerNorm, "
                         f"got {normalization!r}")
    return normalization == "LayerNorm"


def _norm_reference(x, layer: bool, eps: float, group, n: int):
    """The autograd composite N(x) the fused functions replace (float32)."""
    from megatron_scalevec.norms import normalize  # noqa: PLC0415 (norms imports this module)

    return normalize(x, "LayerNorm" if layer else "RMSNorm", eps, group, n)
