"""Export any strategy to Hugging Face, and measure the export itself.

* A strategy that folds to stock megatron-core (no DNP on V / gate / up) goes out as a stock
  architecture (hf.py: Llama, Qwen3, Mixtral, Qwen3-MoE) where one fits: no custom code.
* DNP (e.g. ``unified``, ``hg+dnp``), dense or MoE: every foldable vector is folded (HG
  gammas into the matrices and the router, OR / ER resolved to plain gammas, Q/K norms to
  Qwen3's), and the V / gate / up norms' gammas are kept (per expert; a norm shared by the
  routed experts, ``expert_vectors='shared'``, is written once per expert; the shared
  expert's own). The directory then carries our own modeling file (``hf_modeling.py``
  copied as ``modeling_scalevec.py``: a Qwen3 subclass with megatron-core's MoE layer, plain
  code we ship) registered with the Auto classes through ``auto_map``, loaded with
  ``trust_remote_code=True``.
* The same file also takes an MoE model no stock family fits (a shared expert, dense layers
  between MoE ones, pre-softmax routing without Q/K norms), DNP or not.
* Refused in one line: LayerNorm or a non-gated MLP (hf.py), and routing other than
  megatron-core's default softmax top-k (:func:`check_routing`).

The export is written to a temporary directory, loaded back from there with transformers at
the chosen dtype (the stock families without remote code), and its logits compared with the
source model's float32 logits on a sample batch; only then is it published. The tokenizer
(SentencePiece) is shipped when the source has one (hf_tokenizer.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch

from megatron_scalevec.convert import hf as _hf
from megatron_scalevec.convert.arch import ModelArch
from megatron_scalevec.convert.build import build_model, logits, sample_batch, transformer_config
from megatron_scalevec.convert.io import (
    StateDict,
    atomic_output_dir,
    check_names_and_shapes,
    load_full_into,
    save_safetensors,
)

MODELING_FILE = "modeling_scalevec.py"
REMOTE_ARCH = "ScaleVecQwen3ForCausalLM"
AUTO_MAP = {"AutoConfig": "modeling_scalevec.ScaleVecQwen3Config",
            "AutoModelForCausalLM": "modeling_scalevec.ScaleVecQwen3ForCausalLM"}
_BRANCHES = ("v", "gate", "up")
# our DNP norm (module name below decoder.layers.{i}.) -> (branch, HF module below
# model.layers.{i}.); {e} is an expert id. A norm shared by all routed experts
# (expert_vectors='shared') is written once per expert.
_DNP_NAMES = [
    (r"self_attention\.v_norm", "v", "self_attn.v_proj"),
    (r"mlp\.(gate|up)_norm", None, "mlp.{b}_proj"),
    (r"mlp\.experts\.local_experts\.(\d+)\.(gate|up)_norm", None, "mlp.experts.{e}.{b}_proj"),
    (r"mlp\.experts\.shared_vectors\.(gate|up)_norm", None, "mlp.experts.{e}.{b}_proj"),
    (r"mlp\.shared_experts\.(gate|up)_norm", None, "mlp.shared_expert.{b}_proj"),
]


def _dnp_target(name: str, experts: int) -> tuple[str, list]:
    """(branch, HF gamma names) of one of our DNP gammas (module name + .weight)."""
    layer, rest = name[len("decoder.layers."):].split(".", 1)
    for pattern, branch, theirs in _DNP_NAMES:
        m = re.fullmatch(pattern + r"\.weight", rest)
        if m:
            groups = m.groups()
            branch = branch or groups[-1]
            ids = [groups[0]] if len(groups) == 2 else range(experts) if "{e}" in theirs \
                else [None]
            return branch, [f"model.layers.{layer}.{theirs.format(b=branch, e=e)}.norm.weight"
                            for e in ids]
    raise ValueError(f"no Hugging Face name for the DNP norm {name}")


def _dnp_to_hf(dnp: StateDict, arch: ModelArch) -> tuple[StateDict, list]:
    """Our DNP gammas -> HF names (one copy per expert for shared ones); the branches."""
    out, branches = {}, set()
    for name, gamma in dnp.items():
        branch, keys = _dnp_target(name, arch.num_moe_experts or 0)
        branches.add(branch)
        out.update({key: gamma.clone() for key in keys})
    return out, sorted(branches, key=list(_BRANCHES).index)


def _expected_dnp_shapes(arch: ModelArch, branches: list) -> dict:
    """Every DNP gamma our modeling file builds for ``branches`` (names and shapes)."""
    shapes = {}
    for i in range(arch.num_layers):
        q = f"model.layers.{i}."
        if "v" in branches:
            shapes[q + "self_attn.v_proj.norm.weight"] = (arch.kv_channels,)
        for _, _, gate, up, _, width in _hf._mlp_pairs(arch, i, remote=True):
            for b, key in (("gate", gate), ("up", up)):
                if b in branches:
                    shapes[key[:-len(".weight")] + ".norm.weight"] = (width,)
    return shapes


# megatron-core routing options our modeling file computes only at their defaults
_ROUTING_DEFAULTS = dict(moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
                         moe_router_num_groups=None, moe_router_enable_expert_bias=False,
                         moe_shared_expert_gate=False, moe_expert_capacity_factor=None)


def check_routing(config) -> None:
    """Refuse a megatron MoE config whose routing our modeling file does not compute."""
    bad = {k: getattr(config, k, v) for k, v in _ROUTING_DEFAULTS.items()
           if getattr(config, k, v) != v}
    if bad:
        raise ValueError(f"Hugging Face export of this MoE model: {bad} not supported (the "
                         f"exported router computes {_ROUTING_DEFAULTS})")


def stock_fits(arch: ModelArch) -> Optional[str]:
    """None when a stock Hugging Face family computes ``arch`` (a stock arch), else why not."""
    try:
        _hf.family(arch)
    except ValueError as e:
        return str(e)
    return None


def _remote_config(arch: ModelArch, branches: list, dtype: torch.dtype, ids: dict) -> dict:
    dense = arch.replace(num_moe_experts=None, qk_layernorm=True)
    cfg = _hf.hf_config(dense).to_dict()  # Qwen3; Q/K norm off below when the arch has none
    cfg.update(ids)
    cfg.update(model_type="scalevec_qwen3", architectures=[REMOTE_ARCH], auto_map=AUTO_MAP,
               scalevec_normed_branches=branches, scalevec_qk_norm=arch.qk_layernorm,
               dtype=str(dtype).replace("torch.", ""))
    if arch.is_moe:
        cfg.update(scalevec_moe_layers=_hf.moe_layers(arch), num_experts=arch.num_moe_experts,
                   num_experts_per_tok=arch.moe_router_topk,
                   moe_intermediate_size=arch.moe_ffn_hidden_size or arch.ffn_hidden_size,
                   shared_expert_intermediate_size=(
                       arch.moe_shared_expert_intermediate_size or 0),
                   norm_topk_prob=not arch.moe_router_pre_softmax)
    return cfg


def hf_state(stock_sd: StateDict, stock_arch: ModelArch,
             dnp: StateDict) -> tuple[StateDict, bool, list]:
    """(HF state dict, needs our modeling file, DNP branches) of a folded model: a stock
    family's names where one fits, else our modeling file's; every name and shape checked.
    The one mapping our converter and the Megatron-Bridge bridges (bridge.py) share."""
    remote = bool(dnp) or stock_fits(stock_arch) is not None
    hf_sd = _hf.stock_to_hf(stock_sd, stock_arch, remote)
    expected = _hf._expected_hf_shapes(stock_arch, remote)
    branches = []
    if remote:
        extra, branches = _dnp_to_hf(dnp, stock_arch)
        hf_sd.update(extra)
        expected.update(_expected_dnp_shapes(stock_arch, branches))
    check_names_and_shapes(hf_sd, expected, "Hugging Face export")
    return hf_sd, remote, branches


def remote_config(stock_arch: ModelArch, branches: list, dtype: torch.dtype = torch.float32,
                  ids: Optional[dict] = None) -> dict:
    """``config.json`` of an export that needs our modeling file (auto_map)."""
    return _remote_config(stock_arch, branches, dtype, ids or {})


def export(sd: StateDict, arch: ModelArch, out_dir: str, *, overwrite: bool = False,
           dtype: torch.dtype = torch.float32, tokenizer: Optional[str] = None,
           show_progress: bool = True) -> dict:
    """Write ``sd`` (a full state dict of ``arch``, any strategy) as a Hugging Face directory;
    returns the architecture, whether it needs remote code, and the measured difference."""
    from megatron_scalevec.convert.fold import fold_to_stock  # noqa: PLC0415

    if arch.is_stock:
        stock_sd, stock_arch, dnp = dict(sd), arch, {}
    else:
        model = build_model(arch)
        load_full_into(model, sd, f"{arch.scalevec} state dict")
        stock_sd, stock_arch, dnp = fold_to_stock(model, arch, keep_dnp=True)
    if arch.is_moe:
        check_routing(transformer_config(arch))
    hf_sd, remote, branches = hf_state(stock_sd, stock_arch, dnp)
    with atomic_output_dir(out_dir, overwrite) as tmp:
        ids = {}
        if tokenizer:
            from megatron_scalevec.convert.hf_tokenizer import write_tokenizer  # noqa

            special = write_tokenizer(tokenizer, tmp)
            ids = {f"{k[:-len('_token')]}_token_id": v for k, v in special.items()
                   if k != "unk_token"}
        if remote:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(_remote_config(stock_arch, branches, dtype, ids), f, indent=2,
                          sort_keys=True)
            here = os.path.dirname(os.path.abspath(__file__))
            shutil.copyfile(os.path.join(here, "hf_modeling.py"),
                            os.path.join(tmp, MODELING_FILE))
            name = REMOTE_ARCH
        else:
            config = _hf.hf_config(stock_arch)
            config.dtype = dtype
            for k, v in ids.items():
                setattr(config, k, v)
            config.save_pretrained(tmp)
            name = config.architectures[0]
        save_safetensors(hf_sd, os.path.join(tmp, "model.safetensors"), {"format": "pt"},
                         show_progress, dtype)
        diff = measure(tmp, sd, arch, dtype, remote)
    return {"architecture": name, "remote_code": remote, "dnp_branches": branches,
            "dtype": str(dtype).replace("torch.", ""), "tokenizer": bool(tokenizer),
            "max_logit_diff": diff}


def load_exported(path: str, dtype: torch.dtype, remote: bool):
    """The exported model as transformers loads it by default (its default attention
    implementation; remote code only for our own file)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                trust_remote_code=remote).eval()


@torch.no_grad()
def measure(path: str, sd: StateDict, arch: ModelArch, dtype: torch.dtype,
            remote: bool) -> float:
    """Max |logits(export at dtype) - logits(source, float32)| on a sample batch."""
    src = build_model(arch)
    load_full_into(src, sd, "source")
    tokens, pos = sample_batch(arch)
    ref = logits(src, tokens, pos)
    theirs = load_exported(path, dtype, remote)(input_ids=tokens).logits.float()
    return float((theirs - ref).abs().max())
