"""Hugging Face model of a megatron_scalevec export with DNP norms on V, gate and up.

The converter copies this file's source into the export directory as ``modeling_scalevec.py``
and names its classes in ``config.json``'s ``auto_map``; load the directory with
``trust_remote_code=True``. It depends only on torch and transformers (not on
megatron_scalevec), and is Qwen3 (RMSNorm, SwiGLU, RoPE, per-head Q/K norm with a head_dim
gamma) plus the normalized output side of DNP on the other branches:

    v    = a_v * N_head(W_v x)     a_v in R^head_dim, shared by the heads (as for q and k)
    gate = a_g * N(W_g x)          a_g in R^ffn, N over the whole FFN width
    up   = a_u * N(W_u x)          a_u in R^ffn

N is RMSNorm in float32 (``rms_norm_eps``). Every other scale vector of the trained model
(HG input vectors, OR/ER magnitude and direction) was folded into the matrices and plain
gammas by the converter, so there is nothing else to compute.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM


class ScaleVecQwen3Config(Qwen3Config):
    """Qwen3's configuration plus the branches that carry a DNP norm."""

    model_type = "scalevec_qwen3"

    def __init__(self, scalevec_normed_branches=("v", "gate", "up"), **kwargs):
        unknown = sorted(set(scalevec_normed_branches) - {"v", "gate", "up"})
        if unknown:
            raise ValueError(f"scalevec_normed_branches: unknown branches {unknown}")
        self.scalevec_normed_branches = list(scalevec_normed_branches)
        super().__init__(**kwargs)


class _Gamma(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class NormedLinear(nn.Linear):
    """``a * N(W x)``: RMSNorm over groups of ``group`` output channels (one head, or the
    whole width), then the gamma ``a`` in R^group, shared by the groups."""

    def __init__(self, in_features: int, out_features: int, group: int, eps: float):
        super().__init__(in_features, out_features, bias=False)
        if out_features % group:
            raise ValueError(f"NormedLinear: {out_features} outputs are not groups of {group}")
        self.group, self.eps = group, eps
        self.norm = _Gamma(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [..., out]
        yf = y.float().unflatten(-1, (-1, self.group))  # [..., groups, group]
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (yf * self.norm.weight.float()).flatten(-2).to(y.dtype)


class ScaleVecQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM whose v / gate / up projections are :class:`NormedLinear`."""

    config_class = ScaleVecQwen3Config

    def __init__(self, config: ScaleVecQwen3Config):
        super().__init__(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        d = getattr(config, "head_dim", None) or h // config.num_attention_heads
        ffn = config.intermediate_size
        for layer in self.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            if "v" in config.scalevec_normed_branches:
                att.v_proj = NormedLinear(h, config.num_key_value_heads * d, d, eps)
            if "gate" in config.scalevec_normed_branches:
                mlp.gate_proj = NormedLinear(h, ffn, ffn, eps)
            if "up" in config.scalevec_normed_branches:
                mlp.up_proj = NormedLinear(h, ffn, ffn, eps)
