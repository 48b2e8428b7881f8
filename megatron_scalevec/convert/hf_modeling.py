"""Hugging Face model of a megatron_scalevec export that no stock architecture computes.

The converter copies this file's source into the export directory as ``modeling_scalevec.py``
and names its classes in ``config.json``'s ``auto_map``; load the directory with
``trust_remote_code=True``. It depends only on torch and transformers (not on
megatron_scalevec), and is Qwen3 (RMSNorm, SwiGLU, RoPE, per-head Q/K norm with a head_dim
gamma; ``scalevec_qk_norm=False``: none) plus the normalized output side of DNP on the other
branches (``scalevec_normed_branches``):

    v    = a_v * N_head(W_v x)     a_v in R^head_dim, shared by the heads (as for q and k)
    gate = a_g * N(W_g x)          a_g in R^f, N over the MLP's whole FFN width f
    up   = a_u * N(W_u x)          a_u in R^f

and megatron-core's MoE layer where ``scalevec_moe_layers[i]`` is 1: a router (``gate``, the
router gamma folded in), ``num_experts`` MLPs of width ``moe_intermediate_size`` (each with its
own a_g, a_u when normed: DNP normalizes over the expert's own width) and an optional
always-on shared expert of width ``shared_expert_intermediate_size`` (no gate). See
:class:`ScaleVecMoeBlock` for the routing. N is RMSNorm in float32 (``rms_norm_eps``). Every
other scale vector of the trained model (HG input vectors, OR/ER magnitude and direction) was
folded into the matrices and plain gammas by the converter, so there is nothing else to compute.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.activations import ACT2FN

BRANCHES = ("v", "gate", "up")


class ScaleVecQwen3Config(Qwen3Config):
    """Qwen3's configuration plus the DNP branches, Q/K norm on or off, and the MoE layers."""

    model_type = "scalevec_qwen3"

    def __init__(self, scalevec_normed_branches=BRANCHES, scalevec_qk_norm=True,
                 scalevec_moe_layers=(), num_experts=0, num_experts_per_tok=2,
                 moe_intermediate_size=None, shared_expert_intermediate_size=0,
                 norm_topk_prob=True, **kwargs):
        unknown = sorted(set(scalevec_normed_branches) - set(BRANCHES))
        if unknown:
            raise ValueError(f"scalevec_normed_branches: unknown branches {unknown}")
        moe_layers = [int(m) for m in scalevec_moe_layers]
        if any(moe_layers) and not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"MoE layers need 1 <= num_experts_per_tok "
                             f"({num_experts_per_tok}) <= num_experts ({num_experts})")
        self.scalevec_normed_branches = list(scalevec_normed_branches)
        self.scalevec_qk_norm = bool(scalevec_qk_norm)
        self.scalevec_moe_layers = moe_layers
        self.num_experts, self.num_experts_per_tok = num_experts, num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.norm_topk_prob = bool(norm_topk_prob)
        super().__init__(**kwargs)
        if moe_layers and len(moe_layers) != self.num_hidden_layers:
            raise ValueError(f"scalevec_moe_layers has {len(moe_layers)} entries for "
                             f"{self.num_hidden_layers} layers")


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


class ScaleVecMLP(nn.Module):
    """SwiGLU ``down(act(gate(x)) * up(x))`` of width ``width``; gate / up normed per config."""

    def __init__(self, config: ScaleVecQwen3Config, width: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        normed = config.scalevec_normed_branches

        def proj(branch):
            if branch in normed:
                return NormedLinear(h, width, width, eps)
            return nn.Linear(h, width, bias=False)

        self.gate_proj, self.up_proj = proj("gate"), proj("up")
        self.down_proj = nn.Linear(width, h, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ScaleVecMoeBlock(nn.Module):
    """megatron-core's MoE layer at inference (no capacity, so no token is dropped).

    Router logits ``W_r x``; with ``norm_topk_prob`` (megatron-core's default) the top-k
    logits are chosen and softmaxed among themselves, which equals softmax over all experts,
    top-k, renormalized; without (``moe_router_pre_softmax``) the softmax over all experts is
    taken, then its top-k, not renormalized. Each token's output is the probability-weighted
    sum of its k experts, plus the shared expert's output.
    """

    def __init__(self, config: ScaleVecQwen3Config):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(ScaleVecMLP(config, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        self.shared_expert = ScaleVecMLP(config, shared) if shared else None

    def route(self, x: torch.Tensor):
        """(probabilities [T, k] in x's dtype, expert ids [T, k]) of tokens x [T, h]."""
        logits = self.gate(x)
        if self.norm_topk_prob:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
            probs, ids = torch.topk(scores, self.top_k, dim=-1)
        return probs.to(x.dtype), ids

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        probs, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(ids == e)
            if rows.numel():
                out.index_add_(0, rows, expert(x[rows]) * probs[rows, slot, None])
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.view_as(hidden_states)


class ScaleVecQwen3ForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM with :class:`NormedLinear` v projections, our MLP (DNP gate / up) and
    :class:`ScaleVecMoeBlock` on the MoE layers."""

    config_class = ScaleVecQwen3Config

    def __init__(self, config: ScaleVecQwen3Config):
        super().__init__(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        d = getattr(config, "head_dim", None) or h // config.num_attention_heads
        moe = config.scalevec_moe_layers or [0] * config.num_hidden_layers
        for i, layer in enumerate(self.model.layers):
            att = layer.self_attn
            if not config.scalevec_qk_norm:
                att.q_norm, att.k_norm = nn.Identity(), nn.Identity()
            if "v" in config.scalevec_normed_branches:
                att.v_proj = NormedLinear(h, config.num_key_value_heads * d, d, eps)
            layer.mlp = ScaleVecMoeBlock(config) if moe[i] else \
                ScaleVecMLP(config, config.intermediate_size)
