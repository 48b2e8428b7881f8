"""The GLU with DNP's FFN-width norms on gate and up, fused: ``act(a_g * N(gate)) * (a_u *
N(up))`` in one pass over fc1's output, keeping only that output (what megatron-core's fused
GLU keeps) and two per-row ``1/rms``. ``N`` runs over the whole FFN width: when it is split
over a tensor-parallel group, the row statistics of forward and backward are all-reduced.

Grouped experts give each row its expert's vectors (:class:`ExpertRows`; rows sorted by
expert). Each expert's vector gradient is summed over its own rows without writing a per-row
product: the kernel sums blocks of ``BLOCK`` rows, a block inside one expert goes to that
expert, and only the rows of the few blocks that span two experts (at most one per expert
boundary) are kept one by one. The bodies are compiled or not by compile.py, with its
guards for a row count that varies (``rows_kernel``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from megatron_scalevec import compile, ops, sharding

BLOCK = 16  # rows per block of the per-expert vector gradients


class ExpertRows(NamedTuple):
    """Rows sorted by expert, for the per-expert vector gradients (:func:`expert_rows`).
    ``ids`` [T]: each row's expert; ``spans`` [S]: the rows of the blocks that span experts
    (padded with row 0), or None to sum row by row; ``keys``: the expert each summand of the
    gradient goes to, -1 for none ([T / BLOCK blocks + S] with spans, else ``ids``)."""

    ids: torch.Tensor
    spans: Optional[torch.Tensor]
    keys: torch.Tensor


def device_counts(counts, device=None) -> torch.Tensor:
    """``counts`` (a list, or a tensor: the experts' ``tokens_per_expert``) as an int64 tensor
    on ``device`` without a sync: a tensor already there as it is; host counts in one copy,
    non-blocking from pinned memory to a GPU (the CPU runs on)."""
    on_device = isinstance(counts, torch.Tensor) and counts.device.type != "cpu"
    device = torch.device(device if device is not None else
                          counts.device if on_device else "cpu")
    if on_device:
        return counts.to(device, torch.long)  # as it is (already int64 on the device)
    host = torch.as_tensor(counts, dtype=torch.long)
    if device.type != "cpu" and not host.is_pinned():
        host = host.pin_memory()  # the caching host allocator keeps it until the copy is done
    return host.to(device, non_blocking=True)


def expert_rows(counts, device=None, blocks: bool = True, total: Optional[int] = None
                ) -> ExpertRows:
    """ExpertRows of ``counts[e]`` rows per expert, in expert order; ``blocks=False``: the ids
    only (no GLU norm to sum vector gradients for). ``counts``: host counts (a list or CPU
    tensor, as the grouped experts' ``tokens_per_expert``: one non-blocking upload,
    :func:`device_counts`), or a tensor on ``device`` (nothing copied; give ``total``, the
    number of rows, or its sum is read back). Built on the device with host-known sizes only
    (no sync): a block spans experts where its first and last rows' experts differ, at most
    E - 1 blocks, padded to that fixed size (one shape per E)."""
    sizes = device_counts(counts, device)
    if total is None:
        total = sum(counts) if isinstance(counts, (list, tuple)) else int(counts.sum())
    n, e, dev = total, sizes.numel(), sizes.device
    ids = torch.repeat_interleave(torch.arange(e, device=dev), sizes, output_size=n)
    if n == 0 or not blocks:
        return ExpertRows(ids, None, ids)
    starts = torch.arange(0, n, BLOCK, device=dev)
    first, last = ids[starts], ids[(starts + BLOCK - 1).clamp(max=n - 1)]
    inside = first == last  # ids are sorted: the block's rows are all that expert's
    # the blocks spanning experts (at most E - 1: one per boundary) in order, then `none` (a
    # sentinel block past the rows) up to that fixed size
    none, k = starts.numel(), max(e - 1, 1)
    candidates = torch.where(inside, none, torch.arange(none, device=dev))
    span = torch.cat([candidates, candidates.new_full((k,), none)]).sort().values[:k]
    rows = (span[:, None] * BLOCK + torch.arange(BLOCK, device=dev)).flatten()
    real = rows < n  # a sentinel's rows start at none * BLOCK >= n
    rows = torch.where(real, rows, 0)
    keys = torch.cat([torch.where(inside, first, -1), torch.where(real, ids[rows], -1)])
    return ExpertRows(ids, rows, keys)


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


def _glu_stats(z, gated, layer, eps, group, n):
    """(mean or None, rstd) per row of gate and up ([..., P]) over the logical width n
    (ops.row_stats; one all-reduce per statistic when the width is split over ``group``)."""
    parts = [p for p in _parts(z, gated) if p is not None]
    return ops.row_stats(parts, layer, eps, n, lambda t: sharding.all_reduce_sum(t, group))


def _glu_fwd(z, mean, rstd, a_g, a_u, act, gated: bool):
    gate, up = _parts(z, gated)
    nu = ops.scale_free(up, mean, rstd, 1 if gated else 0) * a_u
    if not gated:
        return act(nu).to(z.dtype)
    ng = ops.scale_free(gate, mean, rstd, 0) * a_g
    return (act(ng) * nu).to(z.dtype)


def _vector_grad(prod, a, spans):
    """d a: summed over rows for a vector. For per-row vectors (experts, ``a`` [T, f]): the
    sums of BLOCK-row blocks, then the rows ``spans`` one by one; the products row by row when
    ``spans`` is None. A vector's rows are summed in 32 blocks, then over the blocks: inductor's
    CPU code for a plain column sum walks each column through all the rows."""
    if a.dim() > 1:
        if spans is None:
            return prod
        pad = (-prod.shape[0]) % BLOCK
        blocks = F.pad(prod, (0, 0, 0, pad)).view(-1, BLOCK, prod.shape[-1]).sum(1)
        return torch.cat([blocks, prod[spans]])
    rows = prod.flatten(0, -2)
    blocks = 32 if rows.shape[0] % 32 == 0 else 1
    return rows.view(blocks, -1, rows.shape[-1]).sum(1).sum(0)


def _glu_bwd(dh, z, mean, rstd, a_g, a_u, act, gated: bool, dots, spans=None):
    """``dots is None``: the per-row sums the norm backward needs ([..., 2P]); else (dz, da_g,
    da_u) with those sums (all-reduced, divided by the width) given."""
    gate, up = _parts(z, gated)
    dh = dh.float()
    iu = 1 if gated else 0
    uh = ops.scale_free(up, mean, rstd, iu)
    nu = uh * a_u
    if gated:
        gh = ops.scale_free(gate, mean, rstd, 0)
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
    dz = [ops.scale_free_grad(g, x, rstd[..., i:i + 1], dots[..., i:i + 1],
                              None if mean is None else dots[..., parts + i:parts + i + 1])
          for i, (g, x) in enumerate(zip(gs, xs))]
    da_u = _vector_grad(dnu * uh, a_u, spans)
    da_g = _vector_grad(dng * gh, a_g, spans) if gated else None
    return torch.cat(dz, -1).to(z.dtype), da_g, da_u


def _glu_split_fwd(z, mean, rstd, a_g, a_u, ids, act, gated: bool):
    """_glu_fwd with each row's vectors (per expert when ``ids`` is given)."""
    return _glu_fwd(z, mean, rstd, *_rows(ids, a_g, a_u), act, gated)


def _glu_split_bwd(dh, z, mean, rstd, a_g, a_u, ids, spans, keys, act, gated: bool, dots):
    """_glu_bwd with each row's vectors; the vector gradients summed per expert."""
    out = _glu_bwd(dh, z, mean, rstd, *_rows(ids, a_g, a_u), act, gated, dots, spans)
    return out if dots is None else _per_expert(keys, a_g, a_u, *out)


def _glu_local_fwd(z, a_g, a_u, ids, act, gated: bool, layer: bool, eps: float):
    """_glu_stats and _glu_split_fwd for an unsplit width, as one function (one kernel)."""
    parts = [p for p in _parts(z, gated) if p is not None]
    mean, rstd = ops.row_stats(parts, layer, eps, _width(z, gated))
    return _glu_split_fwd(z, mean, rstd, a_g, a_u, ids, act, gated), mean, rstd


def _glu_local_bwd(dh, z, mean, rstd, a_g, a_u, ids, spans, keys, act, gated: bool):
    """Both _glu_split_bwd passes for an unsplit width, as one function."""
    args = (dh, z, mean, rstd, a_g, a_u, ids, spans, keys, act, gated)
    return _glu_split_bwd(*args, _glu_split_bwd(*args, None) / _width(z, gated))


def _width(z, gated: bool) -> int:
    return z.shape[-1] // (2 if gated else 1)


def _per_expert(keys, a_g, a_u, dz, da_g, da_u):
    """Expert vector gradients: the summands (blocks and rows, :func:`_vector_grad`) added
    into the experts ``keys`` names, by one small GEMM with their one-hot matrix (a
    scatter-add would be atomic adds per element, in no fixed order)."""
    if keys is None:
        return dz, da_g, da_u
    onehot = (keys[None, :] == torch.arange(a_u.shape[0], device=keys.device)[:, None]).float()
    return dz, None if da_g is None else onehot @ da_g, onehot @ da_u


class _GLUNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, a_g, a_u, act, gated, layer, eps, group, n, ids, spans, keys):
        ctx.local = sharding.group_size(group) == 1 and n == _width(z, gated)
        if ctx.local:  # statistics and output in one kernel
            kernel = compile.rows_kernel(_glu_local_fwd, z, a_g, a_u)
            h, mean, rstd = kernel(z, a_g, a_u, ids, act, gated, layer, eps)
        else:
            mean, rstd = _glu_stats(z, gated, layer, eps, group, n)
            kernel = compile.rows_kernel(_glu_split_fwd, z, a_g, a_u)
            h = kernel(z, mean, rstd, a_g, a_u, ids, act, gated)
        ctx.save_for_backward(z, mean, rstd, a_g, a_u, ids, spans, keys)
        ctx.act, ctx.gated, ctx.group, ctx.n = act, gated, group, n
        return h

    @staticmethod
    def backward(ctx, dh):
        z, mean, rstd, a_g, a_u, ids, spans, keys = ctx.saved_tensors
        args = (dh, z, mean, rstd, a_g, a_u, ids, spans, keys, ctx.act, ctx.gated)
        if ctx.local:  # row sums and gradients in one kernel
            dz, da_g, da_u = compile.rows_kernel(_glu_local_bwd, z, dh, a_g, a_u)(*args)
        else:
            kernel = compile.rows_kernel(_glu_split_bwd, z, dh, a_g, a_u)
            dots = sharding.all_reduce_sum(kernel(*args, None), ctx.group) / ctx.n
            dz, da_g, da_u = kernel(*args, dots)
        return dz, da_g, da_u, *(None,) * 9


def _rows(ids, *vectors):
    """Each row's vector: ``a[ids]`` for per-expert vectors [E, f], else the vectors as given
    (inside the kernels: an indexed load, never a full-size tensor)."""
    if ids is None:
        return vectors
    return tuple(None if a is None else a[ids] for a in vectors)


def check_config(config) -> None:
    """One line for the GLU options the DNP norm does not apply (it computes
    ``act(a_g N(gate)) * a_u N(up)`` exactly)."""
    for name in ("activation_func_clamp_value", "glu_linear_offset"):
        if getattr(config, name, None):
            raise NotImplementedError(f"DNP does not support config.{name}="
                                      f"{getattr(config, name)}: its fused GLU norm applies "
                                      f"no clamp or offset")


def glu_norm(z, a_g, a_u, act, *, gated: bool, normalization: str, eps: float, group=None,
             width: Optional[int] = None, experts: Optional[ExpertRows] = None):
    """``act(a_g N(gate)) * a_u N(up)`` (``act(a_u N(z))`` when not gated); ``z`` = fc1's
    local output, ``[gate, up]`` halves; N over ``width`` (the logical FFN width). With
    ``experts`` (grouped experts: the rows of each expert, :func:`expert_rows`) ``a_g``,
    ``a_u`` are [E, f], one vector per expert."""
    layer = ops.is_layer_norm(normalization)
    n = width or _width(z, gated) * sharding.group_size(group)
    ids, spans, keys = experts if experts is not None else (None, None, None)
    return _GLUNorm.apply(z, a_g, a_u, act, gated, layer, eps, group, n, ids, spans, keys)
