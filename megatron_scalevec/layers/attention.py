"""Self-attention with DNP's per-branch norms (and QK-norm), on megatron-core's SelfAttention.

``q = a_q * N_head(W_q (gamma_q * N(x)))``, same for k and v. The input side (gamma, HG) and
DP's output side live in ``linear_qkv`` (layers/linear.py); this class adds only the
normalized output side. For Q and K this is exactly QK-norm; megatron-core has no V norm,
hence the subclass. The norms run through layers/fused.py: q and k fused with RoPE (this class
applies RoPE itself, in ``get_query_key_value_tensors``, whenever the fused path covers the call),
keeping only the rotated output attention keeps anyway. Under DNP the three run as one function
on megatron-core's unsplit QKV (``split_qkv=False``): no split copy, one kernel each way. DNP's
norms are ``q_norm``/``k_norm``/``v_norm`` (not ``q_layernorm``): their vectors' gradients are
reduced here (sharding.py), and ``finalize_model_grads``, which reduces names containing
``q_layernorm`` whenever ``config.qk_layernorm`` is set, never reduces them a second time.

Without DNP, ``qk_layernorm`` is megatron-core's own QK-norm: our norm (its vector under the
strategy's parameterization, LayerNorm's bias) in stock's ``q_layernorm`` / ``k_layernorm``
slots, applied by stock's code, named and reduced (by ``finalize_model_grads``) as stock's.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.layers import fused
from megatron_scalevec.norms import ScaleVecNorm


def _rope_mscale(config) -> float:
    """megatron-core's YaRN concentration factor (mscale) of its RoPE; 1 without YaRN. Its own
    helper tests ``hasattr(config, "yarn_rotary_scaling_factor")``, which a Megatron-Bridge
    provider (the field present, None) fails (Bridge 0.6.2 patches megatron-core's function at
    import, too late for a name imported before): read the field first, then ask it. Private
    ``yarn_rotary_pos_embedding._yarn_get_concentration_factor_from_config``, checked on
    megatron-core 0.16.1 and 0.19.2."""
    if getattr(config, "yarn_rotary_scaling_factor", None) is None:
        return 1.0
    return yarn._yarn_get_concentration_factor_from_config(config)


class ScaleVecSelfAttention(SelfAttention):
    """SelfAttention + Output-Norm vectors after per-head norms (DNP; ``--qk-layernorm``'s in
    stock's slots)."""

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
        place = sharding.placement("head_norm", config, self.pg_collection.tp)
        for b in ("q", "k", "v"):
            norm = None
            if scalevec.dnp:
                norm = ScaleVecNorm(
                    config, self.hidden_size_per_attention_head, config.layernorm_epsilon,
                    scalevec=scalevec, kind="branch", placement=place)
            setattr(self, f"{b}_norm", norm)
        if config.qk_layernorm and not scalevec.dnp:  # QK-norm in stock's own slots
            for b in ("q", "k"):
                setattr(self, f"{b}_layernorm", ScaleVecNorm(
                    config, self.hidden_size_per_attention_head, config.layernorm_epsilon,
                    scalevec=scalevec, kind="qk"))
        self._rope = None  # (q_freqs, k_freqs) while forward() applies RoPE itself

    def named_scale_vectors(self):
        """Its head norms' vectors on ``linear_qkv``'s q / k / v rows (declared.py): DNP's
        ``<b>_norm``, or QK-norm in stock's ``<b>_layernorm`` slots."""
        for b in ("q", "k", "v"):
            for name in (f"{b}_norm", f"{b}_layernorm"):
                norm = getattr(self, name, None)
                if isinstance(norm, ScaleVecNorm):
                    yield Declared(name, norm, norm.role, "norm", self.linear_qkv, b)

    def _fuses_rope(self, kwargs) -> bool:
        """The fused norm+RoPE covers this call: plain bshd self-attention, unfused RoPE."""
        cfg = self.config
        return (self.q_norm is not None and kwargs.get("rotary_pos_emb") is not None
                and self.attention_type == "self"
                and all(kwargs.get(k) is None for k in (
                    "inference_context", "inference_params", "packed_seq_params",
                    "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin"))
                and not any(getattr(cfg, f, False) for f in (
                    "apply_rope_fusion", "multi_latent_attention", "flash_decode",
                    "fused_single_qkv_rope"))
                and getattr(cfg, "mrope_section", None) is None)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        if args or not self._fuses_rope(kwargs):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        rope = kwargs["rotary_pos_emb"]
        self._rope = rope if isinstance(rope, tuple) else (rope, rope)
        kwargs["rotary_pos_emb"] = None  # applied by get_query_key_value_tensors below
        try:
            return super().forward(hidden_states, attention_mask, **kwargs)
        finally:
            self._rope = None

    def _norm_rope(self, t, norm, freqs):
        """norm (fused with RoPE when this forward applies RoPE) of one of q, k."""
        if norm is None:
            if freqs is None:
                return t
            return apply_rotary_pos_emb(t, freqs, config=self.config,
                                        mscale=_rope_mscale(self.config))
        return fused.head_norm(t, norm(), norm.eps, norm.normalization,
                               self._cos_sin(freqs, t), self.config.rotary_interleaved)

    def _one_qkv_norm(self, key_value_states, output_gate) -> bool:
        """The three DNP norms run as one function on the unsplit QKV (layers/fused.py)."""
        return (self.v_norm is not None and self.q_norm is not None and not output_gate
                and key_value_states is None)

    def _cos_sin(self, freqs, like):
        if freqs is None:
            return None
        return fused.rope_cos_sin(freqs, _rope_mscale(self.config), like.dtype)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        if not split_qkv and (self.q_norm or self.k_norm or self.v_norm):
            raise NotImplementedError("unsplit QKV (fused inference kernels) with DNP norms")
        q_freqs, k_freqs = self._rope if self._rope is not None else (None, None)
        if self._one_qkv_norm(key_value_states, output_gate):
            mixed, _ = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
            qpg = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            norms = (self.q_norm, self.k_norm, self.v_norm)
            rope_q = self._cos_sin(q_freqs, mixed)
            rope_k = rope_q if k_freqs is q_freqs else self._cos_sin(k_freqs, mixed)
            return fused.qkv_norm(mixed, tuple(n() for n in norms), self.q_norm.eps,
                                  self.q_norm.normalization, qpg, rope_q, rope_k,
                                  self.config.rotary_interleaved)
        out = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv)
        if not split_qkv:
            return out
        query, key, value = out[:3]
        # [s, b, heads, head_dim]: each norm works per head over head_dim.
        query = self._norm_rope(query, self.q_norm, q_freqs)
        key = self._norm_rope(key, self.k_norm, k_freqs)
        if self.v_norm is not None:  # keeps its output (attention's) and 1/rms, as q and k
            value = fused.head_norm(value, self.v_norm(), self.v_norm.eps,
                                    self.v_norm.normalization)
        return (query, key, value) + tuple(out[3:])
