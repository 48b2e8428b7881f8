"""How a scale vector's parameters make its gamma: one class per parameterization, one registry.

=========  ==========================================  ========================  ==========
name       gamma                                       parts (IWD decays)        at init
=========  ==========================================  ========================  ==========
plain      ``weight``                                  weight [m] (yes)          1
or         ``beta * sqrt(m) * u / |u|``                magnitude [1] (yes),      1
                                                       direction [m] (no)
er         ``exp(alpha + v - mean(v))``                alpha [1] (yes),          1
                                                       logit [m] (no)
=========  ==========================================  ========================  ==========

A :class:`Parameterization` is everything the package knows of one: its parts (name, scalar or
per entry, init, whether IWD decays it on an Input-Norm vector), gamma from the parts, the parts
from a gamma (conversion) and where that is possible, which part is the vector's overall scale
(DNP makes it invariant: invariance.py), the statistics a run logs and its parameter count. The
rest derives from it: the strategy string's tokens and checks (config.py), the vector's
parameters (vectors.py), the decay rules (optim.py), the MoE count (layers/moe.py), the warm
start's check (convert/warmstart.py) and the monitor (training/monitor.py). A new one is a
subclass and :func:`register` (tests/test_parameterization_registry.py registers one in the test
file alone, then trains, resumes and converts with it).

Norms and means run over the whole logical vector even when it is split across ranks: a
parameterization gets the vector (``split_group``, ``global_size``) with its parts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch


@functools.cache
def _sharding():
    """sharding.py, imported on first use (then cached: the OR / ER Functions call this on
    every forward and backward): it imports megatron-core, and config.py reads the registry
    while a command line is parsed, before an entry point has set up the CPU layer and the
    folding of megatron-core's import warnings (training/summary.py)."""
    from megatron_scalevec import sharding  # noqa: PLC0415

    return sharding

__all__ = ["ER", "OR", "Parameterization", "Part", "Plain", "get", "mark", "names",
           "part_decays", "partial_statistic", "register", "stock_name", "unregister"]


@dataclass(frozen=True)
class Part:
    """One parameter of a vector: ``scalar`` ``[1]`` (replicated where the vector is split),
    else ``[m]`` (split with it); ``decays``: IWD decays it on an Input-Norm vector (SPEC.md:
    a scale-invariant direction never does)."""

    name: str
    scalar: bool
    init: float
    decays: bool


class Parameterization:
    """One way to make gamma from parameters; a subclass sets :attr:`name`, :attr:`parts`,
    :meth:`gamma` and :meth:`inverse` (and may set the rest)."""

    name: str = ""
    parts: tuple = ()
    stock: bool = False  # gamma stored as is in one part: megatron-core's own norm weight
    magnitude: Optional[str] = None  # the scalar part that sets the vector's overall scale
    domain: Optional[str] = None  # what a gamma must satisfy for :meth:`inverse` (None: any)

    def gamma(self, part: Callable[[str], torch.Tensor], vec) -> torch.Tensor:
        """gamma over the last dim from ``part(name)`` (float32; ``[m]`` and ``[1]``, or k
        alike vectors stacked ``[k, m]`` and ``[k, 1]``), with autograd. ``vec``: the vector
        (``split_group``, ``global_size``)."""
        raise NotImplementedError

    def inverse(self, gamma: torch.Tensor, vec) -> dict:
        """{part: value} with ``gamma(...) == gamma`` (this rank's shard; scalars ``[1]``)."""
        raise NotImplementedError

    def outside_domain(self, gamma: torch.Tensor) -> Optional[torch.Tensor]:
        """Boolean mask of the entries :meth:`inverse` cannot represent (None: none)."""
        return None

    def statistics(self, vec) -> dict:
        """{name: 0-d tensor} a run logs for a vector beside its norm (training/monitor.py),
        whole-vector values where it is split."""
        return {}

    def numel(self, m: int) -> int:
        """Parameters of one vector of length ``m``."""
        return sum(1 if p.scalar else m for p in self.parts)

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)


class Plain(Parameterization):
    """``gamma = weight``: megatron-core's own norm weight (the stock name)."""

    name = "plain"
    parts = (Part("weight", scalar=False, init=1.0, decays=True),)
    stock = True

    def gamma(self, part, vec):
        return part("weight")

    def inverse(self, gamma, vec):
        return {"weight": gamma}


class OR(Parameterization):
    """Magnitude-direction in the original space, ``gamma = beta * sqrt(m) * u / |u|``."""

    name = "or"
    parts = (Part("magnitude", scalar=True, init=1.0, decays=True),
             Part("direction", scalar=False, init=1.0, decays=False))
    magnitude = "magnitude"

    def gamma(self, part, vec):
        return _Magnitude.apply(part("direction"), part("magnitude"), vec.split_group,
                                vec.global_size)

    def inverse(self, gamma, vec):
        sq = _sharding().all_reduce_sum(gamma.pow(2).sum(), vec.split_group)
        return {"direction": gamma, "magnitude": torch.sqrt(sq / vec.global_size).reshape(1)}

    def statistics(self, vec):
        return {"beta": vec.magnitude.detach().float().reshape(())}


class ER(Parameterization):
    """Magnitude-direction in exponential space, ``gamma = exp(alpha + v - mean(v))``."""

    name = "er"
    parts = (Part("alpha", scalar=True, init=0.0, decays=True),
             Part("logit", scalar=False, init=0.0, decays=False))
    magnitude = "alpha"
    domain = "gamma > 0"

    def gamma(self, part, vec):
        return _Exponential.apply(part("logit"), part("alpha"), vec.split_group,
                                  vec.global_size)

    def inverse(self, gamma, vec):
        log = gamma.log()
        mean = _sharding().all_reduce_sum(log.sum(), vec.split_group) / vec.global_size
        return {"logit": log - mean, "alpha": mean.reshape(1)}

    def outside_domain(self, gamma):
        return gamma <= 0


# ------------------------------------------------------------------------------- the registry

_REGISTRY: dict = {}


def register(parameterization: Parameterization) -> Parameterization:
    """Make ``parameterization`` known by its name, which becomes a strategy token
    (``hg+dp+<name>``, config.py)."""
    name, parts = parameterization.name, parameterization.parts
    if not name or name != name.lower() or not name.isidentifier():
        raise ValueError(f"a parameterization needs a lower-case identifier name, got {name!r}")
    if name in _REGISTRY and type(_REGISTRY[name]) is not type(parameterization):
        raise ValueError(f"parameterization {name!r} is registered already")
    if not parts or len({p.name for p in parts}) != len(parts):
        raise ValueError(f"parameterization {name!r}: parts need distinct names")
    if parameterization.magnitude is not None and \
            not parameterization.part(parameterization.magnitude).scalar:
        raise ValueError(f"parameterization {name!r}: its magnitude must be a scalar part")
    _REGISTRY[name] = parameterization
    return parameterization


def unregister(name: str) -> None:
    """Forget ``name`` (a test's own parameterization, once the test is done)."""
    if get(name).stock:
        raise ValueError(f"parameterization {name!r} is the stock one and stays")
    del _REGISTRY[name]


def get(name: str) -> Parameterization:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown parameterization {name!r}; known: "
                         f"{', '.join(names())}") from None


def names() -> tuple:
    """The registered names, ``plain`` first."""
    return tuple(_REGISTRY)


def stock_name() -> str:
    """The parameterization that is megatron-core's own norm weight (the default)."""
    return next(n for n, p in _REGISTRY.items() if p.stock)


def mark(param: torch.nn.Parameter, parameterization: str, part: str, role: str) -> None:
    """Mark ``param`` as ``part`` of a vector of ``role`` (``input``/``output``, SPEC.md's IWD
    table): what the optimizer's rules read (optim.py)."""
    get(parameterization).part(part)  # a known part of a known parameterization
    param.scalevec_role = role
    param.scalevec_part = part
    param.scalevec_parameterization = parameterization


def part_decays(param) -> bool:
    """Whether IWD decays ``param`` (marked by :func:`mark`) on an Input-Norm vector."""
    return get(param.scalevec_parameterization).part(param.scalevec_part).decays


for _p in (Plain(), OR(), ER()):
    register(_p)


# ------------------------------------------------------------ OR / ER over split vectors

class _Magnitude(torch.autograd.Function):
    """OR: ``gamma = beta * u * rsqrt(mean(u^2))`` (``sqrt(m) / |u|``, exactly 1 at init), the
    mean over the whole vector. Written out so that a split vector needs one collective each
    way: the sum of squares forward, ``t = sum(g * u)`` backward (``beta`` is shared by the
    split's ranks: ``d beta = t * r`` on each). A gamma Function with such a backward statistic
    saves first the tensor ``t`` sums ``g`` against and sets ``ctx.group`` and ``ctx.t = None``,
    so that the step's close sums ``t`` with every other vector's in one collective
    (vectors.py, :func:`partial_statistic`)."""

    @staticmethod
    def forward(ctx, u, beta, group, m):
        r = torch.rsqrt(_sharding().sum_in_place(u.pow(2).sum(-1, keepdim=True), group) / m)
        ctx.save_for_backward(u, beta, r)
        ctx.group, ctx.m, ctx.t = group, m, None
        return beta * u * r

    @staticmethod
    def backward(ctx, g):
        u, beta, r = ctx.saved_tensors
        t = ctx.t if ctx.t is not None else _sharding().sum_in_place(partial_statistic(ctx, g),
                                                                     ctx.group)
        return beta * r * (g - (r * r * t / ctx.m) * u), t * r, None, None


def partial_statistic(ctx, g) -> torch.Tensor:
    """This rank's part of the backward statistic ``t`` of :class:`_Magnitude` (``sum(g * u)``)
    or :class:`_Exponential` (``sum(g * gamma)``): the tensor each saved first, [..., 1]."""
    return (g * ctx.saved_tensors[0]).sum(-1, keepdim=True)


class _Exponential(torch.autograd.Function):
    """ER: ``gamma = exp(alpha + v - mean(v))``, the mean over the whole vector; one collective
    each way when split (``sum(v)``; ``t = sum(g * gamma)``, which is ``d alpha``)."""

    @staticmethod
    def forward(ctx, v, alpha, group, m):
        mean = _sharding().sum_in_place(v.sum(-1, keepdim=True), group) / m
        gamma = torch.exp(alpha + v - mean)
        ctx.save_for_backward(gamma)
        ctx.group, ctx.m, ctx.t = group, m, None
        return gamma

    @staticmethod
    def backward(ctx, g):
        (gamma,) = ctx.saved_tensors
        h = g * gamma
        t = ctx.t if ctx.t is not None else _sharding().sum_in_place(h.sum(-1, keepdim=True),
                                                                     ctx.group)
        return h - t / ctx.m, t, None, None
