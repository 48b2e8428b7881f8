"""The fold once per optimizer step: one effective weight per step, its gradient mapped back once.

Within an optimizer step W and the vectors are fixed, so ``W_eff = diag(a) W diag(gamma)`` is
the same in every micro-batch. Folding per micro-batch costs n x (fold, rebuild in backward,
map back) passes over the weight; here a folded layer, over one cycle of n training forwards:

* forward 1 evaluates the vectors (with autograd: their small graph is kept for forward n),
  builds W_eff from them (no autograd) and keeps it with one detached leaf copy;
* forwards 1..n-1 run their GEMM on that leaf; a hook moves each gradient it receives into an
  fp32 accumulator (so bf16 parameters lose nothing against megatron-core's fp32 main_grad);
* forward n runs on the output of :class:`_MapBack` (the same W_eff), whose inputs are the
  vectors forward 1 evaluated (not evaluated again); its backward adds the
  accumulator to its own gradient and maps the sum back to W and the vectors once, as autograd
  gradients: megatron-core's DDP hooks (and ``overlap_grad_reduce``'s bucket readiness) fire
  in the last micro-batch exactly as before.

Exact because W_eff is fixed within the step. Memory while a step runs: W_eff and an fp32
accumulator per folded weight (a per-micro-batch fold keeps neither). The same cycle serves the
scale vectors' own gamma (vectors.py ``ScaleVector.cache_per_step``: weights = the vector's
parameters, fold and unfold the identity). Off, so the caller folds
per micro-batch, when: ``ScaleVecConfig.fold_per_step`` is False, the micro-batch count is
unknown or 1, in eval or without grad, under activation recompute of these layers (a recompute
re-runs forwards), in ``fused.reference()``, or when nothing of the fold is trainable.

The count n: :func:`step` / :func:`begin_step` (our trainer and the test harness, once per
optimizer step), else megatron-core's ``num_microbatches_calculator`` when initialized. A cycle
that cannot be exact raises instead of losing gradients: a step ending (:func:`end_step`) or a
new one beginning with a cycle unfinished, a weight changed within a cycle (its version
counter), a cycle starting before the previous one was mapped back, a map back missing some of
the earlier micro-batches' gradients.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from megatron_scalevec.layers import fused

__all__ = ["FoldOps", "begin_step", "completed_cycles", "end_step", "num_microbatches", "step",
           "step_weight"]

_STATE = {"n": None}
_ACTIVE: weakref.WeakSet = weakref.WeakSet()  # cycles begun and not yet mapped back
_ATTR = "_scalevec_step_fold"
# Selective recompute that never re-runs a folded layer (norms, core attention, expert act).
_SAFE_RECOMPUTE = {"core_attn", "layernorm", "moe_act"}
# ... and for a norm's own vector (vectors.py): "layernorm" recompute re-runs the norms.
NORM_SAFE_RECOMPUTE = _SAFE_RECOMPUTE - {"layernorm"}


class FoldOps(NamedTuple):
    """A folded layer's pieces: ``fold(weights, vectors) -> W_eff`` and
    ``unfold(g, weights, vectors, needs) -> grads`` of (*weights, *vectors) from dL/dW_eff,
    ``needs`` flags which are wanted (None for the others)."""

    weights: tuple
    vectors: Callable[[], tuple]
    fold: Callable
    unfold: Callable


def begin_step(num_microbatches: int) -> None:
    """A new optimizer step of ``num_microbatches`` forward-backward passes begins."""
    if int(num_microbatches) < 1:
        raise ValueError(f"fold_cache.begin_step: num_microbatches must be >= 1, "
                         f"got {num_microbatches}")
    _check_none_active("a new optimizer step began")
    _STATE["n"] = int(num_microbatches)


def end_step() -> None:
    """The step's forward-backward passes are done: every cycle must have been mapped back."""
    _STATE["n"] = None
    _check_none_active("the optimizer step ended")


@contextlib.contextmanager
def step(num_microbatches: int):
    """``begin_step`` ... ``end_step`` around one step's forward-backward passes. On an error
    inside, every cycle in flight is dropped (that step's gradients are invalid anyway)."""
    begin_step(num_microbatches)
    try:
        yield
    except BaseException:
        for cycle in list(_ACTIVE):
            cycle.reset()
        _STATE["n"] = None
        raise
    end_step()


def num_microbatches() -> Optional[int]:
    """The current step's micro-batch count: ``begin_step``'s, else megatron-core's
    calculator when initialized, else None (unknown)."""
    if _STATE["n"] is not None:
        return _STATE["n"]
    from megatron.core import num_microbatches_calculator as calc  # noqa: PLC0415

    if getattr(calc, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None) is None:
        return None
    return int(calc.get_num_microbatches())


def completed_cycles(module) -> int:
    """How many once-per-step cycles of ``module`` were mapped back (0: it folded per
    micro-batch); the benchmark reads it to know which fold ran."""
    cycle = module.__dict__.get(_ATTR)
    return 0 if cycle is None else cycle.completed


def _check_none_active(when: str) -> None:
    if not _ACTIVE:
        return
    cycles = list(_ACTIVE)
    message = (f"fold once per step: {when} while {len(cycles)} folded weight(s) or vector(s) "
               f"had not mapped their gradients back (e.g. {cycles[0].name}: {cycles[0].seen} of "
               f"{cycles[0].n} forwards): the step ran fewer micro-batches than announced, so "
               f"gradients would be lost")
    for cycle in cycles:  # dropped, so the next step starts clean
        cycle.reset()
    raise RuntimeError(message)


def _recomputed(config, safe=_SAFE_RECOMPUTE) -> bool:
    granularity = getattr(config, "recompute_granularity", None)
    if granularity is None:
        return False
    modules = set(getattr(config, "recompute_modules", None) or ())
    return granularity == "full" or bool(modules - safe)


class _Cycle:
    """One layer's cycle of n training forwards (kept on the module, reused every step)."""

    def __init__(self, name: str):
        self.name, self.completed = name, 0
        self.reset()

    def reset(self) -> None:
        self.n = self.seen = self.arrived = 0
        self.w_eff = self.leaf = self.acc = None
        self.vectors: tuple = ()
        self.versions, self.pending = (), False
        _ACTIVE.discard(self)

    def start(self, n: int, weights: tuple, vectors: tuple, w_eff: torch.Tensor) -> None:
        self.reset()
        self.n, self.w_eff, self.vectors = n, w_eff, vectors
        self.versions = tuple(w._version for w in weights)
        self.leaf = w_eff.detach().requires_grad_()
        self.leaf.register_post_accumulate_grad_hook(self._collect)
        _ACTIVE.add(self)

    def _collect(self, leaf: torch.Tensor) -> None:
        self.acc = leaf.grad.float() if self.acc is None else self.acc.add_(leaf.grad)
        leaf.grad = None
        self.arrived += 1

    def check(self, n: Optional[int], weights: tuple) -> None:
        """Every forward: the step's micro-batch count is the cycle's. The last forward (before
        it builds the map back) also: the weights are those W_eff was folded from. Once is
        enough: a change shows there, before any gradient of the stale W_eff reaches a
        parameter (the earlier ones sit in the accumulator)."""
        if n != self.n:
            raise RuntimeError(f"{self._where()}: the micro-batch count changed to {n} within "
                               f"a step")
        if self.seen + 1 == self.n and tuple(w._version for w in weights) != self.versions:
            raise RuntimeError(f"{self._where()}: the weight changed within the step (an "
                               f"optimizer step inside the cycle?); the cached effective weight "
                               f"is stale")

    def _where(self) -> str:
        return f"fold once per step ({self.name}, after {self.seen} of {self.n} forwards)"


def step_weight(module, ops: FoldOps, *, scalevec=None, config=None,
                safe_recompute=_SAFE_RECOMPUTE) -> Optional[torch.Tensor]:
    """The effective weight for this forward of ``module`` under the fold once per step, or
    None: fold per micro-batch. ``module`` holds the cycle; ``scalevec`` and megatron-core's
    ``config`` default to its own attributes (a scale vector gets its owner's);
    ``safe_recompute``: the recompute modules that never re-run ``module``."""
    cycle = module.__dict__.get(_ATTR)
    scalevec = scalevec if scalevec is not None else module.scalevec
    config = config if config is not None else getattr(module, "config", None)
    on = torch.is_grad_enabled() and module.training and scalevec.fold_per_step \
        and not fused.use_reference() and not _recomputed(config, safe_recompute)
    n = num_microbatches() if on else None
    if n is None or n <= 1:
        if cycle is not None and cycle.seen:
            raise RuntimeError(f"fold once per step ({cycle.name}): a forward that folds per "
                               f"micro-batch (eval, no grad, or count {n}) inside a cycle, after "
                               f"{cycle.seen} of {cycle.n} forwards")
        return None
    if cycle is None:
        cycle = _Cycle(f"{type(module).__name__}{tuple(ops.weights[0].shape)}")
        module.__dict__[_ATTR] = cycle
    if cycle.seen == 0:
        if cycle.pending:
            raise RuntimeError(f"fold once per step ({cycle.name}): a cycle starts before the "
                               f"previous one's last backward ran (micro-batch count too low?)")
        vectors = ops.vectors()
        if not any(t is not None and t.requires_grad for t in (*ops.weights, *vectors)):
            return None  # nothing to train through the fold
        with torch.no_grad():
            w_eff = ops.fold(ops.weights, tuple(_detach(v) for v in vectors))
        cycle.start(n, ops.weights, vectors, w_eff)
    else:
        cycle.check(n, ops.weights)
    cycle.seen += 1
    if cycle.seen < cycle.n:
        return cycle.leaf
    cycle.seen, cycle.pending = 0, True
    return _MapBack.apply(cycle, ops.unfold, len(ops.weights), *ops.weights, *cycle.vectors)


def _detach(t):
    return None if t is None else t.detach()


class _MapBack(torch.autograd.Function):
    """Forward: the cycle's W_eff. Backward: (accumulated + this) gradient of W_eff mapped
    back to the weights and vectors, once per step."""

    @staticmethod
    def forward(ctx, cycle, unfold, n_weights, *tensors):
        ctx.cycle, ctx.unfold, ctx.n_weights = cycle, unfold, n_weights
        ctx.save_for_backward(*tensors)
        return cycle.w_eff.detach()

    @staticmethod
    def backward(ctx, grad):
        cycle, tensors = ctx.cycle, ctx.saved_tensors
        if cycle.arrived != cycle.n - 1:
            raise RuntimeError(f"fold once per step ({cycle.name}): the map back found "
                               f"{cycle.arrived} of the {cycle.n - 1} earlier micro-batches' "
                               f"gradients")
        g = cycle.acc.add_(grad)
        weights, vectors = tensors[:ctx.n_weights], tensors[ctx.n_weights:]
        grads = ctx.unfold(g, weights, vectors, ctx.needs_input_grad[3:])
        cycle.reset()
        cycle.completed += 1
        return (None, None, None, *grads)
