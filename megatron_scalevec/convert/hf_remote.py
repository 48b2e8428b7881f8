"""Export any strategy to Hugging Face, and measure the export itself.

* A strategy that folds to stock megatron-core (no DNP on V / gate / up) goes out as a stock
  architecture (hf.py: Llama, Qwen3, Mixtral, Qwen3-MoE): no custom code.
* DNP (e.g. ``unified``): every foldable vector is folded (HG gammas into the matrices, OR /
  ER resolved to plain gammas, Q/K norms to Qwen3's), and the V / gate / up norms' gammas are
  kept; the directory then carries our own modeling file (``hf_modeling.py`` copied as
  ``modeling_scalevec.py``: a Qwen3 subclass, plain code we ship) registered with the Auto
  classes through ``auto_map``, loaded with ``trust_remote_code=True``. Dense models only so
  far; MoE with DNP is refused with that reason.

The export is written to a temporary directory, loaded back from there with transformers at
the chosen dtype (the stock families without remote code), and its logits compared with the
source model's float32 logits on a sample batch; only then is it published. The tokenizer
(SentencePiece) is shipped when the source has one (hf_tokenizer.py).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megatron_scalevec.convert import hf as _hf
from megatron_scalevec.convert.arch import ModelArch, build_model, logits, sample_batch
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
_BRANCH_NAMES = {"self_attention.v_norm": ("v", "self_attn.v_proj.norm.weight"),
                 "mlp.gate_norm": ("gate", "mlp.gate_proj.norm.weight"),
                 "mlp.up_norm": ("up", "mlp.up_proj.norm.weight")}


def _dnp_to_hf(dnp: StateDict, arch: ModelArch) -> tuple[StateDict, list]:
    """Our DNP gammas (module name + .weight) -> HF names; the branches present."""
    out, branches = {}, set()
    for name, gamma in dnp.items():
        layer, rest = name[len("decoder.layers."):].split(".", 1)
        key = rest[:-len(".weight")]
        if key not in _BRANCH_NAMES:
            raise ValueError(f"no Hugging Face name for the DNP norm {name}")
        branch, theirs = _BRANCH_NAMES[key]
        branches.add(branch)
        out[f"model.layers.{layer}.{theirs}"] = gamma
    return out, sorted(branches, key=["v", "gate", "up"].index)


def _remote_config(arch: ModelArch, branches: list, dtype: torch.dtype, ids: dict) -> dict:
    cfg = _hf.hf_config(arch).to_dict()  # Qwen3 (the arch has Q/K norms)
    cfg.update(ids)
    cfg.update(model_type="scalevec_qwen3", architectures=[REMOTE_ARCH], auto_map=AUTO_MAP,
               scalevec_normed_branches=branches, dtype=str(dtype).replace("torch.", ""))
    return cfg


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
    remote = bool(dnp)
    if remote and arch.is_moe:
        raise ValueError("Hugging Face export of an MoE model with DNP norms on V/gate/up is "
                         "not implemented (dense models only); keep the scale-vector format")
    hf_sd = _hf.stock_to_hf(stock_sd, stock_arch)
    check_names_and_shapes(hf_sd, _hf._expected_hf_shapes(stock_arch), "Hugging Face export")
    branches = []
    if remote:
        extra, branches = _dnp_to_hf(dnp, stock_arch)
        hf_sd.update(extra)
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
