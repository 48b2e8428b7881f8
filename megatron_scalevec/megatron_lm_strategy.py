"""The strategy of a Megatron-LM run: read, agreed, recorded, checked on resume.

Megatron-LM rejects flags it does not know, so the strategy comes from the environment, read
when Megatron-LM's ``--spec`` imports :mod:`megatron_scalevec.megatron_lm_spec`:

=====================================  ==============================================
variable                               ScaleVecConfig field (default)
=====================================  ==============================================
``MEGATRON_SCALEVEC``                  the strategy string (``unified``)
``MEGATRON_SCALEVEC_VECTOR_WD``        ``scale_vector_weight_decay`` (``--weight-decay``)
``MEGATRON_SCALEVEC_EXPERT_VECTORS``   ``expert_vectors`` (``per_expert``)
``MEGATRON_SCALEVEC_DECAY_DIRECTION``  ``decay_direction`` (``0``; ``1`` / ``0``)
``MEGATRON_SCALEVEC_DP_OUTPUT_ROLE``   ``dp_output_role`` (``input``)
``MEGATRON_SCALEVEC_LAYERNORM_BIAS``   ``layernorm_bias`` (``stock``)
``MEGATRON_SCALEVEC_VECTOR_LR_MULT``   ``vector_lr_mult`` (30; 1 under ``shared``; > 0)
=====================================  ==============================================

Then (:func:`adopt`, at that import) the whole strategy is written into Megatron-LM's ``args``
as ``args.scalevec`` (its fields as plain data), which Megatron-LM pickles into every checkpoint
it saves, and every rank must have read the same strategy (:func:`agree_once`: one
``all_gather_object`` once ``torch.distributed`` is up: at that import in Megatron-LM 0.16,
whose ``gpt_builder`` imports the spec; at the first block built in 0.19, whose
``pretrain_gpt.py`` imports it while building its config, before ``pretrain`` initializes
``torch.distributed``; a rank that read another strategy stops the run in one line)
(its common state). Before Megatron-LM loads a checkpoint, :func:`check_resume` reads that record
(weights-only) and refuses a different strategy in one line naming both: a resume that changes
only IWD's decay would otherwise continue silently, and most other changes fail with a raw
load error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Optional

from megatron_scalevec.config import ScaleVecConfig

logger = logging.getLogger(__name__)

ENV_STRATEGY = "MEGATRON_SCALEVEC"
ENV_VECTOR_WD = "MEGATRON_SCALEVEC_VECTOR_WD"
OPTION_FIELDS = ("expert_vectors", "decay_direction", "dp_output_role", "layernorm_bias",
                 "vector_lr_mult")
OPTION_ENV = {f: f"{ENV_STRATEGY}_{f.upper()}" for f in OPTION_FIELDS}
# every variable meant for Megatron-LM (our trainer refuses them: it has flags)
STRATEGY_ENV_VARS = (ENV_STRATEGY, ENV_VECTOR_WD, *OPTION_ENV.values())
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _option(field: str, text: str):
    kind = {f.name: f.type for f in dataclasses.fields(ScaleVecConfig)}[field]
    if kind in ("bool", bool):
        if text.lower() not in _BOOLS:
            raise ValueError(f"{OPTION_ENV[field]}={text!r}: use 1 or 0")
        return _BOOLS[text.lower()]
    if "float" in str(kind):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{OPTION_ENV[field]}={text!r}: use a number") from None
    return text


def env_strategy(environ=None) -> Optional[ScaleVecConfig]:
    """The strategy the environment asks for, or None when it asks for nothing."""
    environ = os.environ if environ is None else environ
    text, wd = environ.get(ENV_STRATEGY, "").strip(), environ.get(ENV_VECTOR_WD, "").strip()
    options = {f: environ.get(v, "").strip() for f, v in OPTION_ENV.items()}
    options = {f: v for f, v in options.items() if v}
    if not text and not wd and not options:
        return None
    try:
        svwd = float(wd) if wd else None
        return ScaleVecConfig.from_string(text or "unified", scale_vector_weight_decay=svwd,
                                          **{f: _option(f, v) for f, v in options.items()})
    except ValueError as e:
        named = ", ".join(f"{k}={environ[k]!r}" for k in STRATEGY_ENV_VARS if environ.get(k))
        raise ValueError(f"{named}: {e}") from None


def spec_objects(environ=None) -> tuple:
    """``(scalevec_dense, scalevec_moe)`` for the ``--spec`` module: lazy block specs of the
    environment's strategy, else of the unified one."""
    from megatron_scalevec import specs  # noqa: PLC0415 (megatron-core only when used)

    cfg = env_strategy(environ)
    if cfg is not None:
        logger.warning("megatron_scalevec: the environment's strategy for --spec scalevec_*: "
                       "%s", cfg.describe())
    return tuple(specs.block_module_spec(cfg or "unified") for _ in ("dense", "moe"))


def strategy_of_spec(spec_tokens) -> Optional[ScaleVecConfig]:
    """The strategy of a Megatron-LM ``args.spec`` (module, attribute) if it is one of ours."""
    if not spec_tokens or len(spec_tokens) != 2:
        return None
    import importlib  # noqa: PLC0415

    from megatron_scalevec.specs import ScaleVecBlockSubmodules  # noqa: PLC0415 (when used)

    try:
        obj = getattr(importlib.import_module(spec_tokens[0]), spec_tokens[1], None)
    except ImportError:
        return None
    sub = getattr(obj, "submodules", None)
    return sub.scalevec if isinstance(sub, ScaleVecBlockSubmodules) else None


def refuse(message: str) -> None:
    """One line on stderr and exit 2 (Megatron-LM's ranks all reach the same check).

    With ``torch.distributed`` up, the process leaves at once: interpreter shutdown with live
    process groups can abort in C++ ("terminate called without an active exception", exit
    -6 instead of 2), and a refusal comes before anything is written."""
    import torch.distributed as dist  # noqa: PLC0415

    print(f"megatron_scalevec: {message}", file=sys.stderr, flush=True)
    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        os._exit(2)
    raise SystemExit(2)


# --------------------------------------------------------------------------- start-up
def ranks_disagree(cfg: ScaleVecConfig) -> Optional[str]:
    """None when every rank read ``cfg``; else which ranks read what (one collective)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, cfg.to_dict())
    if all(s == seen[0] for s in seen):
        return None
    first = next(r for r, s in enumerate(seen) if s != seen[0])
    return (f"the ranks read different strategies from the environment: rank 0 "
            f"{ScaleVecConfig.from_dict(seen[0]).describe()}, rank {first} "
            f"{ScaleVecConfig.from_dict(seen[first]).describe()}: set the same "
            f"{ENV_STRATEGY}* variables on every node")


_agreed: dict = {"done": False}


def agree_once(cfg: ScaleVecConfig) -> None:
    """The ranks' strategies compared once, where ``torch.distributed`` is up (else a no-op:
    the next caller checks; megatron_lm.py's block hook calls it for every chunk built)."""
    import torch.distributed as dist  # noqa: PLC0415

    if _agreed["done"] or not (dist.is_available() and dist.is_initialized()):
        return
    _agreed["done"] = True
    why = ranks_disagree(cfg)
    if why:
        refuse(why)


def adopt(args, cfg: ScaleVecConfig) -> None:
    """At ``--spec`` import, inside Megatron-LM: ``args`` records ``cfg`` (Megatron-LM saves
    ``args`` in every checkpoint), and the ranks agree on it (now, or at the first block)."""
    args.scalevec = cfg.to_dict()
    agree_once(cfg)


# --------------------------------------------------------------------------- resume
def checkpoint_to_load(args) -> Optional[str]:
    """The iteration folder Megatron-LM's ``load_checkpoint`` is about to read, if any: the
    tracker's in ``--load``, else (fine-tuning) ``--pretrained-checkpoint``'s."""
    from megatron_scalevec.convert.megatron_lm import resolve_save_dir  # noqa: PLC0415

    for root in (getattr(args, "load", None), getattr(args, "pretrained_checkpoint", None)):
        if root and os.path.isdir(root):
            found = resolve_save_dir(root)
            if found != root or os.path.isfile(os.path.join(root, "metadata.json")):
                return found
    return None


def check_resume(args, cfg: ScaleVecConfig) -> None:
    """Refuse (one line, exit 2) a checkpoint whose recorded strategy is not ``cfg``."""
    from megatron_scalevec.convert import megatron_lm as ckpt  # noqa: PLC0415

    path = checkpoint_to_load(args)
    if path is None:
        return
    if ckpt.is_legacy_checkpoint(path):
        logger.warning("megatron_scalevec: %s is in the legacy torch format: its strategy is "
                       "not checked", path)
        return
    if not ckpt.is_megatron_lm_checkpoint(path):
        return  # not a checkpoint Megatron-LM can load as torch_dist either: its own error
    try:
        recorded = ckpt.recorded_strategy(ckpt.read_args(path))
    except ValueError as e:
        refuse(f"{path}: {e}")
    if recorded is None:  # written by our --spec before runs recorded their strategy
        logger.warning("megatron_scalevec: %s records no strategy: not checked", path)
        return
    diff = ckpt.strategy_mismatch(recorded, cfg)
    fresh_optimizer = getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)
    if diff and recorded != ckpt.STOCK and fresh_optimizer and \
            recorded.replace(vector_lr_mult=cfg.vector_lr_mult) == cfg:
        logger.warning("megatron_scalevec: %s trained its vectors at %g x the LR; this run "
                       "starts a fresh optimizer at %g x", path, recorded.vector_lr_mult,
                       cfg.vector_lr_mult)
        return
    if diff:
        how = ("drop --spec to resume it" if recorded == ckpt.STOCK else
               f"resume it with {env_for(recorded)}")
        if recorded != ckpt.STOCK and recorded.replace(vector_lr_mult=cfg.vector_lr_mult) == cfg:
            how += " (or pass --no-load-optim to start the optimizer afresh at this multiplier)"
        refuse(f"checkpoint {path} has another strategy: {diff}; {how}")


def env_for(cfg: ScaleVecConfig) -> str:
    """The variables that give ``cfg`` (its string and every non-default option)."""
    parts = [f"{ENV_STRATEGY}={cfg.to_string()}"]
    if cfg.scale_vector_weight_decay is not None:
        parts.append(f"{ENV_VECTOR_WD}={cfg.scale_vector_weight_decay}")
    default = ScaleVecConfig.from_string(cfg.to_string())
    for field, var in OPTION_ENV.items():
        value = getattr(cfg, field)
        if value != getattr(default, field):
            text = int(value) if isinstance(value, bool) else \
                f"{value:g}" if isinstance(value, float) else value
            parts.append(f"{var}={text}")
    return " ".join(parts)
