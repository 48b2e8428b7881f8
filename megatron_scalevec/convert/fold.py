"""Scale-vector variant -> stock megatron-core model (fold), exact.

SPEC.md's unified view: with no normalization between them, a branch's vectors and its matrix
are one effective weight ``diag(a) W diag(gamma)``. We take that weight from the layer itself
(``ScaleVecColumnParallelLinear.effective_weight``, the same code the forward pass runs) and
every gamma from ``ScaleVector.__call__`` (so OR and ER are resolved by their own code):

* HG input vectors and DP output vectors -> folded into ``linear_qkv`` / ``linear_fc1``;
  the stock Pre-Norm weight is then 1;
* a ``shared`` Pre-Norm vector (plain, OR or ER) -> the stock Pre-Norm weight;
* QK norms (``config.qk_layernorm``) -> stock ``q_layernorm`` / ``k_layernorm`` weights;
* the final norm's gamma -> ``decoder.final_layernorm.weight`` (1 under ``none``);
* LayerNorm biases as they are: ours sits before the branch vectors
  (``W_q(gamma_q * (N(x) + beta))``), so with gamma_q folded into W_q it is stock's bias;
  zeros where the model has none (``layernorm_bias='none'``, DNP's q/k norms).

DNP's norms on V, gate and up have no stock equivalent: refused, naming the branches; with
``keep_dnp=True`` (the Hugging Face export with our own modeling file, hf_remote.py) their
gammas come back beside the stock state dict, under their module names + ``.weight``.
"""

from __future__ import annotations

import torch

from megatron_scalevec.convert.arch import ModelArch
from megatron_scalevec.convert.build import build_model
from megatron_scalevec.convert.io import StateDict, check_names_and_shapes
from megatron_scalevec.convert.warmstart import (
    DNP_ONLY,
    FunctionChangeError,
    _stock_shapes,
    norm_consumers,
    qk_norm,
)
from megatron_scalevec.declared import declared, declared_by, declared_parameter_names


def _dnp_norms(model):
    """The declared DNP norms (V, gate, up) of ``model``, each once (its owner's name)."""
    return [d for d in declared(model, owned=True) if d.side == "norm" and d.branch in DNP_ONLY]


def unfoldable_branches(model) -> dict[str, list]:
    """branch -> layers whose DNP norm (V, gate, up) has no stock equivalent."""
    found: dict[str, list] = {}
    for d in _dnp_norms(model):
        found.setdefault(d.branch, []).append(d.name.rsplit(".", 2)[0])
    return found


def _gamma_or_ones(module, size: int) -> torch.Tensor:
    # its call without input: gamma (a ScaleVecNorm's too; with an input it normalizes)
    g = module() if module is not None and module.enabled else None
    return torch.ones(size) if g is None else g.detach().float()


def _effective_weight(module) -> torch.Tensor:
    """The weight a stock layer needs to compute what ``module`` computes."""
    w = module.weight
    if any(d.side in ("in", "out") for d in declared_by(module)):
        # diag(a) W diag(gamma) per branch; the router's W_r diag(gamma_r) (layers/fold.py)
        w = module.effective_weight(w)
    return w.detach().float().clone()


@torch.no_grad()
def fold_to_stock(model, arch: ModelArch, keep_dnp: bool = False):
    """(stock full state dict, stock arch) computing the same function as ``model``
    (a scale-vector GPTModel at TP=PP=1, any variant without DNP). ``keep_dnp``: also
    accept DNP and return ``(stock sd, stock arch, {v/gate/up norm name: gamma})``."""
    bad = unfoldable_branches(model)
    dnp: StateDict = {}
    if keep_dnp:
        for d in _dnp_norms(model):
            dnp[d.name + ".weight"] = _gamma_or_ones(d.vector, d.vector.size)
    elif bad:
        where = "; ".join(f"{b}: {len(layers)} layer(s), e.g. {layers[0]}"
                          for b, layers in bad.items())
        raise FunctionChangeError(
            f"its DNP normalizations on branches {sorted(bad)} ({where}) have no stock "
            f"equivalent and cannot be folded into weights (only Q/K norms map to "
            f"qk_layernorm), not even with --allow-function-change")
    modules = dict(model.named_modules())
    state = model.state_dict()
    out: StateDict = {}
    vector_params = declared_parameter_names(model)
    consumed = set()
    h = arch.hidden_size
    has_qk = False
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            out[p + norm + ".weight"] = _gamma_or_ones(modules[p + norm], h)
            for lin in norm_consumers(modules, p, norm):
                out[lin + ".weight"] = _effective_weight(modules[lin])
                consumed.add(lin + ".weight")
        att = modules[p + "self_attention"]
        for b in ("q", "k"):
            norm = qk_norm(att, b)
            if norm is not None:
                has_qk = True
                out[f"{p}self_attention.{b}_layernorm.weight"] = _gamma_or_ones(norm, norm.size)
    out["decoder.final_layernorm.weight"] = _gamma_or_ones(modules["decoder.final_layernorm"], h)
    for name, t in state.items():
        if name.endswith("_extra_state") or name in vector_params or name in consumed:
            continue
        out[name] = t.detach().float().clone()
    stock_arch = arch.replace(scalevec="stock", qk_layernorm=has_qk, layernorm_bias="stock")
    stock_shapes = _stock_shapes(stock_arch)
    for key in stock_shapes:  # LayerNorm biases the model does not have: zero
        if key.endswith("layernorm.bias") and key not in out:
            out[key] = torch.zeros(stock_shapes[key])
    check_names_and_shapes(out, stock_shapes, "folded state dict")
    return (out, stock_arch, dnp) if keep_dnp else (out, stock_arch)


def fold_state_dict(sd: StateDict, arch: ModelArch):
    """Fold a full state dict of ``arch`` (our variant, or already stock) to stock."""
    if arch.is_stock:
        return dict(sd), arch
    from megatron_scalevec.convert.io import load_full_into

    model = build_model(arch)
    load_full_into(model, sd, f"{arch.scalevec} state dict")
    return fold_to_stock(model, arch)
