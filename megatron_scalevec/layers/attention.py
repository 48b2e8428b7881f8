"""Self-attention with DNP's per-branch norms (and QK-norm), on megatron-core's SelfAttention.

``q = a_q * N_head(W_q (gamma_q * N(x)))``, same for k and v. The input side (gamma, HG) and
DP's output side live in ``linear_qkv`` (layers/linear.py); this class adds only the
normalized output side. For Q and K this is exactly QK-norm; megatron-core has no V norm,
hence the subclass. The norms are ``q_norm``/``k_norm``/``v_norm`` (not ``q_layernorm``) so that
``finalize_model_grads``, which reduces names containing ``q_layernorm`` whenever
``config.qk_layernorm`` is set, never reduces them a second time.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.norms import ScaleVecNorm


class ScaleVecSelfAttention(SelfAttention):
    """SelfAttention + Output-Norm vectors after per-head norms (DNP, or ``--qk-layernorm``)."""

    def __init__(self, config, submodules, layer_number, *, scalevec: ScaleVecConfig, **kwargs):
        if submodules.q_layernorm is not None or submodules.k_layernorm is not None:
            raise ValueError("ScaleVecSelfAttention builds its own q/k norms; leave the stock "
                             "q_layernorm/k_layernorm submodules unset")
        if config.qk_layernorm:  # from 0.18 the stock slots must name a class: no-op ones
            submodules = dataclasses.replace(submodules, q_layernorm=IdentityOp,
                                             k_layernorm=IdentityOp)
        super().__init__(config, submodules, layer_number, **kwargs)
        self.scalevec = scalevec
        if config.num_query_groups < self.world_size:
            raise ValueError(
                f"scale-vector attention needs num_query_groups ({config.num_query_groups}) >= "
                f"tensor_model_parallel_size ({self.world_size})")
        branches = ["q", "k", "v"] if scalevec.dnp else ["q", "k"] if config.qk_layernorm else []
        # Heads are local to a TP rank, the head-dim vector is replicated: partial gradients.
        group = self.pg_collection.tp
        for b in ("q", "k", "v"):
            norm = None
            if b in branches:
                norm = ScaleVecNorm(
                    config, self.hidden_size_per_attention_head, config.layernorm_epsilon,
                    scalevec=scalevec, kind="branch", tp_group=group, grad_group=group)
            setattr(self, f"{b}_norm", norm)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        if not split_qkv and (self.q_norm or self.k_norm or self.v_norm):
            raise NotImplementedError("unsplit QKV (fused inference kernels) with DNP norms")
        out = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv)
        if not split_qkv:
            return out
        query, key, value = out[:3]
        # [s, b, heads, head_dim]: each norm works per head over head_dim.
        if self.q_norm is not None:
            query = self.q_norm(query)
        if self.k_norm is not None:
            key = self.k_norm(key)
        if self.v_norm is not None:
            value = self.v_norm(value)
        return (query, key, value) + tuple(out[3:])
