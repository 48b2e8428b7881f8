"""One learnable scale vector, under each parameterization of SPEC.md.

=========  ==========================================  ========================  ==========
name       gamma                                       parameters                at init
=========  ==========================================  ========================  ==========
plain      ``weight``                                  weight [m]                1
or         ``beta * sqrt(m) * u / |u|``                magnitude [1], direction  1
er         ``exp(alpha + v - mean(v))``                alpha [1], logit [m]      1
=========  ==========================================  ========================  ==========

Each parameter carries ``scalevec_role`` (``input``/``output``, SPEC.md's IWD table) and
``scalevec_part`` (which of the above it is); the optimizer rules read only these two.
Norms and means run over the whole logical vector even when it is split across ranks.

Once per optimizer step: within a step the parameters are fixed, so gamma is too. A vector
whose owner asks for it exactly once per training forward (the norms, the router) opts in with
:meth:`ScaleVector.cache_per_step`; its ``forward()`` then runs the weight folds' cycle
(layers/fold_cache.py) on gamma itself: gamma is computed once (no autograd) and reused as a
leaf by micro-batches 1..n-1, whose gradients accumulate in fp32; the last micro-batch computes
gamma with autograd and its backward adds the accumulated gradient, so the map back to the
parameters (and the ``reduce_grad`` all-reduce) runs once per step. The weight folds read their
vectors through :meth:`ScaleVector.gamma`, never cached (they are once per step already).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core import parallel_state
from torch import nn

from megatron_scalevec import sharding

PARTS = {"plain": ("weight",), "or": ("magnitude", "direction"), "er": ("alpha", "logit")}
DECAYED_PARTS = {"weight", "magnitude", "alpha"}  # the direction parts are scale-invariant


class ScaleVector(nn.Module):
    """A scale vector of logical length ``global_size``; this rank holds ``size`` entries.

    Args:
        size: local length.
        parameterization: ``plain``, ``or``, ``er``, or ``None`` for no parameters (gamma = 1).
        role: ``input`` or ``output`` (IWD).
        tp_group: the tensor-parallel group of the layer that owns the vector.
        split: True when the vector is split along ``tp_group`` (else replicated on it).
        grad_group: the group over which this vector's *use* is partial (see sharding.py).
        expert_allreduce: for expert vectors, the ``allreduce`` flag of the expert weights.
    """

    def __init__(self, size: int, parameterization: Optional[str] = "plain", *,
                 role: str = "input", tp_group=None, split: bool = False, grad_group=None,
                 expert_allreduce: Optional[bool] = None, dtype=torch.float32):
        super().__init__()
        if role not in ("input", "output"):
            raise ValueError(f"ScaleVector role must be 'input' or 'output', got {role!r}")
        self.size = size
        self.parameterization = parameterization
        self.role = role
        self.tp_group = tp_group
        self.split_group = tp_group if split and sharding.group_size(tp_group) > 1 else None
        self.grad_group = grad_group if sharding.group_size(grad_group) > 1 else None
        self.global_size = size * sharding.group_size(self.split_group)
        if parameterization is None:
            return
        if parameterization not in PARTS:
            raise ValueError(f"unknown parameterization {parameterization!r}")
        init = {"weight": 1.0, "magnitude": 1.0, "direction": 1.0, "alpha": 0.0, "logit": 0.0}
        for part in PARTS[parameterization]:
            shape = (1,) if part in ("magnitude", "alpha") else (size,)
            p = nn.Parameter(torch.full(shape, init[part], dtype=dtype))
            p.scalevec_role = role
            p.scalevec_part = part
            split_part = self.split_group is not None and shape != (1,)
            if split_part:
                sharding.mark_split(p)
            if expert_allreduce is not None:
                sharding.mark_expert(p, expert_allreduce, tp_group=tp_group, split=split_part)
            self.register_parameter(part, p)

    @property
    def enabled(self) -> bool:
        return self.parameterization is not None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                p.fill_(0.0 if name in ("alpha", "logit") else 1.0)

    _once: Optional[torch.Tensor] = None  # set inside computed_once()
    _step: Optional[tuple] = None  # (scalevec, config) once cache_per_step() was called

    def cache_per_step(self, scalevec, config) -> None:
        """Compute gamma once per optimizer step (module doc). Only for an owner that calls
        ``forward()`` exactly once per training forward: the cycle counts those calls. A plain
        vector without gradient reduction has nothing to save and stays as it is."""
        if self.enabled and (self.parameterization != "plain" or self.grad_group is not None):
            self._step = (scalevec, config)

    @contextlib.contextmanager
    def computed_once(self):
        """Inside the block every call returns the gamma computed on entry: one autograd node,
        so a vector used by several modules (shared expert vectors) is transformed and its
        gradient reduced once per forward, not once per user."""
        outer = self._once  # inside a layer's evaluation (layers/layer.py): the same gamma
        self.hold(ScaleVector.forward(self))  # also for a norm
        try:
            yield
        finally:
            self.hold(outer)

    def hold(self, gamma: Optional[torch.Tensor]) -> None:
        """Make every call return ``gamma`` (None: compute again); for :meth:`computed_once`
        and a layer's evaluation of all its vectors at once (layers/layer.py)."""
        # object.__setattr__: a plain fp32 gamma is the Parameter itself, which
        # Module.__setattr__ would try to register as a parameter named _once
        object.__setattr__(self, "_once", gamma)

    def forward(self) -> Optional[torch.Tensor]:
        """The effective gamma [size] (float32), or None when there is no vector; once per
        optimizer step when :meth:`cache_per_step` was called and the step allows it."""
        if self._once is None and self._step is not None:
            gamma = self._step_gamma()
            if gamma is not None:
                return gamma
        return self.gamma()

    def gamma(self) -> Optional[torch.Tensor]:
        """gamma computed now (with autograd when enabled), never through the step cache: the
        weight folds' ``vectors()`` (a fold is once per step already) and diagnostics."""
        if self._once is not None:
            return self._once
        if self.parameterization is None:
            return None
        return _gamma(self, lambda part: getattr(self, part).float())

    def _step_gamma(self) -> Optional[torch.Tensor]:
        """fold_cache's cycle with gamma as the "effective weight": weights = this vector's
        parameters (their version counters guard the cache), vectors = (gamma with autograd,),
        fold and unfold the identity, so the last micro-batch's autograd maps the summed
        gradient back. None: compute gamma per micro-batch (fold_cache's on/off rules)."""
        from megatron_scalevec.layers import fold_cache  # noqa: PLC0415 (layers imports us)

        scalevec, config = self._step
        # The [size] part first: fold_cache names the cycle after weights[0]'s shape.
        weights = tuple(reversed(list(self.parameters(recurse=False))))
        ops = fold_cache.FoldOps(weights, lambda: (self.gamma(),), _identity_fold,
                                 _identity_unfold)
        return fold_cache.step_weight(self, ops, scalevec=scalevec, config=config,
                                      safe_recompute=fold_cache.NORM_SAFE_RECOMPUTE)

    @torch.no_grad()
    def set_from_gamma(self, gamma: torch.Tensor) -> None:
        """Set parameters so that forward() returns ``gamma`` (the local shard), exactly for
        plain and OR, and for ER where gamma > 0. Used by conversion and tests."""
        gamma = gamma.to(torch.float32)
        if self.parameterization == "plain":
            self.weight.copy_(gamma)
        elif self.parameterization == "or":
            sq = sharding.all_reduce_sum(gamma.pow(2).sum(), self.split_group)
            self.direction.copy_(gamma)
            self.magnitude.fill_(float(torch.sqrt(sq / self.global_size)))
        elif self.parameterization == "er":
            if bool((gamma <= 0).any()):
                raise ValueError("ER needs gamma > 0 everywhere to take its logarithm")
            log = gamma.log()
            mean = sharding.all_reduce_sum(log.sum(), self.split_group) / self.global_size
            self.logit.copy_(log - mean)
            self.alpha.fill_(float(mean))
        else:
            raise ValueError("cannot set a vector that has no parameters")

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Split parts are sharded along axis 0 of their split group; scalars replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis_map = {}
        if self.split_group is not None:
            axis_map = {n: 0 for n in ("weight", "direction", "logit")}
        tp = self.tp_group if self.tp_group is not None else sharding.tp_group(False)
        dp_cp = (metadata or {}).get("dp_cp_group")
        if dp_cp is None:
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis_map, sharded_offsets,
            tp_group=tp, dp_cp_group=dp_cp)

    def extra_repr(self) -> str:
        return (f"size={self.size}, global_size={self.global_size}, "
                f"parameterization={self.parameterization}, role={self.role}")


def _gamma(v0: ScaleVector, part) -> torch.Tensor:
    """The table in the module doc over the last dim, for one vector ([m] parts, scalars [1])
    or k alike ones stacked ([k, m], [k, 1]); ``part(name)`` gives the float32 tensor. Norms
    and means run over the whole logical vector; a split vector's scalar is shared by its
    ranks, each of which sees part of its gradient (``reduce_grad``)."""
    kind = v0.parameterization
    if kind == "plain":
        gamma = part("weight")
    elif kind == "or":
        u = part("direction")
        sq = sharding.all_reduce_sum(u.pow(2).sum(-1, keepdim=True), v0.split_group)
        beta = sharding.reduce_grad(part("magnitude"), v0.split_group)
        # sqrt(m) / |u| written as rsqrt(mean(u^2)): exactly 1 at init (u = 1).
        gamma = beta * u * torch.rsqrt(sq / v0.global_size)
    else:
        v = part("logit")
        mean = sharding.all_reduce_sum(v.sum(-1, keepdim=True), v0.split_group) / v0.global_size
        gamma = torch.exp(sharding.reduce_grad(part("alpha"), v0.split_group) + v - mean)
    return sharding.reduce_grad(gamma, v0.grad_group)


def stacked(vectors: list) -> torch.Tensor:
    """[k, m] float32: ``gamma()`` of k alike vectors (:func:`alike`) as one batched
    operation, with the same split statistics and gradient reduction as one by one."""
    return _gamma(vectors[0], lambda name: torch.stack([getattr(v, name) for v in vectors])
                  .float())


def alike(v: ScaleVector) -> tuple:
    """Vectors with equal keys can be stacked: same parameterization, lengths, groups, dtype."""
    dtype = next(v.parameters()).dtype if v.enabled else None
    return (v.parameterization, v.size, v.global_size, v.split_group, v.grad_group, dtype)


def gammas(vectors: list) -> list:
    """``gamma()`` of each vector (None where it has none), alike OR / ER vectors computed as
    one stacked operation: a few ops (and one all-reduce per group) instead of a dozen per
    vector. A vector held by :meth:`ScaleVector.hold` returns what it holds."""
    out: list = [None] * len(vectors)
    groups: dict = {}
    for i, v in enumerate(vectors):
        if v._once is None and v.parameterization in ("or", "er"):
            groups.setdefault(alike(v), {}).setdefault(id(v), []).append(i)
        else:
            out[i] = v.gamma()
    for group in groups.values():
        first = [idx[0] for idx in group.values()]
        rows = (stacked([vectors[i] for i in first]).unbind(0) if len(first) > 1
                else [vectors[first[0]].gamma()])
        for idx, row in zip(group.values(), rows):
            for i in idx:
                out[i] = row
    return out


def _identity_fold(weights, vectors):
    return vectors[0].clone()  # a plain fp32 gamma is a view of its parameter


def _identity_unfold(grad, weights, vectors, needs):
    return (*(None for _ in weights), grad)  # the gradient of gamma; autograd does the rest
