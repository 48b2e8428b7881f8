"""The fold, ``W_eff = diag(a) W diag(gamma)`` per slot: every folded linear's, in one place.

A folded weight's rows are ``[G, S, r]`` (groups, slots, rows per slot: layers/linear.py
``branch_layout``). Several experts' weights fold together along a leading expert axis ``E``;
one linear is ``E = 1``. Vectors: ``row`` ``[E, S, r]`` (DP's ``a``), ``col`` ``[E, S, in]``
(HG's ``gamma``), either None.

* :func:`fold` / :func:`fold_grads`: the product and its gradient map (``dW = G * scale`` and
  the vectors' sums of ``G * W``), with ``G = dL/dW_eff``.
* :class:`Fold`: ``W_eff`` with autograd that keeps only the weights (parameters) and the
  vectors, used by the TE linears and the grouped experts; layers/linear.py's local GEMM uses
  the same two functions around its own GEMM.
* :func:`release_until_backward`: a GEMM that keeps the folded weight it was given until its
  backward (Transformer Engine saves it and pins it on ``ctx``) would hold one weight-sized
  tensor per folded linear per micro-batch in flight. After that GEMM's forward the folded
  weight's storage is released, and it is refolded in place right before that GEMM's backward,
  as the local path rebuilds it there (same bytes, same values).
* Under Transformer Engine's FP8 (layers/te.py ``te_reads_weight``) a GEMM reads only its
  quantized copy: the fold runs only where TE quantizes the weight, and nothing is refolded
  for a backward that reads only FP8 copies (:class:`FoldedWeights` ``plan``); elsewhere TE
  gets an unread W_eff (:func:`unread`): its shape, dtype, device and autograd edge.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import torch

from megatron_scalevec import compile, steps
from megatron_scalevec.backward import on_backward


def _scale(row, col, dtype) -> torch.Tensor:
    """[E, 1, S, r|1, in|1]: ``a[r] * gamma[in]`` per slot (computed in float32)."""
    if col is None:
        return row[:, None, :, :, None].to(dtype)
    if row is None:
        return col[:, None, :, None, :].to(dtype)
    return (row[:, None, :, :, None] * col[:, None, :, None, :]).to(dtype)


def single(vec: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """One linear's slot vectors [S, n] with the expert axis (E = 1)."""
    return None if vec is None else vec[None]


def _shape(n_experts: int, layout: tuple, width: int) -> tuple:
    return (n_experts, *layout, width)


def fold(weights: Sequence[torch.Tensor], row, col, layout: tuple,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[E, out, in]: each weight folded with its expert's vectors (into ``out`` if given). One
    weight with one side's vectors: one multiply. Else one fused kernel body (compile.py,
    compiled with the weights' shapes): each weight read once,
    each expert's slice written once, no weight-sized scale in between. The slices go in as
    E separate tensors: one body writing every expert's slice of one output compiles to a chain
    of slice updates in which every element reads every expert's weight and the output's old
    values (torch 2.13's inductor); E inputs that do not overlap are written independently."""
    if out is None:
        out = weights[0].new_empty((len(weights), *weights[0].shape))
    if row is None and col is None:  # nothing to fold in: the weights stacked
        return torch.stack(list(weights), out=out)
    if len(weights) == 1 and (row is None or col is None):
        # one weight, one side (HG alone; DP alone): one broadcast multiply is already that
        # single pass, at a fraction of a compiled call's host cost
        (w,), shape = weights, _shape(1, layout, weights[0].shape[-1])
        torch.mul(w.view(shape), _scale(row, col, w.dtype), out=out.view(shape))
        return out
    compile.kernel(_fold_into, dynamic=False)(out.unbind(0), tuple(weights), row, col, layout)
    return out


def fold_columns(weight: torch.Tensor, gamma: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W diag(gamma)`` in ``dtype`` with autograd: a weight with one input-side vector and no
    branches (the router's gamma_r, layers/moe.py), small enough for autograd's own multiply."""
    return weight.to(dtype) * gamma.to(dtype)


def _fold_into(outs, weights, row, col, layout) -> None:
    scale, shape = _scale(row, col, weights[0].dtype), _shape(1, layout, weights[0].shape[-1])[1:]
    for e, (o, w) in enumerate(zip(outs, weights)):
        o.view(shape).copy_(w.view(shape) * scale[e])


def fold_grads(grad: torch.Tensor, weights: Sequence[torch.Tensor], row, col, layout: tuple,
               needs: tuple) -> tuple:
    """(dW per expert, d row, d col) from ``grad`` = dL/dW_eff [E, out, in] (``needs``: which
    of the three); dW in the weights' dtype (``grad`` may be a float32 accumulation). Compiled
    by compile.py, with the weights' static shapes (the products fused)."""
    return compile.kernel(_fold_grads, dynamic=False)(grad, tuple(weights), row, col, layout,
                                                      needs)


def _fold_grads(grad, weights, row, col, layout, needs) -> tuple:
    n, width = len(weights), weights[0].shape[-1]
    g = grad.reshape(_shape(n, layout, width))
    dw = None
    if needs[0]:
        dw = (g * _scale(row, col, g.dtype)).to(weights[0].dtype)
        dw = dw.view(n, *weights[0].shape).unbind(0)
    d_row = d_col = None
    if (row is not None and needs[1]) or (col is not None and needs[2]):
        w = torch.stack(weights).view_as(g)
        p = (g.float() * w.float()).sum(1)  # [E, S, r, in]: summed over the groups
        if row is not None and needs[1]:
            d_row = (p * col[:, :, None, :]).sum(3) if col is not None else p.sum(3)
        if col is not None and needs[2]:
            d_col = (p * row[..., None]).sum(2) if row is not None else p.sum(2)
    return dw, d_row, d_col


def unread(weights: Sequence[torch.Tensor], stacked: bool = True):
    """W_eff where its values are never read ([E, out, in], or one per weight): zero-stride
    views of one uninitialized element, so no weight-sized memory or pass; shape, dtype and
    device as the fold's (what Transformer Engine's FP8 forward and backward use of a weight
    whose quantized copy they read, checked on TE 2.11 and 2.17.1)."""
    one = weights[0].new_empty(())
    if stacked:
        return one.expand(len(weights), *weights[0].shape)
    return tuple(one.expand(w.shape) for w in weights)


class Fold(torch.autograd.Function):
    """:func:`fold` with autograd, keeping only the vectors and the weights (the parameters
    themselves) for backward, where :func:`fold_grads` maps the gradient back."""

    @staticmethod
    def forward(ctx, row, col, layout, *weights):
        ctx.layout = layout
        ctx.save_for_backward(row, col, *weights)
        return fold(weights, row, col, layout)

    @staticmethod
    def backward(ctx, grad):
        row, col, *weights = ctx.saved_tensors
        needs = (any(ctx.needs_input_grad[3:]), *ctx.needs_input_grad[:2])
        dw, d_row, d_col = fold_grads(grad, weights, row, col, ctx.layout, needs)
        return (d_row, d_col, None, *(dw if dw is not None else [None] * len(weights)))


class _FoldUnread(Fold):
    """:class:`Fold`'s gradient map for a GEMM that reads only the weight's quantized copy: the
    forward computes nothing (:func:`unread`)."""

    @staticmethod
    def forward(ctx, row, col, layout, *weights):
        ctx.layout = layout
        ctx.save_for_backward(row, col, *weights)
        return unread(weights)


class _FoldOncePerStep(torch.autograd.Function):
    """:func:`fold` of E weights [out, in] (one output each) for GEMMs whose ``G = dL/dW_eff``
    is summed in each W's ``main_grad`` over the step: by the GEMM itself (Transformer Engine's
    fused wgrad accumulation, given ``W_eff`` carrying W's ``main_grad``; its gradient here is
    then a placeholder) or, with fusion off, added here. The step's last micro-batch maps each
    ``main_grad`` in place (:class:`StepMap`). ``step``: (mode, StepMap, fused); vectors
    [E, S, n]."""

    @staticmethod
    def forward(ctx, row, col, layout, step, stacked, read, *weights):
        ctx.layout, ctx.step, ctx.stacked = layout, step, stacked
        ctx.save_for_backward(row, col, *weights)
        if not read:  # the GEMM reads only its quantized copy (unread)
            return unread(weights, stacked)
        out = fold(weights, row, col, layout)
        return out if stacked else tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        row, col, *weights = ctx.saved_tensors
        mode, step_map, fused_accumulation = ctx.step
        if ctx.stacked:
            grads = grads[0].unbind(0)
        if not fused_accumulation:  # one launch for every expert
            torch._foreach_add_([w.main_grad for w in weights], list(grads))
        step_map.accumulated = True
        d_row = d_col = None
        if mode == "map":
            parts = [map_in_place(w.main_grad, w, None if row is None else row[e],
                                  None if col is None else col[e], ctx.layout,
                                  ctx.needs_input_grad[:2]) for e, w in enumerate(weights)]
            d_row, d_col = (None if p[0] is None else torch.stack(p) for p in zip(*parts))
            step_map.mapped = True
        # each W's gradient is in its main_grad (megatron-core's fused path: W keeps
        # grad_added_to_main_grad set, so DDP ignores this placeholder)
        return (d_row, d_col, None, None, None, None, *(_placeholder(w) for w in weights))


def _step_vectors(mode: str, row, col) -> tuple:
    """The vectors a micro-batch's fold reads: detached but on the step's last micro-batch,
    whose map gives them their whole step's gradient."""
    if mode == "map":
        return row, col
    return tuple(None if v is None else v.detach() for v in (row, col))


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """A weight-shaped gradient nobody reads: allocated, never written (as megatron-core's
    fused path; autograd would copy a broadcast one into a weight-sized tensor anyway)."""
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


class _Held:
    """A folded weight a GEMM keeps until its backward: released after the forward, refolded
    in place (same storage, same values) before the backward."""

    def __init__(self, w_eff, weights, row, col, layout):
        self.w_eff, self.nbytes = w_eff, w_eff.untyped_storage().nbytes()
        self.weights = [w.detach() for w in weights]
        self.row = None if row is None else row.detach()
        self.col = None if col is None else col.detach()
        self.layout = layout

    def release(self) -> None:
        self.w_eff.untyped_storage().resize_(0)

    @torch.no_grad()
    def refold(self) -> None:
        storage = self.w_eff.untyped_storage()
        if storage.nbytes() == self.nbytes:
            return  # refolded already (a GEMM that kept it twice)
        storage.resize_(self.nbytes)
        # .data: a view with its own version counter, so the in-place refill is not seen as a
        # modification of the tensor autograd saved
        fold(self.weights, self.row, self.col, self.layout, out=self.w_eff.data)


def _refold(held: list, grad: torch.Tensor) -> torch.Tensor:
    """The backward of a GEMM's output (which runs before the GEMM's: it makes the GEMM's
    output gradient): the held weights refolded first."""
    for h in held:
        h.refold()
    return grad


class FoldedWeights:
    """Folds for one module's forward; :meth:`release_until_backward` then frees what they
    made until the backward (outside a grad-enabled forward nothing is held)."""

    def __init__(self):
        self.held: Optional[list] = None
        self.read = self.refold = True

    def plan(self, read: bool, refold: bool) -> FoldedWeights:
        """For the next forward: whether its GEMM reads the folded values (else :func:`unread`)
        and whether its backward does (else released and never refolded)."""
        self.read, self.refold = read, refold
        return self

    def __enter__(self):
        self.held = [] if torch.is_grad_enabled() else None
        return self

    def __exit__(self, *exc):
        self.held = None
        self.read = self.refold = True

    def __call__(self, weights, row, col, layout) -> torch.Tensor:
        """[E, out, in] folded weights with autograd (:class:`Fold`)."""
        if not self.read:
            return _FoldUnread.apply(row, col, layout, *weights)
        return self._held(Fold.apply(row, col, layout, *weights), weights, row, col, layout)

    def stack(self, weights) -> torch.Tensor:
        """[E, out, in]: the weights stacked with autograd, for a GEMM that saves its weight
        (a grouped GEMM over experts' separate weights): released and restacked likewise."""
        return self._held(torch.stack(list(weights)), weights, None, None, None)

    def stacked_once_per_step(self, weights, row, col, layout, step) -> torch.Tensor:
        """[E, out, in]: :meth:`once_per_step` as one stacked tensor, for a grouped GEMM whose
        ``G`` the fold's backward adds to each W's ``main_grad``."""
        row, col = _step_vectors(step[0], row, col)
        w_eff = _FoldOncePerStep.apply(row, col, layout, (*step, False), True, True, *weights)
        return self._held(w_eff, weights, row, col, layout)

    def once_per_step(self, weights, row, col, layout, step) -> list:
        """E weights [out, in] folded for GEMMs that accumulate ``G`` into each
        ``W.main_grad`` themselves (each ``W_eff`` carries its W's), or whose ``G`` is added
        there (:class:`_FoldOncePerStep`); ``step``: (mode, StepMap, fused), vectors
        [E, S, n]."""
        row, col = _step_vectors(step[0], row, col)
        w_effs = _FoldOncePerStep.apply(row, col, layout, step, False, self.read, *weights)
        if self.read and self.held is not None and w_effs[0].requires_grad:
            # their storage: one [E, out, in]
            self.held.append(_Held(w_effs[0]._base, weights, row, col, layout))
        for w, w_eff in zip(weights, w_effs):
            w_eff.main_grad = w.main_grad
            w_eff.grad_added_to_main_grad = False  # megatron-core's DDP protocol
        return list(w_effs)

    def _held(self, w_eff, weights, row, col, layout) -> torch.Tensor:
        if self.held is not None and w_eff.requires_grad:
            self.held.append(_Held(w_eff, weights, row, col, layout))
        return w_eff

    def release_until_backward(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the GEMM's output) through the refold point; the folded weights released."""
        held, self.held = self.held, [] if self.held is not None else None
        if not held or not out.requires_grad:
            return out
        if self.refold:
            out = on_backward(out, functools.partial(_refold, held))
        for h in held:
            h.release()
        return out


# ---------------------------------------------------------------- the map, once per step

class StepMap:
    """When a folded linear maps its gradient: every micro-batch (``None``), or once per
    optimizer step. Every term of the map is linear in ``G = dL/dW_eff`` and the vectors do not
    change within a step, so the GEMM accumulates ``G`` into W's ``main_grad`` on every
    micro-batch (``"accumulate"``) and the step's last micro-batch maps the sum in place
    (``"map"``), before DDP reduces W's or the vectors' buckets, both of which get their
    gradients in that backward. Step boundaries and the count: megatron_scalevec/steps.py (W
    keeps ``grad_added_to_main_grad`` set: its gradient never goes through ``.grad``). Without
    megatron-core's DDP (no ``main_grad``) or without a calculator, every micro-batch maps its
    own gradient."""

    def __init__(self):
        self.seen = 0
        self.accumulated = self.mapped = False  # set by the linear's backward

    def mode(self, weight: torch.Tensor, *others: torch.Tensor) -> Optional[str]:
        """For a training forward of the linear with ``weight`` (and the ``others`` folded with
        it, e.g. a grouped linear's experts)."""
        n = steps.per_step(weight)
        if n is None:
            return None
        if steps.new_step(weight):
            if self.accumulated and not self.mapped:
                raise steps.never_closed("a folded linear", self.seen, n)
            self.seen, self.accumulated, self.mapped = 0, False, False
            steps.start([weight, *others])  # G goes to main_grad, never through .grad
        self.seen += 1
        if self.seen > n:
            raise steps.over_count("a folded linear", self.seen, n)
        return "map" if self.seen == n else "accumulate"


def accumulate_wgrad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += dy^T x`` ([out, in]), as megatron-core's gradient-accumulation fusion:
    APEX's ``wgrad_gemm_accum_*`` on CUDA where installed, else a GEMM with accumulate when the
    dtypes agree, else the product in the activations' dtype added."""
    if main_grad.is_cuda and _APEX is not None and main_grad.dtype == torch.float32:
        _APEX.wgrad_gemm_accum_fp32(x, dy, main_grad)
    elif main_grad.dtype == dy.dtype:
        main_grad.addmm_(dy.t(), x)
    else:
        main_grad.add_(dy.t().matmul(x))


def map_in_place(main_grad: torch.Tensor, weight: torch.Tensor, row, col, layout: tuple,
                 needs: tuple) -> tuple:
    """The step's ``G`` in ``main_grad`` [out, in] mapped in place to ``dW = G * scale``;
    returns (d row, d col) [S, n] (``needs``: which), one linear's vectors. One fused kernel
    body (compile.py; compiled with the weight's static shape): G and W read once, G
    written once."""
    d_row, d_col, _ = compile.kernel(_map, dynamic=False)(main_grad, weight, single(row),
                                                           single(col), layout, needs)
    return (None if d_row is None else d_row[0]), (None if d_col is None else d_col[0])


def _map(main_grad, weight, row, col, layout, needs) -> tuple:
    _, d_row, d_col = _fold_grads(main_grad[None], (weight,), row, col, layout, (False, *needs))
    g = main_grad.view(_shape(1, layout, weight.shape[-1]))
    g.mul_(_scale(row, col, g.dtype))  # after the sums, which read G unscaled
    return d_row, d_col, main_grad  # main_grad: written (what a fused kernel's traffic counts)


try:  # APEX's fused wgrad accumulation (megatron-core's gradient_accumulation_fusion kernel)
    import fused_weight_gradient_mlp_cuda as _APEX  # noqa: N811
except ImportError:
    _APEX = None
