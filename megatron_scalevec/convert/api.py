"""The conversions end to end (read any source, convert, write atomically); the CLI's engine.

Sources are detected by their files: our full format (``scalevec_arch.json`` +
``model.safetensors``), a dist checkpoint (``metadata.json``; saved at any TP/PP/EP, arch from
its ``scalevec_arch.json``, from the args Megatron-LM saved in its common state, or ``arch=``), a
save directory (our trainer's ``latest`` ``iter_N``, written with ``scalevec_arch.json`` and
the tokenizer; Megatron-LM's ``latest_checkpointed_iteration.txt`` and ``iter_*``), or a
Hugging Face directory (``config.json``). A ``tokenizer.model`` beside the source travels
with every output (``tokenizer=`` overrides it).
Targets: ``stock`` (fold), a strategy string (warm start), or ``hf``. Every variant reaches
every other through stock: fold (exact) then warm start. A target equal to the source's
strategy only changes the format (full <-> dist; a dist checkpoint loads at any layout).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_scalevec.convert import hf as _hf
from megatron_scalevec.convert.arch import ARCH_FILE, STOCK, ModelArch
from megatron_scalevec.convert.build import build_model
from megatron_scalevec.convert.fold import fold_state_dict
from megatron_scalevec.convert.io import (
    TOKENIZER_FILE,
    StateDict,
    full_state_dict,
    is_dist_checkpoint,
    is_full_checkpoint,
    load_dist,
    load_full,
    load_full_into,
    resolve_checkpoint,
    save_dist,
    save_full,
    verify_checkpoint_files,
)
from megatron_scalevec.convert.megatron_lm import (
    arch_from_args,
    is_legacy_checkpoint,
    is_megatron_lm_checkpoint,
    legacy_refusal,
    read_args,
)
from megatron_scalevec.convert.warmstart import FunctionChangeError, warm_start

FORMATS = ("full", "dist")


def detect(path: str) -> str:
    if is_legacy_checkpoint(path):
        raise ValueError(legacy_refusal(path))
    if is_full_checkpoint(path):
        return "full"
    if is_dist_checkpoint(path):
        return "dist"
    if os.path.isfile(os.path.join(path, "metrics.jsonl")):
        raise FileNotFoundError(f"{path}: a run directory without a checkpoint (metrics.jsonl "
                                f"but no latest/iter_N): train with --save {path} (the "
                                f"trainer's --save dir is what --load converts)")
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise FileNotFoundError(f"{path}: not a full (model.safetensors + scalevec_arch.json), dist "
                            f"(metadata.json) or Hugging Face (config.json) checkpoint")


def read_checkpoint(path: str, arch: Optional[ModelArch] = None,
                    verify: bool = True) -> tuple[StateDict, ModelArch]:
    """(full state dict, arch) of any supported source; HF sources come back as stock.
    A checksum manifest beside the files is checked first (``verify=False``: sizes only)."""
    path = resolve_checkpoint(path)
    kind = detect(path)
    verify_checkpoint_files(path, hashes=verify)
    if kind == "hf":
        return _hf.import_hf(path)
    if kind == "full":
        sd, own = load_full(path)
        return sd, arch or own
    if arch is None and not os.path.isfile(os.path.join(path, ARCH_FILE)):
        if not is_megatron_lm_checkpoint(path):
            raise FileNotFoundError(f"{path}: a dist checkpoint without {ARCH_FILE} (from a "
                                    f"trainer older than this converter): pass --arch "
                                    f"arch.json (fields: convert/arch.py ModelArch)")
        try:
            arch = arch_from_args(read_args(path))
        except ValueError as e:
            raise ValueError(f"{path} (Megatron-LM): {e}") from None
    arch = arch or ModelArch.load(path)
    return full_state_dict(load_dist(path, arch)), arch


def source_tokenizer(path: str) -> Optional[str]:
    """The SentencePiece model stored beside a checkpoint, if any."""
    found = os.path.join(resolve_checkpoint(path), TOKENIZER_FILE)
    return found if os.path.isfile(found) else None


def write_checkpoint(sd: StateDict, arch: ModelArch, path: str, fmt: str = "full",
                     overwrite: bool = False, tokenizer: Optional[str] = None) -> None:
    """Write ours: ``full`` (safetensors) or ``dist`` (dist_checkpointing, any layout)."""
    files = {TOKENIZER_FILE: tokenizer} if tokenizer else None
    if fmt == "full":
        model = build_model(arch)  # verifies every name and shape against the real model
        load_full_into(model, sd, f"{arch.scalevec} state dict")
        save_full(sd, arch, path, overwrite, files=files)
    elif fmt == "dist":
        model = build_model(arch)
        load_full_into(model, sd, f"{arch.scalevec} state dict")
        save_dist(model, path, arch, overwrite, files=files)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def convert(source: str, output: str, target: str, *, arch: Optional[ModelArch] = None,
            fmt: str = "full", allow_function_change: bool = False, overwrite: bool = False,
            dtype: torch.dtype = torch.float32, tokenizer: Optional[str] = None,
            verify: bool = True) -> dict:
    """Convert ``source`` to ``target`` (``stock``, ``hf`` or a strategy) at ``output``.

    Returns a report: source/target, and the max logit difference on a sample batch between
    the source model and the converted one (0 up to rounding unless DNP was added); for
    ``hf`` measured on the exported model loaded back from ``output`` at ``dtype``. Without
    CUDA, call ``compat.cpu.enable_cpu_compat()`` first, as the command line does."""
    if os.path.exists(output) and not overwrite:
        raise FileExistsError(f"output {output} exists; pass --overwrite")
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"tokenizer model {tokenizer!r} does not exist")
    tokenizer = tokenizer or source_tokenizer(source)
    sd, src_arch = read_checkpoint(source, arch, verify)
    report = {"source": src_arch.scalevec, "target": target}
    if target == "hf":
        from megatron_scalevec.convert.hf_remote import export  # noqa: PLC0415

        report.update(export(sd, src_arch, output, overwrite=overwrite, dtype=dtype,
                             tokenizer=tokenizer))
        return report
    if _canonical(target) == _canonical(src_arch.scalevec):
        # same strategy: a change of format/layout only (works for DNP models too)
        write_checkpoint(sd, src_arch, output, fmt, overwrite, tokenizer)
        return {**report, "max_logit_diff": 0.0}
    try:  # every other target is reached through the exact fold to stock
        stock_sd, stock_arch = fold_state_dict(sd, src_arch)
    except FunctionChangeError as e:
        raise FunctionChangeError(
            f"cannot convert {source} ({src_arch.scalevec}) to {target}: {e}. Instead: "
            f"--to {src_arch.scalevec} --format dist/full (same strategy, any layout), --to hf "
            f"(exports modeling_scalevec.py), or train with a strategy without DNP (e.g. "
            f"hg+dp+or), which folds to stock exactly") from None
    if target == STOCK:
        out_sd, out_arch = stock_sd, stock_arch
        report["max_logit_diff"] = _diff_to_source(sd, src_arch, stock_sd, stock_arch)
    else:
        model, wreport = warm_start(stock_sd, stock_arch, target,
                                    allow_function_change=allow_function_change)
        out_sd, out_arch = full_state_dict(model), stock_arch.replace(scalevec=wreport["target"])
        report.update(wreport)
    write_checkpoint(out_sd, out_arch, output, fmt, overwrite, tokenizer)
    return report


def _canonical(strategy: str) -> str:
    if strategy == STOCK:
        return STOCK
    from megatron_scalevec.config import ScaleVecConfig

    return ScaleVecConfig.from_string(strategy).to_string()


def _diff_to_source(sd, arch, stock_sd, stock_arch) -> float:
    from megatron_scalevec.convert.build import logits, sample_batch

    a, b = build_model(arch), build_model(stock_arch)
    load_full_into(a, sd, "source")
    load_full_into(b, stock_sd, "stock")
    tokens, pos = sample_batch(arch)
    return float((logits(a, tokens, pos) - logits(b, tokens, pos)).abs().max())
