"""Column-parallel projections that carry per-branch scale vectors (HG input side, DP output).

A fused projection (``linear_qkv``, ``linear_fc1``) holds several branches. Its local output
rows are viewed as ``[G, S, r]``: ``G`` groups, ``S`` slots per group, ``r`` rows per slot,
and every slot belongs to one branch:

* qkv: ``G`` = local query groups, slots = ``[q] * heads_per_group + [k, v]``, ``r`` = head
  dim (megatron-core's interleaved GQA layout). Output vectors are ``R^head_dim``, shared by
  the heads of a branch (reading), so they are replicated over TP. With
  ``attention_output_gate`` megatron-core puts the gate rows after the queries,
  ``[q] * hpg + [gate] * hpg + [k, v]``: the gate is a branch of its own (its own HG
  vector, and a DP output vector before the sigmoid, foldable like the others); DNP does not
  normalize it (layers/attention.py normalizes q, k, v only).
* fc1 (GLU): ``G = 1``, slots = ``[gate, up]``, ``r`` = local FFN width; output vectors are
  ``R^ffn`` and split with the columns. Non-gated: slots = ``[up]``.

The effective map is ``diag(a_slot) W_slot diag(gamma_slot)`` (SPEC.md's unified view). Two
ways to apply it, chosen by ``ScaleVecConfig.apply_mode``:

* ``weight``: build that effective weight (one pass over out x in) and run one GEMM. Default
  for megatron-core's local linears. The effective weight is never kept for backward (it would
  be weight-sized memory per micro-batch in flight): ``_FoldedLinear`` keeps W and the vectors
  and rebuilds it in backward, so nothing weight-sized outlives the micro-batch.
  Under megatron-core's DDP with its micro-batch calculator set up, the wgrad GEMM accumulates
  ``G = dL/dW_eff`` into W's ``main_grad`` and the map back to W and the vectors runs once per
  optimizer step (layers/fold.py ``StepMap``); elsewhere every micro-batch maps its own.
* ``activation``: scale the input by each branch's gamma, run the linear (one GEMM per
  distinct input vector), keep that branch's rows, then scale by ``a``. It never touches the
  weight, so it works for linears that own their weight (Transformer Engine, FP8).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.layers import fold
from megatron_scalevec.layers.expert_vectors import Borrowed, uses_shared_vectors, vectors_of
from megatron_scalevec.vectors import (
    branch_vectors,
    has_branch_vectors,
    sharded_vectors,
    stacked,
)


def branch_layout(branches: str, config, out_local: int) -> tuple:
    """(G, slot branch names, r) of a fused projection's local rows."""
    if branches == "qkv":
        tp = config.tensor_model_parallel_size
        if config.num_query_groups is None:
            raise ValueError("scale vectors need config.num_query_groups set")
        if config.num_query_groups < tp:
            raise ValueError(
                f"scale vectors on linear_qkv need num_query_groups ({config.num_query_groups}) "
                f">= tensor_model_parallel_size ({tp}): each rank must own whole query groups")
        groups = config.num_query_groups // tp
        hpg = config.num_attention_heads // config.num_query_groups
        gate = ["gate"] * hpg if getattr(config, "attention_output_gate", False) else []
        slots = ["q"] * hpg + gate + ["k", "v"]
        return groups, slots, out_local // (groups * len(slots))
    if branches == "fc1":
        slots = ["gate", "up"] if config.gated_linear_unit else ["up"]
        return 1, slots, out_local // len(slots)
    raise ValueError(f"unknown branch layout {branches!r} (expected 'qkv' or 'fc1')")


def check_dp_bias(scalevec: ScaleVecConfig, has_bias: bool,
                  fix: str = "set add_bias_linear=False") -> None:
    """DP's ``a`` scales a branch's rows in the fold, which a bias added after the GEMM would
    escape: refused for every branched linear (local, TE, TE grouped)."""
    if scalevec.dp and has_bias:
        raise ValueError(f"DP output-side vectors with a linear bias are not supported: {fix}")


def branch_declarations(user):
    """What ``user`` (a branched projection, or what holds its vectors) declares
    (declared.py): HG's gamma on each branch's input columns, DP's ``a`` on its output rows;
    borrowed under ``expert_vectors='shared'``."""
    vectors, owned = vectors_of(user), user.vectors_from is None
    for side, dict_name in (("in", "scale_in"), ("out", "scale_out")):
        for b, vec in getattr(vectors, dict_name).items():
            yield Declared(f"{dict_name}.{b}", vec, vec.role, side, user, b, owned)


def _fold_one(weight, row, col, layout) -> torch.Tensor:
    """diag(row) W diag(col) per slot, outside autograd (layers/fold.py, E = 1)."""
    return fold.fold([weight], fold.single(row), fold.single(col), layout)[0]


class _FoldedLinear(torch.autograd.Function):
    """``x @ (diag(row) W diag(col))^T (+ bias)`` with megatron-core's column-parallel
    communication (sequence-parallel gather of x, all-reduce or reduce-scatter of its gradient).

    Keeps x (this rank's shard under SP, as megatron-core does), W and the vectors; backward
    rebuilds the effective weight (one more pass over out x in) and maps its gradient back
    (layers/fold.py ``fold_grads``).
    """

    @staticmethod
    def forward(ctx, x, weight, row, col, bias, layout, allreduce_dgrad, sequence_parallel,
                tp_group, step=None):
        w_eff = _fold_one(weight, row, col, layout)
        total = sharding.gather_tokens(x, tp_group) if sequence_parallel else x
        out = torch.matmul(total, w_eff.t())
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x, weight, row, col)
        ctx.layout, ctx.has_bias = layout, bias is not None
        ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = (
            allreduce_dgrad, sequence_parallel, tp_group)
        ctx.step = step  # (mode, fold.StepMap) or None
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, row, col = ctx.saved_tensors
        w_eff = _fold_one(weight, row, col, ctx.layout)
        total = sharding.gather_tokens(x, ctx.tp_group) if ctx.sequence_parallel else x
        dx = dy.matmul(w_eff)
        del w_eff
        if ctx.allreduce_dgrad:
            sharding.sum_in_place(dx, ctx.tp_group)
        if ctx.sequence_parallel:
            dx = sharding.reduce_scatter_tokens(dx, ctx.tp_group)
        dy2 = dy.reshape(-1, dy.shape[-1])
        total2 = total.reshape(-1, total.shape[-1])
        d_bias = dy2.sum(0) if ctx.has_bias else None
        if ctx.step is not None:  # G into main_grad; mapped once per step (fold.StepMap)
            fold.accumulate_wgrad(weight.main_grad, dy2, total2)
            ctx.step[1].accumulated = True
            d_row = d_col = None
            if ctx.step[0] == "map":
                d_row, d_col = fold.map_in_place(weight.main_grad, weight, row, col, ctx.layout,
                                                 ctx.needs_input_grad[2:4])
                ctx.step[1].mapped = True
            # megatron-core's fused path: a placeholder gradient, already in main_grad
            d_w = torch.empty(weight.main_grad.shape, dtype=dy.dtype, device=dy.device)
            return dx, d_w, d_row, d_col, d_bias, None, None, None, None, None
        g_eff = dy2.t().matmul(total2)  # [out, in]
        d_w, d_row, d_col = fold.fold_grads(g_eff, [weight], fold.single(row),
                                            fold.single(col), ctx.layout,
                                            ctx.needs_input_grad[1:4])
        d_w = d_w[0] if d_w is not None else None
        d_row, d_col = (None if d is None else d[0] for d in (d_row, d_col))
        return dx, d_w, d_row, d_col, d_bias, None, None, None, None, None


class ScaleVecLinearMixin:
    """The vector math of a branched column-parallel projection; any linear class below it."""

    def _init_scale_vectors(self, scalevec: ScaleVecConfig, branches: str, config,
                            in_size: int, out_local: int, is_expert: bool, tp_group,
                            mode: str, weight=None):
        """``weight``: the weight an expert's vectors copy ``allreduce`` from (``self.weight``
        unless given). A routed expert under ``expert_vectors='shared'`` builds no vectors: it
        is lent its layer's (layers/expert_vectors.py)."""
        self.scalevec = scalevec
        self.scalevec_mode = mode
        self._scale_in_size = in_size
        self.groups, self.slots, self.rows = branch_layout(branches, config, out_local)
        names = list(dict.fromkeys(self.slots))
        weight = weight if weight is not None else getattr(self, "weight", None)
        expert_allreduce = getattr(weight, "allreduce", True) if is_expert else None
        bias = getattr(self, "bias", None)  # TE keeps an empty tensor when bias=False
        check_dp_bias(scalevec, bias is not None and bias.numel() > 0,
                      "set add_bias_linear=False / add_qkv_bias=False")
        if scalevec.hg and scalevec.vectors and mode == "activation":
            for name in names:  # [S, 1]: keeps this branch's rows of a full-width output
                mask = torch.tensor([[float(slot == name)] for slot in self.slots])
                self.register_buffer(f"_slot_mask_{name}", mask, persistent=False)
        self._has_vectors = has_branch_vectors(scalevec)
        self._step_slots: dict = {}  # _slot_stack's once-per-step results
        self.vectors_from = Borrowed() if uses_shared_vectors(scalevec, is_expert) else None
        if self.vectors_from is not None:
            return  # lent by the layer's ExpertSharedVectors
        in_place = sharding.placement(
            "input_folded" if mode == "weight" else
            "input_activation_expert" if is_expert else "input_activation", config, tp_group)
        out_place = sharding.placement(f"{branches}_output", config, tp_group)
        self.scale_in, self.scale_out = branch_vectors(
            scalevec, config, names, (in_size, in_place), (self.rows, out_place),
            expert_allreduce)

    @property
    def has_scale_vectors(self) -> bool:
        return self._has_vectors

    def named_scale_vectors(self):
        """Its branch vectors (declared.py :func:`branch_declarations`)."""
        yield from branch_declarations(self)

    def _slot_stack(self, vectors: torch.nn.ModuleDict, width: int,
                    step: Optional[str] = None) -> Optional[torch.Tensor]:
        """[S, width] gamma per slot (ones for a branch without vector), None if no vector.
        ``step == "accumulate"`` (a micro-batch whose fold gets no vector gradient): detached,
        and built once per step: the vectors give the same tensor all step (vectors.py)."""
        if len(vectors) == 0:
            return None
        # one projection's vectors are alike (same size, parameterization, placement): one
        # batched evaluation (vectors.stacked) rather than one per branch
        vecs = list(vectors.values())
        src = stacked(vecs) if len(vecs) > 1 else vecs[0]()
        if step == "accumulate":
            # the same tensor, unchanged in place since (a parameter returned as is may be):
            # Tensor._version, torch's private in-place counter (checked on torch 2.13.0)
            kept = self._step_slots.get(id(vectors))
            if kept is not None and kept[0] is src and kept[1] == src._version:
                return kept[2]
        values = src.unbind(0) if len(vecs) > 1 else [src]
        per_branch = dict(zip(vectors.keys(), values))
        ref = next(iter(per_branch.values()))
        ones = None
        rows: list[torch.Tensor] = []
        for name in self.slots:
            g = per_branch.get(name)
            if g is None:
                ones = ones if ones is not None else ref.new_ones(width)
                g = ones
            rows.append(g)
        if step != "accumulate":
            return torch.stack(rows)
        out = torch.stack(rows).detach()
        self._step_slots[id(vectors)] = (src, src._version, out)
        return out

    def fold_vectors(self, step: Optional[str] = None):
        """(row [S, r] or None, col [S, in] or None): the slot vectors of the fold, for a
        micro-batch of ``step`` mode (fold.StepMap: detached on an accumulating one)."""
        vectors = vectors_of(self)
        return (self._slot_stack(vectors.scale_out, self.rows, step),
                self._slot_stack(vectors.scale_in, self._scale_in_size, step))

    @property
    def fold_layout(self) -> tuple:
        return self.groups, len(self.slots), self.rows

    def effective_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """diag(a) W diag(gamma) per slot, as one [out, in] tensor (with autograd)."""
        row, col = self.fold_vectors()
        if row is None and col is None:
            return weight
        return fold.Fold.apply(fold.single(row), fold.single(col), self.fold_layout, weight)[0]

    def _activation_forward(self, x: torch.Tensor, call):
        """Activation-side application around any linear ``call(x) -> (out, bias)``."""
        vectors = vectors_of(self)
        if len(vectors.scale_in) == 0:
            out, bias = call(x)
        else:
            out = None
            bias = None
            shape = None
            for name, vec in vectors.scale_in.items():
                y, bias = call(x * vec().to(x.dtype))
                shape = y.shape
                y = y.view(*shape[:-1], self.groups, len(self.slots), self.rows)
                part = y * getattr(self, f"_slot_mask_{name}").to(y.dtype)
                out = part if out is None else out + part
            out = out.view(shape)
        if len(vectors.scale_out) > 0:
            row = self._slot_stack(vectors.scale_out, self.rows).to(out.dtype)
            out = (out.view(*out.shape[:-1], self.groups, len(self.slots), self.rows) * row)
            out = out.flatten(-3)
        return out, bias

    def scale_vector_sharded_state_dict(self, sd, prefix, sharded_offsets, metadata):
        """Replace the generic entries of our vectors by their own (split-aware) ones; lent
        vectors (MoE ``expert_vectors='shared'``) are saved by their owner."""
        generic = (f"{prefix}scale_in.", f"{prefix}scale_out.")
        sd = {k: v for k, v in sd.items() if not k.startswith(generic)}
        sd.update(sharded_vectors(branch_declarations(self), prefix, sharded_offsets, metadata))
        return sd


class ScaleVecColumnParallelLinear(ScaleVecLinearMixin, ColumnParallelLinear):
    """megatron-core's local ColumnParallelLinear with per-branch scale vectors.

    Built by megatron-core with the usual linear arguments; ``scalevec`` and ``branches``
    come from the spec (a ``functools.partial`` or ``ModuleSpec.params``).
    """

    def __init__(self, input_size, output_size, *, scalevec: ScaleVecConfig, branches: str,
                 config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        mode = scalevec.resolve_apply_mode(local_linear=True)
        self._init_scale_vectors(scalevec, branches, config, input_size,
                                 self.output_size_per_partition, self.is_expert,
                                 self.tp_group, mode)
        self._step_map = fold.StepMap()
        if self.has_scale_vectors and mode == "weight":
            # megatron-core's fused wgrad accumulation would multiply the effective weight's
            # input; ours accumulates G = dL/dW_eff into main_grad itself (fold.StepMap)
            self.gradient_accumulation_fusion = False

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.has_scale_vectors:
            return super().forward(input_, weight, runtime_gather_output)
        if self.scalevec_mode == "weight":
            return super().forward(input_, weight, runtime_gather_output)  # -> _forward_impl
        return self._activation_forward(
            input_, lambda x: super(ScaleVecColumnParallelLinear, self).forward(
                x, weight, runtime_gather_output))

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                      wgrad_deferral_limit=None, tp_group=None, **kwargs):
        """megatron-core's GEMM call, with the vectors folded in (weight mode)."""
        if not self.has_scale_vectors or self.scalevec_mode != "weight":
            return super()._forward_impl(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group=tp_group,
                **kwargs)
        if grad_output_buffer is not None:
            raise NotImplementedError("deferred wgrad compute with folded scale vectors")
        mode = self._step_map.mode(weight)
        row, col = self.fold_vectors(mode)  # accumulate: the vector gradient comes with the map
        return _FoldedLinear.apply(input, weight, row, col, bias, self.fold_layout,
                                   allreduce_dgrad, sequence_parallel, tp_group,
                                   None if mode is None else (mode, self._step_map))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self.scale_vector_sharded_state_dict(sd, prefix, sharded_offsets, metadata)
