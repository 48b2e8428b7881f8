"""Baseline -> scale-vector variant (warm start), function-preserving.

The source is a full state dict with megatron-core's stock names (``get_gpt_layer_local_spec``;
our ``shared`` preset has the same names). Any other variant of ours is first folded to stock
(fold.py), which is exact, so every variant converts to every other through this one path.

Per layer, the Pre-Norm gamma goes where the target keeps its input-side vectors:

* ``shared`` target: into the Pre-Norm vector (plain, OR or ER);
* HG target: copied into every branch vector (``linear_qkv.scale_in.{q,k,v}``,
  ``linear_fc1.scale_in.{gate,up}``; in an MoE layer the router's ``scale_in`` and every
  expert's and shared expert's ``linear_fc1.scale_in``);
* ``none`` target: folded into the columns of those same matrices (exact).

A LayerNorm's bias stays on its norm (``ScaleVecConfig.layernorm_bias``): as is where the
target keeps the norm's gamma there (``shared``), else divided by gamma, because the target
adds it before the branch vectors: ``gamma * N(x) + beta = gamma * (N(x) + beta / gamma)`` (a
gamma with zeros is refused, naming the layer).

DP output vectors start at 1. Every vector is set with ``ScaleVector.set_from_gamma``, so OR
gets ``beta = |gamma| / sqrt(m)``, ``u = gamma`` and ER needs gamma > 0 (a parameterization's
``domain``; else an error naming the layer). DNP adds normalizations the source does not have:
refused unless ``allow_function_change``; then its output vectors start at 1 and the report
carries the logit difference on a sample batch.
"""

from __future__ import annotations

import torch

from megatron_scalevec import parameterizations
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.convert.arch import ModelArch
from megatron_scalevec.convert.build import build_model, logits, sample_batch
from megatron_scalevec.convert.io import StateDict, check_names_and_shapes, load_full_into
from megatron_scalevec.declared import (
    declared,
    declared_by,
    declared_parameter_names,
    pre_norm_readers,
)

# branches whose norms only DNP adds (Q / K norms are QK-norm, which stock has)
DNP_ONLY = ("v", "gate", "up")


class FunctionChangeError(ValueError):
    """The requested conversion cannot preserve the model's function."""


def dnp_branches(target: ScaleVecConfig, arch: ModelArch) -> list[str]:
    """Branches whose new normalization changes the function when warm-starting ``target``."""
    if not target.dnp:
        return []
    qk = [] if arch.qk_layernorm else ["q", "k"]
    return qk + ["v"] + (["gate", "up"] if arch.gated_linear_unit else ["up"])


def _set_vector(vec, gamma: torch.Tensor, where: str, source_key: str) -> None:
    why = vec.outside_domain(gamma.to(torch.float32))  # its parameterization's (ER: gamma > 0)
    if why:
        raise ValueError(f"{where}: {why} in {source_key}; use a parameterization whose "
                         f"inverse takes every gamma ({_total()}) for this checkpoint")
    vec.set_from_gamma(gamma.to(torch.float32))


def _total() -> str:
    """The registered parameterizations that can represent any gamma, for messages."""
    found = [parameterizations.get(n) for n in parameterizations.names()]
    return " or ".join(p.name if p.stock else p.name.upper() for p in found if p.domain is None)


def warm_start(stock_sd: StateDict, arch: ModelArch, target: str, *,
               allow_function_change: bool = False, measure: bool = True):
    """Build ``target`` (a strategy string) at TP=PP=1 and fill it from a stock full state
    dict. Returns ``(model, report)``; report: changed branches and max logit difference."""
    cfg = ScaleVecConfig.from_string(target, expert_vectors=arch.expert_vectors,
                                     layernorm_bias=arch.layernorm_bias)
    changed = dnp_branches(cfg, arch)
    if changed and not allow_function_change:
        raise FunctionChangeError(
            f"target {target!r} adds DNP normalizations on branches {changed} that the source "
            f"does not have: the converted model computes a different function. Pass "
            f"allow_function_change=True (--allow-function-change) to convert anyway")
    if not cfg.vectors and arch.qk_layernorm and not allow_function_change:
        raise FunctionChangeError(
            f"target {target!r} has no learnable QK-norm scale (every vector fixed to 1), and "
            f"the source's q/k_layernorm gammas act after a normalization, so they cannot be "
            f"folded: the converted model computes a different function. Pass "
            f"allow_function_change=True (--allow-function-change) to drop them")
    stock_shapes = _stock_shapes(arch)
    check_names_and_shapes(stock_sd, stock_shapes, "source (stock) state dict")

    model = build_model(arch.replace(scalevec=cfg.to_string(),
                                     layernorm_bias=cfg.layernorm_bias))
    modules = dict(model.named_modules())
    own_names = set(model.state_dict())
    out: dict[str, torch.Tensor] = {}  # target name -> tensor (matrices / plain copies)
    consumed = set()

    def take(key):
        consumed.add(key)
        return stock_sd[key].to(torch.float32)

    def move_bias(norm_name: str, gamma: torch.Tensor, keeps_gamma: bool) -> None:
        """A stock LayerNorm's bias into the target's norm (inside its branch vectors there
        unless the norm keeps gamma): beta, or beta / gamma."""
        key = norm_name + ".bias"
        if key not in stock_sd:
            return
        beta = take(key)
        if key not in own_names:  # layernorm_bias='none': only an all-zero bias is kept
            if bool(beta.any()) and not allow_function_change:
                raise FunctionChangeError(
                    f"{key} is not zero and the target has no LayerNorm bias "
                    f"(layernorm_bias='none'): pass --allow-function-change to drop it")
            return
        if not keeps_gamma:
            if bool((gamma == 0).any()):
                raise ValueError(
                    f"{norm_name}: its LayerNorm bias moves inside the branch vectors (beta / "
                    f"gamma), but its gamma has {int((gamma == 0).sum())} zero entries")
            beta = beta / gamma
        out[key] = beta

    with torch.no_grad():
        for i in range(arch.num_layers):
            p = f"decoder.layers.{i}."
            for norm in ("input_layernorm", "pre_mlp_layernorm"):
                key = p + norm + ".weight"
                gamma, pre = take(key), modules[p + norm]
                if pre.enabled:
                    _set_vector(pre, gamma, p + norm, key)
                move_bias(p + norm, gamma, pre.enabled)
                for lin in norm_consumers(modules, p, norm):
                    w, vectors = take(lin + ".weight"), declared_by(modules[lin])
                    inputs = [d for d in vectors if d.side == "in"]
                    if not pre.enabled and inputs:  # HG: one copy per branch
                        for d in inputs:
                            _set_vector(d.vector, gamma, f"{lin}.{d.name}", key)
                    elif not pre.enabled:  # 'none': no vector anywhere, gamma -> columns
                        w = w * gamma[None, :]
                    for d in vectors:
                        if d.side == "out":
                            d.vector.set_from_gamma(torch.ones(d.vector.size))
                    out[lin + ".weight"] = w
            att = modules[p + "self_attention"]
            for b in ("q", "k"):
                key = f"{p}self_attention.{b}_layernorm.weight"
                norm = qk_norm(att, b)
                if key in stock_sd:
                    if norm is None:
                        raise ValueError(f"{key}: the target has no QK norm to receive it")
                    gamma = take(key)
                    if norm.enabled:  # 'none': dropped (allowed above)
                        _set_vector(norm, gamma, f"{p}self_attention.{b}", key)
                    if norm.bias is not None:  # ours in stock's slot: the bias as is
                        out[key[:-len("weight")] + "bias"] = take(key[:-len("weight")] + "bias")
                    else:  # DNP's q/k norm has none
                        move_bias(key[:-len(".weight")], gamma, True)
                elif norm is not None and norm.enabled:
                    norm.set_from_gamma(torch.ones(norm.size))
            for d in declared(modules[p[:-1]], owned=True):  # DNP (MLP, experts, shared)
                if d.side == "norm" and d.branch in DNP_ONLY:
                    d.vector.set_from_gamma(torch.ones(d.vector.size))
        final = modules["decoder.final_layernorm"]
        key = "decoder.final_layernorm.weight"
        gamma = take(key)
        move_bias("decoder.final_layernorm", gamma, final.enabled)
        if final.enabled:
            _set_vector(final, gamma, "decoder.final_layernorm", key)
        elif not torch.equal(gamma, torch.ones_like(gamma)):
            if arch.tie_embeddings:
                raise FunctionChangeError(
                    "target 'none' has no final-norm vector and the output layer is tied to "
                    "the embedding, so the final gamma cannot be folded anywhere")
            out["output_layer.weight"] = take("output_layer.weight") * gamma[None, :]

        vector_names = declared_parameter_names(model)
        for name in model.state_dict():
            if name.endswith("_extra_state") or name in vector_names or name in out:
                continue
            if name not in stock_sd:
                raise ValueError(f"target tensor {name} has no source in the stock state dict")
            out[name] = take(name)
        leftover = sorted(set(stock_sd) - consumed)
        if leftover:
            raise ValueError(f"source tensors not used by the conversion: {leftover[:8]}")
        own = {k: v for k, v in model.state_dict().items() if k in out}
        for k, v in out.items():
            own[k].copy_(v)

    report = {"target": cfg.to_string(), "changed_branches": changed}
    if measure:
        report["max_logit_diff"] = compare_with_stock(model, stock_sd, arch)
    return model, report


def norm_consumers(modules: dict, layer: str, norm: str) -> list[str]:
    """Names of the linears reading a Pre-Norm's output (declared.py ``pre_norm_readers``:
    ``linear_qkv``; ``linear_fc1`` of the MLP, or of every expert and shared expert plus the
    router in an MoE layer)."""
    names = {id(m): n for n, m in modules.items()}
    for pre, readers in pre_norm_readers(modules[layer[:-1]]):
        if pre is modules[layer + norm]:
            return [names[id(m)] for m in readers]
    return []


def qk_norm(att, b: str):
    """Branch ``b``'s QK-norm of our attention as it declares it (DNP's, or ours in stock's
    ``<b>_layernorm`` slot: layers/attention.py); None without one."""
    found = [d.vector for d in declared_by(att) if d.side == "norm" and d.branch == b]
    return found[0] if found else None


def compare_with_stock(model, stock_sd: StateDict, arch: ModelArch) -> float:
    """Max |logits(model) - logits(stock model with stock_sd)| on a sample batch."""
    ref = build_model(arch.replace(scalevec="stock"))
    load_full_into(ref, stock_sd, "stock state dict")
    tokens, pos = sample_batch(arch)
    return float((logits(model, tokens, pos) - logits(ref, tokens, pos)).abs().max())


_SHAPES_CACHE: dict[str, dict[str, tuple]] = {}


def _stock_shapes(arch: ModelArch) -> dict[str, tuple]:
    """Names and shapes of the stock model of ``arch`` (built once per arch)."""
    key = arch.replace(scalevec="stock").to_json()
    if key not in _SHAPES_CACHE:
        ref = build_model(arch.replace(scalevec="stock"))
        _SHAPES_CACHE[key] = {k: tuple(v.shape) for k, v in ref.state_dict().items()
                              if not k.endswith("_extra_state")}
    return _SHAPES_CACHE[key]
