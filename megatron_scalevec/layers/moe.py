"""Mixture-of-Experts with scale vectors, on megatron-core's MoELayer (three small subclasses;
the per-branch math is the dense one from layers/; the ModuleSpec is in specs.py).

The layer follows megatron-core's local MoE spec (router, token dispatcher, experts, optional
shared experts). The Pre-Norm before it (``pre_mlp_layernorm``, a :class:`ScaleVecNorm`) is
shared by the router and every expert; under HG it has no vector of its own, and instead:

* the router gets ``gamma_r`` in R^h: ``logits = (W_r diag(gamma_r)) N(x)``, folded into the
  gating weight (one small GEMM, :class:`ScaleVecTopKRouter`);
* every expert ``e`` gets ``gamma_g^e, gamma_u^e`` in R^h in its ``linear_fc1`` (a
  :class:`ScaleVecColumnParallelLinear` built with ``is_expert=True``), and DP / DNP output
  vectors ``a_g^e, a_u^e`` in R^f (f = ``moe_ffn_hidden_size``; DNP normalizes over the expert's
  whole FFN width, all-reduced over the expert-tensor-parallel group when split);
* shared experts get their own, as a dense MLP of width ``moe_shared_expert_intermediate_size``.

``ScaleVecConfig.expert_vectors='shared'`` is a second reading for fine-grained MoE: one set
``gamma_g, gamma_u, a_g, a_u`` per MoE layer used by all routed experts, owned by the experts
module and lent to each expert (layers/expert_vectors.py: ownership, the reduction argument);
router and shared experts unchanged.

OR / ER apply to all of them. Aux-loss, z-loss and aux-loss-free (expert bias) balancing are
megatron-core's, untouched: ``gamma_r`` only changes the logits they read.

Where expert vectors live: on the rank holding the expert (EP), split with ``linear_fc1``'s
columns under expert TP, reduced in autograd over the expert-TP group only (never the dense TP
group), and over the expert data-parallel group by DDP (they copy ``allreduce`` from the expert
weight). None carries ``sequence_parallel``. ``SequentialMLP.sharded_state_dict`` prepends the
global expert axis to every sharded tensor of an expert, so vectors are saved at global expert
ids like the weights. (Shared expert vectors: once per layer, layers/expert_vectors.py.)

Parameter count
---------------
New parameters relative to megatron-core's own (``shared``) layers, per MoE layer, with ``h``
the hidden size, ``E`` experts, ``f`` the expert FFN width, ``f_s`` the shared-expert width
(0 without), ``G = 2`` branches for a gated MLP (1 otherwise), ``n(m)`` the parameters of one
vector of length ``m`` under the strategy's parameterization (``m``; ``m + 1`` under OR / ER:
``Parameterization.numel``), ``[.]`` 1 when the variant is on::

    router   [hg] n(h)
    experts  E' * ( [hg] G n(h) + [dp or dnp] G n(f) )
             E' = E (expert_vectors='per_expert') or 1 ('shared')
    shared   [f_s > 0] ( [hg] G n(h) + [dp or dnp] G n(f_s) )
    pre-norm [hg] (-h)      (its gamma moved into the branches); [shared] (n(h) - h)

Per expert, the fraction of its 3hf (gated) weights is about 2/(3f) + 2/(3h) for HG+DNP, which
does not shrink with the number of experts (2.05e-3 of a 64-expert, f=384, 2.1B model);
shared, the expert term is one expert's, ~E times smaller (5.8e-5 of that model).
:func:`moe_new_parameters` evaluates this (and the attention / dense terms) and tests check
it against a built model.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from megatron_scalevec import parameterizations, sharding
from megatron_scalevec.compat import mcore
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.layers import fold
from megatron_scalevec.layers.expert_vectors import shared_expert_vectors
from megatron_scalevec.layers.mlp import GLUNormMLP, ScaleVecMLP, check_dnp
from megatron_scalevec.vectors import ScaleVector

__all__ = ["ScaleVecSequentialMLP", "ScaleVecSharedExpertMLP", "ScaleVecTopKRouter",
           "moe_model_parameters", "moe_new_parameters"]


class ScaleVecTopKRouter(TopKRouter):
    """TopKRouter whose gating GEMM reads ``W_r diag(gamma_r)`` (HG's router vector).

    ``gamma_r`` is replicated over TP; under sequence parallelism each rank routes only its
    shard of the tokens, so its gradient is summed over the TP group in autograd (the router
    weight itself keeps megatron-core's ``sequence_parallel`` attribute and reduction).
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer=False, *,
                 scalevec: ScaleVecConfig):
        super().__init__(**mcore.accepted_kwargs(
            TopKRouter, config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer))
        self.scalevec = scalevec
        self.scale_in = None
        if scalevec.hg and scalevec.vectors:
            self.scale_in = ScaleVector(
                config.hidden_size, scalevec.parameterization, role="input",
                **sharding.placement("router_input", config, self.tp_group),
                dtype=config.params_dtype)

    def named_scale_vectors(self):
        """gamma_r on the gating weight's input columns (declared.py)."""
        if self.scale_in is not None:
            yield Declared("scale_in", self.scale_in, self.scale_in.role, "in", self)

    def effective_weight(self, weight: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W_r diag(gamma_r)`` in ``dtype`` (layers/fold.py ``fold_columns``)."""
        if self.scale_in is None:
            return weight
        return fold.fold_columns(weight, self.scale_in(), dtype)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if self.scale_in is None:
            return super().gating(input)
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            self.config.moe_router_dtype, input.dtype)
        # Fold in the router's compute dtype (at least fp32), never rounded to the parameter
        # dtype first: with bf16 params and moe_router_dtype=fp32 stock routing multiplies
        # bf16 values in fp32, and so must W_r diag(gamma_r).
        folded = self.effective_weight(self.weight, torch.promote_types(router_dtype,
                                                                       torch.float32))
        weight = folded.to(router_dtype)  # [E, h]
        if weight.dtype != input.dtype and moe_utils.te_general_gemm is not None:
            input = input.to(weight.dtype)  # TE's GEMM takes a single input dtype
        return moe_utils.router_gating_linear(input, weight, self.bias, router_dtype)


class ScaleVecSequentialMLP(SequentialMLP):
    """SequentialMLP whose local experts are :class:`ScaleVecMLP` (DNP needs the MLP class).

    megatron-core's constructor hard-codes ``MLP(...)``; we let it build zero experts (so it
    still sets up its groups and config) and append ours with the same arguments. Under
    ``expert_vectors='shared'`` the experts module owns them as ``shared_vectors`` and lends them
    to its experts (layers/expert_vectors.py).
    """

    _grouped = False  # True for layers/grouped.py's subclass (same experts, grouped GEMMs)

    def __init__(self, num_local_experts, config, submodules: MLPSubmodules,
                 pg_collection=None, name=None, *, scalevec: ScaleVecConfig):
        if config.moe_grouped_gemm and not self._grouped:
            raise ValueError("config.moe_grouped_gemm=True, but this MoE spec was built with "
                             "sequential experts: build it with moe_spec(..., grouped_gemm=True)")
        super().__init__(0, config, submodules, **mcore.accepted_kwargs(
            SequentialMLP, pg_collection=pg_collection, name=name))
        self.num_local_experts = num_local_experts
        for i in range(num_local_experts):
            self.local_experts.append(ScaleVecMLP(
                self.config, submodules, scalevec=scalevec, is_expert=True,
                ffn_hidden_size=self.config.moe_ffn_hidden_size, tp_group=self.tp_group,
                name=f"{name}.local_experts.{i}" if name is not None else None))
        experts = list(self.local_experts)
        self.shared_vectors = shared_expert_vectors(
            self.config, scalevec, experts + [e.linear_fc1 for e in experts], pg_collection,
            expt_tp=self.tp_group, ep=self.ep_group,
            weight=experts[0].linear_fc1.weight if experts else None)

    def forward(self, *args, **kwargs):
        if self.shared_vectors is None:
            return super().forward(*args, **kwargs)
        with self.shared_vectors.computed_once():
            return super().forward(*args, **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.shared_vectors is not None:
            sd.update(self.shared_vectors.sharded_state_dict(
                f"{prefix}shared_vectors.", sharded_offsets, metadata, self.ep_group,
                self.dp_group))
        return sd


class ScaleVecSharedExpertMLP(SharedExpertMLP, GLUNormMLP):
    """SharedExpertMLP with the dense MLP's vectors (HG/DP in ``linear_fc1``, DNP norms).

    The MRO puts our GLUNormMLP between SharedExpertMLP and MLP, so the stock gate and
    ``forward`` run around our DNP forward.
    """

    def __init__(self, config, submodules, gate: bool, pg_collection=None, name=None, *,
                 scalevec: ScaleVecConfig):
        if scalevec.dnp and config.moe_shared_expert_overlap:
            raise NotImplementedError(
                "DNP on shared experts with moe_shared_expert_overlap: the overlapped path runs "
                "fc1/act/fc2 piecewise inside the dispatcher and would skip the DNP norms")
        super().__init__(config, submodules, gate, pg_collection,
                         **mcore.accepted_kwargs(SharedExpertMLP, name=name))
        # The DNP norms come after megatron-core's SharedExpertMLP.__init__, which builds the MLP
        # with its own arguments on a copy of the config whose ffn_hidden_size is the shared
        # experts' width (moe/shared_experts.py, 0.16.1 and 0.19.2)
        width = self.config.ffn_hidden_size
        check_dnp(self.config, scalevec, width, sharding.group_size(self.tp_group))
        self._init_norms(scalevec, width, is_expert=False)


def moe_new_parameters(cfg: ScaleVecConfig, *, num_layers: int, hidden: int, heads: int,
                       query_groups: int, head_dim: int, ffn: int, num_experts: int,
                       moe_ffn: int, shared_ffn: int = 0, moe_layers: Optional[list] = None,
                       gated: bool = True) -> dict:
    """New parameters vs megatron-core's own layers, by place (the formula in the docstring,
    plus attention, dense-MLP and final-norm terms). ``moe_layers``: 0/1 per layer
    (default: all MoE). Without ``qk_layernorm``. Reads ``cfg.expert_vectors``."""
    if not cfg.vectors:  # `none` removes every gamma: 2 per layer and the final one
        return {"total": -(2 * num_layers + 1) * hidden}
    n = parameterizations.get(cfg.parameterization).numel  # one vector's parameters
    g = 2 if gated else 1
    out_vec = cfg.dp or cfg.dnp

    def branch_mlp(width):
        return (g * n(hidden) if cfg.hg else 0) + (g * n(width) if out_vec else 0)

    def pre_norm():
        return -hidden if cfg.hg else n(hidden) - hidden

    pattern = moe_layers if moe_layers is not None else [1] * num_layers
    # q/k/v output vectors are R^head_dim, shared across heads.
    attention = (3 * n(hidden) if cfg.hg else 0) + (3 * n(head_dim) if out_vec else 0)
    parts = {"attention": num_layers * (attention + pre_norm()), "final_norm": n(hidden) - hidden,
             "router": 0, "experts": 0, "shared_experts": 0, "dense_mlp": 0}
    for is_moe in pattern:
        parts["dense_mlp" if not is_moe else "experts"] += pre_norm()
        if not is_moe:
            parts["dense_mlp"] += branch_mlp(ffn)
            continue
        parts["router"] += n(hidden) if cfg.hg else 0
        copies = 1 if cfg.expert_vectors == "shared" else num_experts
        parts["experts"] += copies * branch_mlp(moe_ffn)
        parts["shared_experts"] += branch_mlp(shared_ffn) if shared_ffn else 0
    parts["total"] = sum(parts.values())
    return parts


def moe_model_parameters(*, num_layers: int, hidden: int, heads: int, query_groups: int,
                         head_dim: int, ffn: int, num_experts: int, moe_ffn: int,
                         shared_ffn: int = 0, vocab: int, moe_layers: Optional[list] = None,
                         gated: bool = True, tied: bool = False) -> dict:
    """Parameters of the stock (``shared``) GPT model without biases: total and active."""
    g = 2 if gated else 1
    attn = hidden * head_dim * (heads + 2 * query_groups) + heads * head_dim * hidden
    expert = (g + 1) * hidden * moe_ffn
    shared = (g + 1) * hidden * shared_ffn
    pattern = moe_layers if moe_layers is not None else [1] * num_layers
    total = vocab * hidden * (1 if tied else 2) + hidden
    for is_moe in pattern:
        total += attn + 2 * hidden
        total += (num_experts * expert + shared + num_experts * hidden) if is_moe \
            else (g + 1) * hidden * ffn
    return {"total": total}
