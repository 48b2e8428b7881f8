"""Grouped-GEMM experts without Transformer Engine, on ``torch.nn.functional.grouped_mm``.

:class:`ScaleVecGroupedMLP` holds exactly the experts of :class:`ScaleVecSequentialMLP` (same
modules, parameters, names, init and ``sharded_state_dict``), so a checkpoint, an optimizer
rule or a converter sees no difference; only ``forward`` changes. Per forward:

* the fc1 weights of the local experts are folded with every expert's vectors in one
  batched operation: ``W1_eff[e] = diag(a^e) W1[e] diag(gamma^e)`` per slot (gate / up), the
  OR / ER parameterizations of all experts evaluated at once (:func:`stacked_gamma`);
* ``h = grouped_mm(x, W1_eff)`` over the tokens sorted by expert (``offs`` = cumulative ends);
* DNP and the GLU in one lean pass (layers/glu.py ``glu_norm`` with per-row vectors): the
  scale-free norm over each token's FFN width (all-reduced over expert TP when split), its
  expert's output vector, the activation; then the router probabilities,
  ``out = grouped_mm(h, W2)``.

The expert linears are local GEMMs (the dispatcher does the expert-TP / EP communication), so
this is the same computation as the per-expert loop, in two GEMMs. megatron-core 0.16.1 has
no grouped experts without TE or nv-grouped-gemm, so the ``stock`` baseline stays sequential.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron_scalevec import sharding
from megatron_scalevec.backward import on_backward
from megatron_scalevec.layers import fold, glu
from megatron_scalevec.layers.expert_vectors import vectors_of
from megatron_scalevec.layers.fold import Fold
from megatron_scalevec.layers.moe import ScaleVecSequentialMLP
from megatron_scalevec.vectors import stacked

__all__ = ["Fc1View", "ScaleVecGroupedMLP", "expert_norm_vectors", "experts_glu_norm",
           "fold_vectors", "grouped_mm_available", "grouped_linear", "probs_on_input",
           "stacked_forward_weight", "stacked_gamma"]

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    """True when this torch has a grouped GEMM (public in 2.13, ``torch._grouped_mm`` 2.8+)."""
    return _GROUPED_MM is not None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` for every group e. x [T, in], weight [E, out, in],
    offs [E] int32 cumulative row ends (offs[-1] == T). Its gradient made contiguous:
    grouped_mm's backward refuses expanded (stride-0) gradients such as that of ``out.sum()``."""
    out = _GROUPED_MM(x.contiguous(), weight.transpose(-2, -1), offs=offs)
    return on_backward(out, torch.Tensor.contiguous)


def probs_on_input(config, x: torch.Tensor, probs: torch.Tensor) -> tuple:
    """(x, probs) under megatron-core's ``moe_apply_probs_on_input`` (top-1 only): the router
    probabilities ([T] or [T, 1]) scale the input rows, and ones replace them after the GEMMs;
    unchanged otherwise. Local and TE grouped experts alike."""
    if not config.moe_apply_probs_on_input:
        return x, probs
    if config.moe_router_topk != 1:
        raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
    rows = probs if probs.dim() == x.dim() else probs.unsqueeze(-1)
    return (rows * x).to(x.dtype), torch.ones_like(probs)


def stacked_gamma(vectors: list) -> Optional[torch.Tensor]:
    """[E, m] float32: the gamma of E alike vectors (one per expert) computed as one batched
    operation (vectors.py ``stacked``). One vector object used E times
    (``expert_vectors='shared'``) is computed once and expanded."""
    v0 = vectors[0]
    if not v0.enabled:
        return None
    if all(v is v0 for v in vectors):
        return v0().expand(len(vectors), -1)  # a norm's gamma too (called without input)
    return stacked(vectors)


def _slot_stack(fc1, side: str, width: int) -> Optional[torch.Tensor]:
    """[E, S, width]: each expert's ``side`` (scale_in / scale_out) vector per slot of fc1
    (ones where a branch has none)."""
    per_expert = [getattr(vectors_of(e), side) for e in fc1.experts]
    names = list(per_expert[0])
    if not names:
        return None
    per_branch = {n: stacked_gamma([vectors[n] for vectors in per_expert]) for n in names}
    ref = next(iter(per_branch.values()))
    ones = ref.new_ones(ref.shape[0], width)
    return torch.stack([per_branch.get(n, ones) for n in fc1.slots], dim=1)


def fold_vectors(fc1: Fc1View, width: int) -> tuple:
    """(row [E, S, r] or None, col [E, S, in] or None): every expert's fc1 vectors per slot,
    each branch of all experts evaluated as one batched operation."""
    return _slot_stack(fc1, "scale_out", fc1.rows), _slot_stack(fc1, "scale_in", width)


def stacked_forward_weight(fc1: Fc1View, weights, folds=None) -> torch.Tensor:
    """[E, out, in] folded fc1 weights of the experts ``fc1``, with autograd; only the
    vectors are kept for backward (layers/fold.py ``Fold``; ``folds``: a
    ``fold.FoldedWeights`` that holds them for release)."""
    row, col = fold_vectors(fc1, weights[0].shape[-1])
    if folds is not None:
        return folds(weights, row, col, fc1.layout)
    return Fold.apply(row, col, fc1.layout, *weights)


def expert_norm_vectors(experts, config) -> tuple:
    """(a_g or None, a_u), each [E, f]: the DNP vectors the experts use (``gate_norm`` and
    ``up_norm``, layers/expert_vectors.py ``vectors_of``)."""
    norms = [vectors_of(e) for e in experts]
    ups = [n.up_norm for n in norms]
    if not config.gated_linear_unit:
        return None, stacked_gamma(ups)
    gates = [n.gate_norm for n in norms]
    if not ups[0].enabled or all(v is ups[0] for v in ups):  # none, or one shared by all
        return stacked_gamma(gates), stacked_gamma(ups)
    both = stacked(gates + ups)  # one batched evaluation of all 2E alike vectors
    return both[:len(experts)], both[len(experts):]


def experts_glu_norm(h, a_g, a_u, norm, config, rows: glu.ExpertRows) -> torch.Tensor:
    """DNP and the GLU over rows sorted by expert, each row with its expert's vectors (the lean
    fused pass of layers/glu.py); ``norm``: one expert's norm, for its normalization, epsilon
    and split group."""
    return glu.glu_norm(h, a_g, a_u, config.activation_func, gated=config.gated_linear_unit,
                        normalization=norm.normalization, eps=norm.eps, group=norm.split_group,
                        width=norm.global_size, experts=rows)


class Fc1View:
    """The experts' fc1 vectors (``experts``: each expert's fc1, or what holds its vectors in
    a TE grouped linear: te_grouped.py ``ExpertFc1Vectors``) and their layout, alike across
    experts; each expert's vectors are read through ``vectors_of(expert)``."""

    def __init__(self, experts):
        self.experts = list(experts)
        first = self.experts[0]
        self.groups, self.slots, self.rows = first.groups, first.slots, first.rows
        self.layout = (self.groups, len(self.slots), self.rows)  # layers/fold.py's
        self.has_scale_vectors = first.has_scale_vectors


class ScaleVecGroupedMLP(ScaleVecSequentialMLP):
    """The local experts of ScaleVecSequentialMLP run as two grouped GEMMs (see module doc)."""

    _grouped = True

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None, *,
                 scalevec):
        if not grouped_mm_available():
            raise RuntimeError(f"grouped experts need torch.nn.functional.grouped_mm (torch "
                               f">= 2.8), this is torch {torch.__version__}")
        for flag in ("fp8", "fp4", "use_te_activation_func", "moe_latent_size"):
            if getattr(config, flag, None):
                raise NotImplementedError(f"grouped experts without TE do not support "
                                          f"config.{flag}; use transformer_impl="
                                          f"'transformer_engine' or grouped_gemm=False")
        if config.recompute_granularity == "selective" and \
                "moe_act" in (config.recompute_modules or ()):
            raise NotImplementedError("grouped experts without TE do not recompute 'moe_act' "
                                      "(config.recompute_modules); use TE grouped experts "
                                      "(transformer_impl='transformer_engine'), or recompute "
                                      "'moe' / full layers")
        super().__init__(num_local_experts, config, submodules, pg_collection, name,
                         scalevec=scalevec)
        self._step_map = fold.StepMap()
        self._folds = fold.FoldedWeights()  # the stacked weights grouped_mm keeps (forward)
        align = 16 // self.config.params_dtype.itemsize
        ffn = self.config.moe_ffn_hidden_size // sharding.group_size(self.tp_group)
        if self.config.hidden_size % align or ffn % align:
            raise ValueError(
                f"grouped experts: hidden_size {self.config.hidden_size} and the local expert "
                f"FFN width {ffn} must be multiples of {align} ({self.config.params_dtype}, "
                f"16-byte aligned rows for grouped_mm); use grouped_gemm=False")

    def _fc1_weight(self) -> torch.Tensor:
        """[E, out, in]: the stacked fc1 weights with every expert's vectors folded in; under
        megatron-core's DDP and calculator each expert's G is summed in its main_grad and
        mapped on the step's last micro-batch (layers/fold.py ``StepMap``)."""
        fc1 = Fc1View(e.linear_fc1 for e in self.local_experts)
        weights = [f.weight for f in fc1.experts]  # read: ready() in forward
        if not fc1.has_scale_vectors:
            return self._folds.stack(weights)
        step = self._step_map.mode(*weights)
        if step is None:
            return stacked_forward_weight(fc1, weights, self._folds)
        return self._folds.stacked_once_per_step(
            weights, *fold_vectors(fc1, weights[0].shape[-1]), fc1.layout,
            (step, self._step_map))

    def _activation(self, h: torch.Tensor, rows: glu.ExpertRows) -> torch.Tensor:
        experts, cfg = self.local_experts, self.config
        norm = vectors_of(experts[0]).up_norm
        if norm is not None:  # DNP: the lean fused GLU norm, per-expert vectors
            return experts_glu_norm(h, *expert_norm_vectors(experts, cfg), norm, cfg, rows)
        if not cfg.gated_linear_unit:  # as megatron-core's MLP.forward (unfused)
            return cfg.activation_func(h)
        gate, up = torch.chunk(h, 2, dim=-1)
        if (val := cfg.activation_func_clamp_value) is not None:
            gate, up = gate.clamp(min=None, max=val), up.clamp(min=-val, max=val)
        return cfg.activation_func(gate) * (up + cfg.glu_linear_offset)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x, probs = probs_on_input(self.config, permuted_local_hidden_states, permuted_probs)
        # No host read of device counts, one non-blocking upload of host counts (glu.py)
        counts = torch.as_tensor(tokens_per_expert)
        if counts.numel() != self.num_local_experts:
            raise ValueError(f"tokens_per_expert has {counts.numel()} counts for "
                             f"{self.num_local_experts} local experts")
        # torch-private _assert_async (torch 2.9-2.13 checked): the only check without a host
        # sync (a public assert would read the sum back); a device-side assert on CUDA
        torch._assert_async(counts.sum() == x.shape[0],  # where the counts are: no sync
                            f"tokens_per_expert does not cover the {x.shape[0]} rows")
        sizes = glu.device_counts(counts, x.device)
        offs = sizes.cumsum(0, dtype=torch.int32)
        rows = glu.expert_rows(sizes, x.device,
                               blocks=vectors_of(self.local_experts[0]).up_norm is not None,
                               total=x.shape[0])
        experts = self.local_experts
        # The experts' linears are read here, not called: their hooks first (sharding.ready)
        sharding.ready([m for e in experts for m in (e.linear_fc1, e.linear_fc2)])
        # grouped_mm saves the [E, out, in] weight it is given: each stack (and fold) is
        # released after its GEMM and rebuilt right before that GEMM's backward (fold.py)
        with self._folds, self.shared_vectors.computed_once() \
                if self.shared_vectors is not None else contextlib.nullcontext():
            h = self._folds.release_until_backward(
                grouped_linear(x, self._fc1_weight(), offs))  # [T, G*S*r]
            if experts[0].linear_fc1.bias is not None:
                h = h + torch.stack([e.linear_fc1.bias for e in experts]).index_select(0, rows.ids)
            h = self._activation(h, rows)
            h = (h * probs.unsqueeze(-1)).to(h.dtype)
            w2 = self._folds.stack([e.linear_fc2.weight for e in experts])  # [E, h, f]
            out = self._folds.release_until_backward(grouped_linear(h, w2, offs))
        if experts[0].linear_fc2.bias is not None:
            b2 = torch.stack([e.linear_fc2.bias for e in experts]).index_select(0, rows.ids)
            out = out + b2 * probs.unsqueeze(-1)
        return out, None

