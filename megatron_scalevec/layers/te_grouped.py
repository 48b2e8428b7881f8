"""Transformer Engine grouped experts with scale vectors (optional, guarded; the dense TE parts
are layers/te.py). Every strategy runs here, ``unified`` included:

* ``linear_fc1``: a ``TEColumnParallelGroupedLinear`` subclass whose ``_get_weight_tensors()``
  returns each expert's ``diag(a^e) W1[e] diag(gamma^e)`` (layers/grouped.py's stacked fold, the
  vectors of all local experts evaluated at once), so TE's grouped GEMM - and its FP8 cast of the
  weights - runs on the folded weights.
* the experts: a ``TEGroupedMLP`` subclass. Under DNP its forward replaces only what sits
  between the two grouped GEMMs: the lean GLU norm of layers/glu.py, each row with its expert's
  ``a_g, a_u`` (gathered in the kernel; only fc1's output and two per-row statistics are kept,
  as the local grouped experts), then the router probabilities. Under expert TP the norm's
  statistics are all-reduced over the expert-TP group. Padding, fc1, fc2, bias and recompute
  are megatron-core's / TE's. Without DNP its forward is megatron-core's.
* ``expert_vectors='shared'``: the layer's one set of vectors, owned by the experts module and
  lent to every expert's fold and norm (layers/expert_vectors.py).

This module is the behaviour (two mixins and their helpers) and imports no TE; the classes over
megatron-core's TE wrappers are layers/te_classes.py.

FP8 (TE's recipe): fc1 quantizes its input and the folded weights; the DNP norm runs on fc1's
high-precision output; fc2 quantizes its input, the GLU's output. Rows that ``Fp8Padding`` adds
are zero (``N(0) = 0``) and carry probability 0, so they change nothing.

Checkpoints use the sequential experts' keys (``experts.linear_fc1.scale_in...``,
``experts.gate_norm...``, ``shared_vectors...``) at global expert ids: they move between
sequential, local grouped and TE grouped experts. Tested on CPU through TE's own autograd
functions (tests/layers/test_te_grouped.py, scalevec_testing/te_stub.py).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.moe import moe_utils

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers import fold, glu
from megatron_scalevec.layers.expert_vectors import (
    Borrowed,
    shared_expert_vectors,
    uses_shared_vectors,
    vectors_of,
)
from megatron_scalevec.layers.grouped import (
    Fc1View,
    expert_norm_vectors,
    experts_glu_norm,
    fold_vectors,
    probs_on_input,
    stacked_forward_weight,
)
from megatron_scalevec.layers.linear import branch_declarations, branch_layout, check_dp_bias
from megatron_scalevec.layers.mlp import branch_norms, check_dnp_width
from megatron_scalevec.layers.te import (
    check_foldable,
    fold_checked,
    local_output_size,
    release_output,
    te_reads_weight,
    unread_checked,
)
from megatron_scalevec.norms import ffn_norms
from megatron_scalevec.vectors import branch_vectors, has_branch_vectors, sharded_vectors


def check(config, scalevec: ScaleVecConfig) -> None:
    """One line for each option the grouped experts with these vectors cannot honour."""
    check_foldable(config, scalevec)
    check_dp_bias(scalevec, config.add_bias_linear)
    if (scalevec.hg or scalevec.dp or scalevec.dnp) and \
            getattr(config, "moe_mlp_glu_interleave_size", None):
        raise NotImplementedError("scale vectors on TE grouped experts do not support "
                                  "config.moe_mlp_glu_interleave_size: the gate / up vectors "
                                  "act on fc1's two halves")
    if not scalevec.dnp:
        return
    glu.check_config(config)
    offloaded = set(getattr(config, "offload_modules", None) or ()) & {"expert_fc1", "moe_act"}
    if getattr(config, "fine_grained_activation_offloading", False) and offloaded:
        raise NotImplementedError(f"DNP on TE grouped experts does not support "
                                  f"config.offload_modules {sorted(offloaded)}: its forward "
                                  f"between the GEMMs does not offload")


class ExpertFc1Vectors(torch.nn.Module):
    """Expert e's fc1 vectors inside a TE grouped linear, which registers it as
    ``scale_vectors.{e}``: the owner of its ``scale_in`` / ``scale_out`` (a sequential fc1's
    layout and names), or their user under ``expert_vectors='shared'`` (``vectors_from``).
    ``weight``: the grouped linear's ``weight{e}`` they fold into, held by reference, for
    what reads an fc1's weight beside its vectors (training/monitor.py)."""

    def __init__(self, scalevec: ScaleVecConfig, config, input_size, out_local, group, weight):
        super().__init__()
        self.groups, self.slots, self.rows = branch_layout("fc1", config, out_local)
        self.has_scale_vectors = has_branch_vectors(scalevec)
        self.tp_group = group  # the expert TP group its rows are split over (the monitor's sum)
        self._weight = Borrowed(weight)
        self.vectors_from = Borrowed() if uses_shared_vectors(scalevec, True) else None
        if self.vectors_from is None:
            self.scale_in, self.scale_out = branch_vectors(
                scalevec, config, list(dict.fromkeys(self.slots)),
                (input_size, sharding.placement("input_folded", config, group)),
                (self.rows, sharding.placement("fc1_output", config, group)),
                getattr(weight, "allreduce", True))

    @property
    def weight(self) -> torch.nn.Parameter:
        return self._weight.target

    def named_scale_vectors(self):
        """Expert e's branch vectors on its fc1 rows (declared.py), owned or lent."""
        yield from branch_declarations(self)


class _ExpertNorms(torch.nn.Module):
    """Expert e's DNP norms ``gate_norm`` / ``up_norm``, as a sequential expert has them (or,
    under ``expert_vectors='shared'``, lent: layers/expert_vectors.py)."""

    def __init__(self, config, scalevec, width, tp_group, allreduce, fc1):
        super().__init__()
        self._fc1 = Borrowed(fc1)  # expert e's fc1 vectors, whose rows these normalize
        self.vectors_from = Borrowed() if uses_shared_vectors(scalevec, True) else None
        if self.vectors_from is not None:
            return
        norms = ffn_norms(config, scalevec, width,
                          sharding.placement("ffn_norm", config, tp_group), allreduce)
        self.up_norm, self.gate_norm = norms["up"], norms["gate"]  # registered in this order

    def named_scale_vectors(self):
        """Expert e's DNP norms on its fc1 rows (declared.py), owned or lent."""
        yield from branch_norms(vectors_of(self), self._fc1.target, self.vectors_from is None)


def _at_expert_keys(holders, local: str, prefix: str, sharded_offsets, metadata) -> dict:
    """The vectors each local expert's holder owns, at its global expert id (the expert axis
    in the sharded offsets; the replica id's last entry: the expert data-parallel rank), under
    the sequential experts' keys (``{local}{e}.`` becomes ``prefix``), as megatron-core's
    experts save them."""
    first = ps.get_expert_model_parallel_rank() * len(holders)
    total = ps.get_expert_model_parallel_world_size() * len(holders)
    copy = ps.get_expert_data_parallel_rank()
    sd = {}
    for e, holder in enumerate(holders):
        offsets = (*sharded_offsets, (len(sharded_offsets), first + e, total))
        part = sharded_vectors(holder.named_scale_vectors(), f"{local}{e}.", offsets,
                               metadata, copy)
        replace_prefix_for_sharding(part, f"{local}{e}.", prefix)
        sd.update(part)
    return sd


class FoldedGroupedLinear:
    """A TE grouped fc1 folding expert e's vectors into ``weight{e}``: above megatron-core's
    ``TEColumnParallelGroupedLinear`` in the MRO (layers/te_classes.py), ``_init_vectors``
    after its ``__init__``."""

    def _init_vectors(self, scalevec: ScaleVecConfig, config, input_size, output_size):
        self.norms_applied = not scalevec.dnp  # set by the grouped MLP (GroupedExpertsVectors)
        group = sharding.tp_group(is_expert=True)
        self.scale_vectors = torch.nn.ModuleList(
            ExpertFc1Vectors(scalevec, config, input_size, local_output_size(output_size, True),
                             group, getattr(self, f"weight{e}")) for e in range(self.num_gemms))
        self.has_scale_vectors = has_branch_vectors(scalevec)
        self._folds = fold.FoldedWeights()
        self._step_map, self._step = fold.StepMap(), None
        self._fused_accumulation = self.fuse_wgrad_accumulation  # as configured
        self._fold_checked = self._fold_seen = False  # te.fold_checked

    def forward(self, *args, **kwargs):
        if not self.norms_applied:
            raise RuntimeError("DNP on TE grouped experts needs the experts module "
                               "ScaleVecTEGroupedMLP (specs.py's TE grouped experts): this "
                               "fc1 alone would skip the norms")
        if not self.has_scale_vectors:
            return super().forward(*args, **kwargs)
        # as layers/te.py: G summed in each W's main_grad and mapped once per step under
        # megatron-core's DDP and calculator; else mapped by autograd every micro-batch
        self._step = self._step_map.mode(*(getattr(self, f"weight{e}")
                                           for e in range(self.num_gemms)))
        self.fuse_wgrad_accumulation = self._fused_accumulation and self._step is not None
        names = [f"weight{e}" for e in range(self.num_gemms)]
        read = te_reads_weight(self, args[0] if args else kwargs["x"], names)
        with self._folds.plan(*read), fold_checked(self), unread_checked(self, read[0], names):
            # TE keeps W_eff: released until backward
            return release_output(self._folds, super().forward(*args, **kwargs))

    def _get_weight_tensors(self):  # TE private, checked on 2.11.0, 2.17.1 (layers/te.py)
        weights = list(super()._get_weight_tensors())
        if not self.has_scale_vectors:
            return weights
        self._fold_seen = True
        fc1 = Fc1View(self.scale_vectors)
        if self._step is None:
            return list(stacked_forward_weight(fc1, weights, self._folds).unbind(0))
        return self._folds.once_per_step(
            weights, *fold_vectors(fc1, weights[0].shape[-1]), fc1.layout,
            (self._step, self._step_map, self.fuse_wgrad_accumulation))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The vectors at their global expert ids, under the sequential experts' keys
        (TEGroupedMLP maps ``linear_fc1.`` to ``experts.linear_fc1.``); lent ones are saved
        by their owner."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sd = {k: v for k, v in sd.items() if not k.startswith(f"{prefix}scale_vectors.")}
        if self.scale_vectors[0].vectors_from is not None:
            return sd
        sd.update(_at_expert_keys(self.scale_vectors, f"{prefix}scale_vectors.", prefix,
                                  sharded_offsets, metadata))
        return sd


class GroupedExpertsVectors:
    """TE grouped experts with DNP between the grouped GEMMs and shared expert vectors: above
    megatron-core's ``TEGroupedMLP`` in the MRO (layers/te_classes.py), ``_init_vectors``
    after its ``__init__``."""

    def _init_vectors(self, scalevec: ScaleVecConfig, pg_collection) -> None:
        width = self.config.moe_ffn_hidden_size  # options checked by our fc1 (check)
        fc1 = self.linear_fc1
        if not hasattr(fc1, "scale_vectors"):
            raise TypeError("ScaleVecTEGroupedMLP needs the scale-vector grouped fc1 "
                            "(specs.py's TE grouped experts)")
        tp = sharding.group_size(self.tp_group)
        check_dnp_width(scalevec, width, tp, "moe_ffn_hidden_size", "expert-tensor-parallel")
        self.scalevec = scalevec
        self.expt_dp_group = getattr(pg_collection, "expt_dp", None) or \
            ps.get_expert_data_parallel_group()
        allreduce = getattr(fc1.weight0, "allreduce", True)
        experts = [_ExpertNorms(self.config, scalevec, width // tp, self.tp_group, allreduce,
                                vectors) for vectors in fc1.scale_vectors]
        self.experts_view = experts  # a list: what each expert's norms are, not registered
        self.shared_vectors = shared_expert_vectors(
            self.config, scalevec, experts + list(fc1.scale_vectors), pg_collection,
            expt_tp=self.tp_group, ep=self.ep_group, weight=fc1.weight0)
        self.expert_norms = None
        if self.shared_vectors is None and scalevec.dnp:
            self.expert_norms = torch.nn.ModuleList(experts)
        fc1.norms_applied = True

    def named_scale_vectors(self):
        """Under ``expert_vectors='shared'`` the experts' norms are not registered (lent: the
        owner is ``shared_vectors``): declared here, borrowed, on each expert's fc1 rows."""
        if self.expert_norms is None:
            for e, expert in enumerate(self.experts_view):
                for d in expert.named_scale_vectors():
                    yield d.under(f"experts_view.{e}")

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                *args, **kwargs):
        once = self.shared_vectors.computed_once() if self.shared_vectors is not None \
            else contextlib.nullcontext()
        with once:
            if not self.scalevec.dnp:  # the fold is fc1's: megatron-core's forward
                return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                       permuted_probs, *args, **kwargs)
            if any(a is not None for a in (*args, *kwargs.values())):
                raise NotImplementedError("DNP on TE grouped experts: output / gradient "
                                          "buffers need TE's fused grouped MLP")
            return self._dnp_forward(permuted_local_hidden_states, tokens_per_expert,
                                     permuted_probs)

    def _dnp_forward(self, x, tokens_per_expert, probs):
        """TEGroupedMLP.forward with the DNP GLU norm between the GEMMs. It uses
        megatron-core's TEGroupedMLP internals ``quantization_padding`` /
        ``quantization_unpadding``, ``activation_recompute``, the private ``_apply_bias``
        and ``moe_utils.skip_routed_expert_padding`` (0.19); present in 0.16.1 and 0.19.2,
        run there by tests/layers/test_te_grouped.py except the FP8 padding (GPU only)."""
        cfg = self.config
        # TE's GroupedLinear takes m_splits as a host list: the one sync megatron-core's own
        # TEGroupedMLP.forward makes too (the ledger's syncs/mb: equal to stock's)
        counts = tokens_per_expert.tolist()
        probs = probs.unsqueeze(-1)
        padded = counts
        skip = getattr(moe_utils, "skip_routed_expert_padding", None)  # 0.19+
        if (cfg.fp8 or cfg.fp4) and not (skip is not None and skip(cfg)):
            x, padded = self.quantization_padding(x, counts)
            probs, _ = self.quantization_padding(probs, counts)
        x, probs = probs_on_input(cfg, x, probs)
        h, _ = self.linear_fc1(x, padded)  # built with skip_bias_add=False: bias added
        rows = glu.expert_rows(tokens_per_expert if padded is counts else padded, h.device,
                               total=h.shape[0])  # device counts as they are, no sync
        a_g, a_u = expert_norm_vectors(self.experts_view, cfg)
        norm = vectors_of(self.experts_view[0]).up_norm

        def norm_act(h, a_g, a_u, probs):
            out = experts_glu_norm(h, a_g, a_u, norm, cfg, rows)
            return (out * probs).to(out.dtype)

        if self.activation_recompute:  # megatron-core's "moe_act" recompute, as stock
            from megatron.core import tensor_parallel  # noqa: PLC0415

            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            h = self.activation_checkpoint.checkpoint(norm_act, h, a_g, a_u, probs)
        else:
            h = norm_act(h, a_g, a_u, probs)
        out, out_bias = self.linear_fc2(h, padded)
        if self.activation_recompute:
            self.activation_checkpoint.discard_output_and_register_recompute(out)
        out = self._apply_bias(out, out_bias, padded, probs)
        if padded is not counts:
            out = self.quantization_unpadding(out, counts)
        return out, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron-core's, plus the DNP norms at global expert ids under the sequential
        experts' keys, or the shared vectors once per layer."""
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = (f"{prefix}expert_norms.", f"{prefix}shared_vectors.")  # there without the
        sd = {k: v for k, v in sd.items() if not k.startswith(own)}  # expert axis: below
        if self.shared_vectors is not None:
            sd.update(self.shared_vectors.sharded_state_dict(
                f"{prefix}shared_vectors.", sharded_offsets, metadata, self.ep_group,
                self.expt_dp_group))
        if self.expert_norms is not None:
            sd.update(_at_expert_keys(self.expert_norms, f"{prefix}expert_norms.",
                                      f"{prefix}experts.", sharded_offsets, metadata))
        return sd
