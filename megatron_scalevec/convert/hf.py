"""Stock megatron-core <-> Hugging Face transformers, names as Megatron-Bridge maps them.

Families: dense ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with Q/K norms) and MoE
``MixtralForCausalLM`` (``Qwen3MoeForCausalLM`` with Q/K norms); these MoE families need every
layer MoE, no shared experts (other MoE layouts and DNP go out with our own modeling file,
hf_remote.py, under the names ``remote=True`` gives). Export: any variant is folded to
stock first (fold.py, exact), then mapped here. Import: the HF model is mapped to stock
names and warm-started into any variant (warmstart.py). Experts are written in the Hub's
per-expert layout (``experts.{e}.w1`` / ``gate_proj``...), which transformers 5 regroups on
load.

Layouts handled exactly:

* fused QKV: megatron keeps rows per query group ``[q_0 .. q_{hpg-1}, k, v]`` (each
  ``head_dim`` rows); HF has separate ``q_proj`` (query head ``j`` in group ``j // hpg``, as
  ``repeat_kv`` reads it), ``k_proj``, ``v_proj``;
* GLU ``linear_fc1`` = ``[gate; up]`` (megatron applies the activation to the first half);
* routing: megatron's default top-k then softmax over the k logits equals Mixtral's softmax,
  top-k, renormalize (Qwen3-MoE ``norm_topk_prob=True``); ``moe_router_pre_softmax`` (softmax,
  then top-k, no renormalization) is Qwen3-MoE's ``norm_topk_prob=False``;
* RoPE: megatron's default rotary (``rotary_interleaved=False``) rotates halves
  (``rotate_half``), the same convention as HF Llama/Qwen3, so no permutation of Q/K rows
  is needed (unlike Meta's original interleaved checkpoints); the tests check it numerically.

``transformers`` is needed to export (it writes ``config.json``); import needs only
``safetensors``. Both are an optional extra.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_scalevec.config import moe_layer_flags
from megatron_scalevec.convert.arch import ModelArch
from megatron_scalevec.convert.io import (
    StateDict,
    atomic_output_dir,
    check_names_and_shapes,
    load_safetensors,
    progress,
    require,
    save_safetensors,
)

# architecture -> (has Q/K norms, MoE, MLP module name, expert (gate, up, down) names)
FAMILIES = {
    "LlamaForCausalLM": (False, False, "mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen3ForCausalLM": (True, False, "mlp", ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": (False, True, "block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": (True, True, "mlp", ("gate_proj", "up_proj", "down_proj")),
}
SUPPORTED = tuple(FAMILIES)


def family(arch: ModelArch) -> str:
    if arch.is_moe:
        if arch.moe_layer_freq != 1 or arch.moe_shared_expert_intermediate_size:
            raise ValueError("Hugging Face MoE export needs every layer MoE (moe_layer_freq=1) "
                             "and no shared experts")
        if arch.moe_router_pre_softmax and not arch.qk_layernorm:
            raise ValueError("Mixtral renormalizes the top-k weights: moe_router_pre_softmax "
                             "has no Mixtral equivalent")
        return "Qwen3MoeForCausalLM" if arch.qk_layernorm else "MixtralForCausalLM"
    return "Qwen3ForCausalLM" if arch.qk_layernorm else "LlamaForCausalLM"


def moe_layers(arch: ModelArch) -> list:
    """0/1 per layer: which layers are MoE (megatron-core's ``moe_layer_freq``)."""
    return moe_layer_flags(arch.num_layers, arch.moe_layer_freq, arch.is_moe)


def _mlp_pairs(arch: ModelArch, i: int, remote: bool = False) -> list:
    """(stock fc1, stock fc2, hf gate, hf up, hf down, width) per expert (or the dense MLP).
    ``remote``: our modeling file's names (hf_modeling.py): dense and MoE layers per
    ``moe_layer_freq``, experts as ``mlp.experts.{e}``, the shared expert as
    ``mlp.shared_expert``."""
    if remote:
        mlp, (g, u, d), is_moe = "mlp", FAMILIES["Qwen3MoeForCausalLM"][3], moe_layers(arch)[i]
    else:
        _, _, mlp, (g, u, d) = FAMILIES[family(arch)]
        is_moe = arch.is_moe
    p, q = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{mlp}."

    def pair(ours, theirs, width):
        return (f"{p}{ours}linear_fc1.weight", f"{p}{ours}linear_fc2.weight",
                f"{q}{theirs}{g}.weight", f"{q}{theirs}{u}.weight", f"{q}{theirs}{d}.weight",
                width)

    if not is_moe:
        return [pair("", "", arch.ffn_hidden_size)]
    width = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    pairs = [pair(f"experts.local_experts.{e}.", f"experts.{e}.", width)
             for e in range(arch.num_moe_experts)]
    if remote and arch.moe_shared_expert_intermediate_size:
        pairs.append(pair("shared_experts.", "shared_expert.",
                          arch.moe_shared_expert_intermediate_size))
    return pairs


def _router_pair(arch: ModelArch, i: int, remote: bool = False):
    """(stock router, hf router) of layer ``i``, or None for a dense layer."""
    if not (moe_layers(arch)[i] if remote else arch.is_moe):
        return None
    mlp = "mlp" if remote else FAMILIES[family(arch)][2]
    return f"decoder.layers.{i}.mlp.router.weight", f"model.layers.{i}.{mlp}.gate.weight"

# (megatron stock suffix, HF suffix) per layer, for tensors mapped one to one.
_LAYER_MAP = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)
_GLOBAL_MAP = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight"),
)


def _qkv_view(arch: ModelArch, w: torch.Tensor) -> torch.Tensor:
    groups, d = arch.num_query_groups, arch.kv_channels
    hpg = arch.num_attention_heads // groups
    expected = (groups * (hpg + 2) * d, arch.hidden_size)
    assert tuple(w.shape) == expected, f"linear_qkv {tuple(w.shape)} != {expected}"
    return w.view(groups, hpg + 2, d, arch.hidden_size)


def stock_to_hf(sd: StateDict, arch: ModelArch, remote: bool = False) -> StateDict:
    """Stock megatron-core full state dict -> HF Llama/Qwen3 state dict (``remote``: the
    names of our modeling file, see :func:`_mlp_pairs`)."""
    if not arch.gated_linear_unit or arch.normalization != "RMSNorm":
        raise ValueError("HF Llama/Qwen3 export needs a gated MLP (SwiGLU) and RMSNorm")
    out: StateDict = {}
    used = set()

    def take(k):
        used.add(k)
        return sd[k]

    for ours, theirs in _GLOBAL_MAP:
        if ours in sd:
            out[theirs] = take(ours)
    for i in range(arch.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER_MAP:
            if p + ours in sd:
                out[q + theirs] = take(p + ours)
        qkv = _qkv_view(arch, take(p + "self_attention.linear_qkv.weight"))
        hpg = arch.num_attention_heads // arch.num_query_groups
        out[q + "self_attn.q_proj.weight"] = qkv[:, :hpg].reshape(-1, arch.hidden_size)
        out[q + "self_attn.k_proj.weight"] = qkv[:, hpg].reshape(-1, arch.hidden_size)
        out[q + "self_attn.v_proj.weight"] = qkv[:, hpg + 1].reshape(-1, arch.hidden_size)
        for fc1, fc2, gate, up, down, _ in _mlp_pairs(arch, i, remote):
            w = take(fc1)
            assert w.shape[0] % 2 == 0, f"{fc1} {tuple(w.shape)} is not [gate; up]"
            out[gate], out[up] = w.chunk(2, dim=0)
            out[down] = take(fc2)
        router = _router_pair(arch, i, remote)
        if router:
            out[router[1]] = take(router[0])
    left = sorted(set(sd) - used)
    if left:
        raise ValueError(f"stock tensors with no Hugging Face name: {left[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_stock(hf: StateDict, arch: ModelArch) -> StateDict:
    """HF Llama/Qwen3 state dict -> stock megatron-core full state dict."""
    out: StateDict = {}
    used = set()

    def take(k):
        if k not in hf:
            raise ValueError(f"Hugging Face checkpoint lacks {k}")
        used.add(k)
        return hf[k]

    for ours, theirs in _GLOBAL_MAP:
        if theirs in hf:
            out[ours] = take(theirs)
    if arch.tie_embeddings:
        out.pop("output_layer.weight", None)
    for i in range(arch.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        for ours, theirs in _LAYER_MAP:
            if q + theirs in hf:
                out[p + ours] = take(q + theirs)
        g, d, h = arch.num_query_groups, arch.kv_channels, arch.hidden_size
        hpg = arch.num_attention_heads // g
        qw = take(q + "self_attn.q_proj.weight").reshape(g, hpg, d, h)
        kw = take(q + "self_attn.k_proj.weight").reshape(g, 1, d, h)
        vw = take(q + "self_attn.v_proj.weight").reshape(g, 1, d, h)
        out[p + "self_attention.linear_qkv.weight"] = torch.cat([qw, kw, vw], 1).reshape(-1, h)
        for fc1, fc2, gate, up, down, _ in _mlp_pairs(arch, i):
            out[fc1] = torch.cat([take(gate), take(up)], 0)
            out[fc2] = take(down)
        router = _router_pair(arch, i)
        if router:
            out[router[0]] = take(router[1])
    left = sorted(set(hf) - used)
    if left:
        raise ValueError(f"Hugging Face tensors the converter does not know: {left[:8]}")
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(arch: ModelArch):
    """A transformers config object for ``arch`` (its family: see :func:`family`)."""
    tf = require("transformers")
    name = family(arch)
    kw = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
              intermediate_size=arch.ffn_hidden_size, num_hidden_layers=arch.num_layers,
              num_attention_heads=arch.num_attention_heads,
              num_key_value_heads=arch.num_query_groups, head_dim=arch.kv_channels,
              hidden_act=arch.activation, max_position_embeddings=arch.max_sequence_length,
              rms_norm_eps=arch.layernorm_epsilon, tie_word_embeddings=arch.tie_embeddings,
              rope_theta=float(arch.rotary_base))
    moe_ffn = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
    if name == "LlamaForCausalLM":
        config = tf.LlamaConfig(**kw, attention_bias=False, mlp_bias=False)
    elif name == "Qwen3ForCausalLM":
        config = tf.Qwen3Config(**kw, attention_bias=False)
    elif name == "MixtralForCausalLM":
        kw["intermediate_size"] = moe_ffn
        config = tf.MixtralConfig(**kw, num_local_experts=arch.num_moe_experts,
                                  num_experts_per_tok=arch.moe_router_topk, sliding_window=None)
    else:
        config = tf.Qwen3MoeConfig(**kw, attention_bias=False, moe_intermediate_size=moe_ffn,
                                   num_experts=arch.num_moe_experts,
                                   num_experts_per_tok=arch.moe_router_topk,
                                   norm_topk_prob=not arch.moe_router_pre_softmax,
                                   decoder_sparse_step=1, mlp_only_layers=[])
    config.architectures = [name]
    return config


def arch_from_hf_config(cfg: dict) -> ModelArch:
    """ModelArch (stock) of a Llama/Qwen3 ``config.json``; unsupported options raise."""
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in SUPPORTED:
        raise ValueError(f"unsupported Hugging Face architecture {archs}; supported: "
                         f"{SUPPORTED}")
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default" or cfg.get("rope_scaling"):
        raise ValueError(f"RoPE scaling {rope_type!r}/{cfg.get('rope_scaling')} is not "
                         f"supported by the converter")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if cfg.get(flag):
            raise ValueError(f"Hugging Face config sets {flag}=True: not supported")
    window = cfg.get("sliding_window")
    if window and (archs[0] == "MixtralForCausalLM" or cfg.get("use_sliding_window")) and \
            window < cfg.get("max_position_embeddings", 0):
        raise ValueError(f"sliding-window attention ({window}) is not supported")
    heads = cfg["num_attention_heads"]
    moe = {}
    if FAMILIES[archs[0]][1]:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers / "
                             "decoder_sparse_step) is not supported")
        experts = cfg.get("num_local_experts") or cfg.get("num_experts")
        moe_ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        pre_softmax = archs[0] == "Qwen3MoeForCausalLM" and not cfg.get("norm_topk_prob")
        moe = dict(num_moe_experts=experts, moe_router_topk=cfg["num_experts_per_tok"],
                   moe_ffn_hidden_size=moe_ffn, moe_router_pre_softmax=pre_softmax)
    return ModelArch(**moe,
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=heads, num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        qk_layernorm=FAMILIES[archs[0]][0], activation=cfg.get("hidden_act", "silu"),
        rotary_base=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def export_hf(stock_sd: StateDict, arch: ModelArch, out_dir: str, *, overwrite=False,
              dtype: torch.dtype = torch.float32, show_progress: bool = True) -> str:
    """Write ``config.json`` + ``model.safetensors``; returns the architecture name."""
    config = hf_config(arch)
    hf = stock_to_hf(stock_sd, arch)
    expected = _expected_hf_shapes(arch)
    check_names_and_shapes(hf, expected, "Hugging Face export")
    with atomic_output_dir(out_dir, overwrite) as tmp:
        config.dtype = dtype
        config.save_pretrained(tmp)
        save_safetensors(hf, os.path.join(tmp, "model.safetensors"), {"format": "pt"},
                         show_progress, dtype)
    return config.architectures[0]


def import_hf(in_dir: str) -> tuple[StateDict, ModelArch]:
    """(stock full state dict, stock arch) of a HF Llama/Qwen3 directory (safetensors only)."""
    with open(os.path.join(in_dir, "config.json")) as f:
        arch = arch_from_hf_config(json.load(f))
    hf = load_safetensors(in_dir)
    hf = {k: v.to(torch.float32) for k, v in progress(hf.items(), len(hf), "reading")}
    if arch.tie_embeddings:
        hf.pop("lm_head.weight", None)
    check_names_and_shapes(hf, _expected_hf_shapes(arch), f"Hugging Face checkpoint {in_dir}")
    return hf_to_stock(hf, arch), arch


def _expected_hf_shapes(arch: ModelArch, remote: bool = False) -> dict:
    h, d = arch.hidden_size, arch.kv_channels
    nq, nkv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    if not arch.tie_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        q = f"model.layers.{i}."
        shapes.update({
            q + "input_layernorm.weight": (h,), q + "post_attention_layernorm.weight": (h,),
            q + "self_attn.q_proj.weight": (nq, h), q + "self_attn.k_proj.weight": (nkv, h),
            q + "self_attn.v_proj.weight": (nkv, h), q + "self_attn.o_proj.weight": (h, nq)})
        for _, _, gate, up, down, ffn in _mlp_pairs(arch, i, remote):
            shapes.update({gate: (ffn, h), up: (ffn, h), down: (h, ffn)})
        router = _router_pair(arch, i, remote)
        if router:
            shapes[router[1]] = (arch.num_moe_experts, h)
        if arch.qk_layernorm:
            shapes[q + "self_attn.q_norm.weight"] = (d,)
            shapes[q + "self_attn.k_norm.weight"] = (d,)
    return shapes
