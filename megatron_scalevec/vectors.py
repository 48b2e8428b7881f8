"""One learnable scale vector: its parameters, gamma and gradient, under any parameterization.

What a parameterization is (its parts, gamma, inverse, which parts IWD decays) lives in
parameterizations.py, one class each; a vector holds its parameterization's parts as its
parameters, under the parts' names (``weight``; ``magnitude``, ``direction``; ``alpha``,
``logit``).

Each parameter is marked (``parameterizations.mark``) with its role (``input``/``output``,
SPEC.md's IWD table), its part and its parameterization; the optimizer rules read only these.
Norms and means run over the whole logical vector even when it is split across ranks.

A vector's value is read one way: its module call without input, ``vec()`` (a norm too:
``norm()``; ``norm(x)`` normalizes, norms.py). Hooks registered on the module run first:
megatron-core's DDP with ``overlap_param_gather`` waits there for the all-gather of its
parameters; reading them any other way would use the previous step's values
(tests/parity/test_overlap.py). :func:`stacked`, which evaluates several alike vectors as one
batched operation, runs those hooks itself (``sharding.ready``) before it reads their
parameters.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from megatron.core import parallel_state
from torch import nn

from megatron_scalevec import parameterizations, sharding, steps
from megatron_scalevec.backward import on_backward


class ScaleVector(nn.Module):
    """A scale vector of logical length ``global_size``; this rank holds ``size`` entries.

    Args:
        size: local length.
        parameterization: a registered name (parameterizations.py), or ``None`` for no
            parameters (gamma = 1).
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
        self._steps: dict = {}  # once-per-step values, by the vectors read together (_value)
        self._once: Optional[tuple] = None  # (gamma,) inside computed_once()
        self.scheme = None if parameterization is None else parameterizations.get(parameterization)
        for part in self._parts():
            p = nn.Parameter(torch.full((1,) if part.scalar else (size,), part.init, dtype=dtype))
            parameterizations.mark(p, parameterization, part.name, role)
            split_part = self.split_group is not None and not part.scalar
            if split_part:
                sharding.mark_split(p)
            if expert_allreduce is not None:
                sharding.mark_expert(p, expert_allreduce, tp_group=tp_group, split=split_part)
            self.register_parameter(part.name, p)

    @property
    def enabled(self) -> bool:
        return self.parameterization is not None

    def vector_parameters(self) -> list:
        """The vector's own parameters (its parts, in its parameterization's order): a subclass
        may own others (a norm's LayerNorm bias, norms.py), which are not part of gamma."""
        return [getattr(self, part.name) for part in self._parts()]

    def _parts(self) -> tuple:
        return self.scheme.parts if self.scheme is not None else ()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for part in self._parts():
                getattr(self, part.name).fill_(part.init)

    @contextlib.contextmanager
    def computed_once(self):
        """Inside the block every call returns the gamma computed on entry: one autograd node,
        so a vector used by several modules (shared expert vectors) is transformed and its
        gradient reduced once per forward, not once per user."""
        # in a tuple: a plain fp32 gamma is the Parameter itself, which nn.Module's __setattr__
        # would register as a parameter named _once
        self._once = (self(),)
        try:
            yield
        finally:
            self._once = None

    def forward(self) -> Optional[torch.Tensor]:
        """The effective gamma [size] (float32), or None when there is no vector."""
        if self._once is not None:
            return self._once[0]
        if self.parameterization is None:
            return None
        return _value([self], lambda: self.scheme.gamma(
            lambda part: getattr(self, part).float(), self))

    def outside_domain(self, gamma: torch.Tensor) -> Optional[str]:
        """Why :meth:`set_from_gamma` cannot represent ``gamma`` (its parameterization's domain,
        how many entries lie outside it, the smallest), or None."""
        bad = self.scheme.outside_domain(gamma) if self.scheme is not None else None
        if bad is None or not bool(bad.any()):
            return None
        n = int(bad.sum())
        return (f"{self.parameterization.upper()} parameterization needs {self.scheme.domain}, "
                f"but {n} entr{'y' if n == 1 else 'ies'} lie outside it (min "
                f"{float(gamma.min()):.4g})")

    @torch.no_grad()
    def set_from_gamma(self, gamma: torch.Tensor) -> None:
        """Set parameters so that forward() returns ``gamma`` (the local shard): its
        parameterization's inverse, exact where ``gamma`` lies in its domain (ER: gamma > 0).
        Used by conversion and tests."""
        if self.scheme is None:
            raise ValueError("cannot set a vector that has no parameters")
        gamma = gamma.to(torch.float32)
        why = self.outside_domain(gamma)
        if why:
            raise ValueError(why)
        for name, value in self.scheme.inverse(gamma, self).items():
            getattr(self, name).copy_(value)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Split parts are sharded along axis 0 of their split group; scalars replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis_map = {}
        if self.split_group is not None:
            axis_map = {p.name: 0 for p in self._parts() if not p.scalar}
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


def stacked(vectors: list) -> torch.Tensor:
    """[k, m] float32: the gamma of k alike vectors (same parameterization, sizes, groups) as
    one batched operation, with the same split statistics and gradient reduction as one by
    one. It reads their parameters without calling them, so it runs their hooks first
    (``sharding.ready``, module doc); a vector holding a value computed once for several users
    (:meth:`ScaleVector.computed_once`, shared expert vectors) gives that value."""
    if any(v._once is not None for v in vectors):
        return torch.stack([v() for v in vectors])
    sharding.ready(vectors)
    return _value(vectors, lambda: vectors[0].scheme.gamma(lambda name: torch.stack(
        [getattr(v, name).float() for v in vectors]), vectors[0]))


def has_branch_vectors(scalevec) -> bool:
    """Whether a branched projection has vectors: HG's gamma (input side) or DP's ``a``."""
    return bool((scalevec.hg and scalevec.vectors) or scalevec.dp)


def branch_vectors(scalevec, config, names, inputs: tuple, outputs: tuple,
                   expert_allreduce: Optional[bool]) -> tuple:
    """(scale_in, scale_out): ModuleDicts of branches ``names``' HG gamma and DP ``a``, for
    every owner of a branched projection's vectors (the linear itself, expert e in a TE grouped
    linear, the shared expert vectors). ``inputs`` / ``outputs``: (local size, placement:
    sharding.py) of each side; ``expert_allreduce``: an expert weight's (None: dense)."""
    scale_in, scale_out = torch.nn.ModuleDict(), torch.nn.ModuleDict()
    for name in names:
        if scalevec.hg and scalevec.vectors:
            scale_in[name] = ScaleVector(
                inputs[0], scalevec.parameterization, role="input", **inputs[1],
                expert_allreduce=expert_allreduce, dtype=config.params_dtype)
        if scalevec.dp:
            scale_out[name] = ScaleVector(
                outputs[0], scalevec.parameterization, role=scalevec.dp_output_role,
                **outputs[1], expert_allreduce=expert_allreduce, dtype=config.params_dtype)
    return scale_in, scale_out


def sharded_vectors(declarations, prefix: str, sharded_offsets=(), metadata=None,
                    copy: Optional[int] = None) -> dict:
    """Checkpoint entries of the vectors a module owns, from its declarations
    (``named_scale_vectors()``): each ScaleVector's own, split-aware ones, under ``prefix`` and
    its declared name; borrowed vectors are saved by their owner, a plain parameter (TE's norm
    gamma) by its module. ``copy``: the replica id's last entry, where a vector's copies are
    numbered otherwise than a dense one's (expert data parallel, EP). The one walk for every
    module that saves vectors (linears, TE grouped experts, shared expert vectors)."""
    sd = {}
    for d in declarations:
        if d.owned and isinstance(d.vector, ScaleVector):
            sd.update(d.vector.sharded_state_dict(f"{prefix}{d.name}.", sharded_offsets,
                                                  metadata))
    if copy is not None:
        for sh in sd.values():
            sh.replica_id = (*sh.replica_id[:2], copy)
    return sd


# ------------------------------------------------- a vector's value and gradient, once per step

def _value(vectors: list, compute) -> torch.Tensor:
    """``compute()`` (the gamma of ``vectors``, partial over their ``grad_group``) with its
    gradient summed over that group.

    Every micro-batch (reduced in autograd) outside megatron-core's DDP training. Under it, the
    parameters do not change within an optimizer step, so gamma is computed once per step (its
    statistics' collectives with it) and every micro-batch uses that value as a leaf that
    accumulates its gradient. The last micro-batch's backward closes the step (:func:`_close`):
    once it has run, every vector it reached has its step's gradient summed over its group in
    one collective per group, then mapped through gamma's own backward onto the parameters,
    before DDP reduces the vectors' buckets (megatron_scalevec/steps.py)."""
    v0 = vectors[0]
    params = [p for v in vectors for p in v.vector_parameters()]
    n = steps.per_step(params[0])
    if n is None:
        return sharding.reduce_grad(compute(), v0.grad_group)
    key = tuple(map(id, vectors))
    state = v0._steps.get(key)
    if state is None:
        state = v0._steps[key] = _Step(params, v0.grad_group)
    if steps.new_step(params[0]):
        if state.gamma is not None and state.leaf.grad is not None:  # a forward without
            raise steps.never_closed("a scale vector", state.seen, n)  # backward is no step
        if not all(steps.new_step(p) for p in params):
            raise RuntimeError("scale vectors: a vector read in one step both alone and "
                               "stacked with others (vectors.stacked): read it one way")
        steps.start(params)
        state.seen, state.gamma = 0, compute()
        state.leaf = state.gamma.detach().requires_grad_()
    elif state.seen >= n:
        raise steps.over_count("a scale vector", state.seen + 1, n)
    elif state.gamma is None:
        raise RuntimeError("scale vectors: a vector read in one step both alone and stacked "
                           "with others (vectors.stacked): read it one way")
    state.seen += 1
    if state.seen < n:
        return state.leaf
    return on_backward(state.leaf, functools.partial(_enrol, state))


class _Step:
    """One vector's (or one stack's) gamma in the current step and its accumulating leaf."""

    def __init__(self, params: list, group):
        self.params, self.group = params, group  # group: where the leaf's gradient is partial
        self.seen = 0
        self.gamma: Optional[torch.Tensor] = None  # with autograd, until the step closes
        self.leaf: Optional[torch.Tensor] = None


def _enrol(state: _Step, grad: torch.Tensor) -> torch.Tensor:
    """The backward of the step's last micro-batch, reaching its leaf: enrols ``state`` in
    :func:`_close`, which runs when that backward has finished."""
    if not _CLOSING:
        # Private: the autograd engine's queue_callback (what torch's DDP and FSDP use to run
        # code when a backward pass has finished; no public equivalent in torch 2.9 to 2.13).
        # A reentrant backward (recompute) closes at its own end.
        torch.autograd.Variable._execution_engine.queue_callback(_close)
    _CLOSING.append(state)
    return grad


_CLOSING: list = []  # the steps whose last micro-batch's backward is running


def _close() -> None:
    """Close the step of every vector whose last backward just ran: the leaves' gradients (the
    step's sum) are summed over their groups and the split vectors' backward statistics (OR's
    and ER's, parameterizations.py) over their split groups, one collective per group for all
    of them, then mapped through each gamma's backward (its parameterization's) onto the
    parameters, where megatron-core's DDP hooks take them as any gradient (the step closed:
    :func:`steps.close`)."""
    states = [s for s in _CLOSING if s.gamma is not None and s.leaf.grad is not None]
    _CLOSING.clear()
    if not states:
        return
    grads = [s.leaf.grad for s in states]
    # round 0: gradients partial over a group, and the statistics of split vectors whose
    # gradient is whole on this rank; round 1: those of split vectors whose gradient was partial
    rounds: list = [{}, {}]
    for s, g in zip(states, grads):
        if s.group is not None:
            rounds[0].setdefault(s.group, []).append(g)
    stats = [(s.gamma.grad_fn, g, int(s.group is not None)) for s, g in zip(states, grads)
             if getattr(s.gamma.grad_fn, "t", False) is None]  # OR / ER (parameterizations.py)
    for i, groups in enumerate(rounds):
        for fn, g, r in stats:
            if r == i and fn.group is not None:
                fn.t = parameterizations.partial_statistic(fn, g)
                groups.setdefault(fn.group, []).append(fn.t)
        for group, tensors in groups.items():  # the same order on every rank of a group
            sharding.sum_coalesced(tensors, group)
    gammas = [s.gamma for s in states]
    for s in states:
        s.gamma = s.leaf = None
        steps.close(s.params)  # their gradients now go through .grad as usual
    torch.autograd.backward(gammas, grads)
