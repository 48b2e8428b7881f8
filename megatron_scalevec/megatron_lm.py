"""Megatron-LM integration: what ``--spec megatron_scalevec.megatron_lm_spec scalevec_moe``
installs.

Megatron-LM's ``pretrain_gpt.py`` imports the spec module inside ``gpt_builder()`` (after its
arguments are parsed, while ``setup_model_and_optimizer`` runs) and has no plugin hook, so that
module (:mod:`megatron_scalevec.megatron_lm_spec`, the only one with an effect on import) calls
:func:`install_block_hook` and :func:`install`. Importing this module does nothing. Each
wrapper calls the original and only adds to it; each is looked up at call time:

* megatron-core's ``transformer_block._get_block_submodules`` -- our block spec sized for the
  chunk TransformerBlock is building, from the ``vp_stage`` and config it was given (Megatron-LM
  hands every virtual pipeline chunk the same spec object and never sets parallel_state's
  virtual rank).
* ``get_megatron_optimizer_config`` -- IWD: Megatron's ``config_overrides`` with its 1-D
  no-decay rule replaced by the rules of :mod:`megatron_scalevec.optim` for the strategy the
  ``--spec`` object carries (other overrides, e.g. ``--decoupled-lr``, are kept).
* ``get_megatron_optimizer`` / ``get_megatron_muon_optimizer`` -- remember the model chunks and
  print the one-screen decay summary (which fails loudly when the model lacks the vectors).
* ``training_log`` -- every ``--log-interval``: scale-vector statistics (norm, OR magnitude,
  conservation quantity) per layer and branch to TensorBoard / W&B as ``scalevec/...`` and one
  summary line to stdout.
* ``load_checkpoint`` (``megatron.training.training`` and ``.checkpointing``) -- a checkpoint
  recorded with another strategy is refused in one line before anything is read
  (:mod:`megatron_scalevec.megatron_lm_strategy`, which also reads the strategy from the
  environment and records it in Megatron-LM's ``args``, hence in every checkpoint).

Guards: the training wrappers go in only where ``megatron.training`` is importable and
megatron-core reports a release line this was checked against (:data:`MEGATRON_LM_TAGS`: 0.16
to 0.19, each with its Megatron-LM tag); otherwise a warning says why
(``MEGATRON_SCALEVEC_FORCE_INSTALL=1`` installs anyway when the wrapped names exist).
``get_megatron_muon_optimizer`` is wrapped where it exists (Megatron-LM up to 0.17; from 0.18
Muon is built by ``get_megatron_optimizer`` itself). Installing twice is a no-op. Checked by
running Megatron-LM's own ``pretrain_gpt.py`` (core_v0.16.1, core_v0.19.0) in
tests/megatron_lm/.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
import re
import warnings
from typing import Optional

from megatron_scalevec.config import ScaleVecConfig, unsupported_feature, unsupported_with
from megatron_scalevec.megatron_lm_strategy import (  # the strategy's variables, record, check
    ENV_STRATEGY,
    ENV_VECTOR_WD,
    STRATEGY_ENV_VARS,
    adopt,
    agree_once,
    check_resume,
    env_strategy,
    refuse,
    spec_objects,
    strategy_of_spec,
)

logger = logging.getLogger(__name__)

# megatron-core release line -> the Megatron-LM tag whose training loop this was checked on
MEGATRON_LM_TAGS = {"0.16": "core_v0.16.1", "0.17": "core_v0.17.1", "0.18": "core_v0.18.2",
                    "0.19": "core_v0.19.0"}
ENV_FORCE = "MEGATRON_SCALEVEC_FORCE_INSTALL"
SPEC_ATTRS = ("scalevec_dense", "scalevec_moe")
WRAPPED = ("get_megatron_optimizer_config", "get_megatron_optimizer", "training_log",
           "load_checkpoint")
OPTIONAL = ("get_megatron_muon_optimizer",)  # gone from training.py in Megatron-LM 0.18
_MARK = "__scalevec_original__"

_state: dict = {"installed": False, "model": None, "scalevec": None}

__all__ = ["ENV_STRATEGY", "ENV_VECTOR_WD", "STRATEGY_ENV_VARS", "env_strategy", "install",
           "install_block_hook", "spec_objects", "strategy_of_spec"]


# --------------------------------------------------------------------------- IWD
def iwd_overrides(config, overrides: Optional[dict], scalevec: ScaleVecConfig) -> dict:
    """Megatron's ``config_overrides`` with our decay rules in place of its 1-D rule, and the
    vectors' learning rate (optim.py).

    Without IWD the strategy's decay is Megatron's own: ``overrides`` is kept as is, plus one
    key giving the vectors their LR when ``vector_lr_mult`` is not 1.
    """
    from megatron.core.optimizer import ParamKey, ParamWithNamePredicate  # noqa: PLC0415

    from megatron_scalevec import optim  # noqa: PLC0415 (optimizer imports only when used)

    overrides = dict(overrides or {})
    if not scalevec.iwd:
        lr = optim.lr_override(scalevec, config)
        if lr is not None:
            overrides[ParamKey(with_name_predicate=ParamWithNamePredicate(
                name="scalevec_vector_lr", fn=optim.is_vector))] = lr
        return overrides
    rules = optim.decay_rules(scalevec, config.weight_decay)
    merged = {k: v for k, v in overrides.items() if dict(v) != dict(optim.NO_DECAY)}
    merged.update(optim.config_overrides(rules, config, scalevec))
    return merged


def lr_conflict(config_overrides: Optional[dict], model_chunks) -> Optional[str]:
    """An override of someone else's (not ``scalevec_*``) that also sets a vector's LR, e.g.
    megatron-core 0.19's MuP under SGD (``--use-mup``): megatron-core would raise on the
    conflict; named here in one line. None when there is none."""
    ours = "scalevec_"
    for key, override in (config_overrides or {}).items():
        pred = getattr(key, "with_name_predicate", None)
        if getattr(pred, "name", "").startswith(ours) or not \
                ({"max_lr", "min_lr"} & set(override)):
            continue
        for chunk in model_chunks:
            for name, p in chunk.named_parameters():
                if getattr(p, "scalevec_role", None) and key.matches(p, name):
                    label = getattr(pred, "name", None) or key
                    return (f"the override {label} also sets the learning rate of scale vector "
                            f"{name} ({dict(override)}), which our vector_lr_mult sets: set "
                            f"MEGATRON_SCALEVEC_VECTOR_LR_MULT=1, or drop the "
                            f"other (e.g. --use-mup with --optimizer sgd)")
    return None


def refuse_unsupported(args, scalevec: Optional[ScaleVecConfig] = None) -> None:
    """One line and exit 2 for a flag the scale-vector specs (or this strategy) do not support
    (when Megatron-LM imports our --spec module, before the model is built; again for the
    optimizer config)."""
    why = unsupported_feature(args) or (scalevec and unsupported_with(args, scalevec))
    if why:
        refuse(why)


def start(scalevec: ScaleVecConfig) -> None:
    """Where Megatron-LM's ``--spec`` imports our spec module (inside ``gpt_builder``, before
    the model is built; a no-op outside Megatron-LM): flags this strategy cannot honour are
    refused, the ranks agree on the strategy and ``args`` records it (every checkpoint then
    holds it)."""
    try:
        from megatron.training import get_args  # noqa: PLC0415

        args = get_args()
    except (ImportError, AssertionError, AttributeError):  # no Megatron-LM, or no args yet
        return
    if args is not None:
        refuse_unsupported(args, scalevec)
        adopt(args, scalevec)


def wrap_optimizer_config(original):
    """``get_megatron_optimizer_config(args)`` that applies IWD for our ``--spec``."""
    def get_megatron_optimizer_config(args):
        config, overrides = original(args)
        scalevec = strategy_of_spec(getattr(args, "spec", None))
        if scalevec is None:
            return config, overrides
        refuse_unsupported(args, scalevec)
        _state["scalevec"] = scalevec
        return config, iwd_overrides(config, overrides, scalevec)

    setattr(get_megatron_optimizer_config, _MARK, original)
    return get_megatron_optimizer_config


def wrap_optimizer_builder(original, log=None):
    """An optimizer builder that remembers the model and prints the decay summary."""
    def builder(config, model_chunks, *args, **kwargs):
        _state["model"] = list(model_chunks)
        scalevec = _state["scalevec"]
        if scalevec is not None:
            import torch.distributed as dist  # noqa: PLC0415

            from megatron_scalevec import optim  # noqa: PLC0415

            if scalevec.vector_lr_mult != 1.0:
                why = lr_conflict(kwargs.get("config_overrides"), _state["model"])
                if why:
                    refuse(why)
            rules = optim.decay_rules(scalevec, config.weight_decay)
            summary = optim.decay_summary(rules, _state["model"], config.weight_decay,
                                          scalevec, config.lr)
            if not dist.is_initialized() or dist.get_rank() == 0:
                if log is None:
                    print(summary, flush=True)
                else:
                    log(summary)
        return original(config, model_chunks, *args, **kwargs)

    setattr(builder, _MARK, original)
    builder.__name__ = getattr(original, "__name__", "builder")
    return builder


# --------------------------------------------------------------------------- logging
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def global_stat_names(stats: dict, model_chunks, ep_rank: int = 0) -> dict:
    """Rename this rank's ``sv/...`` keys to global layer (and expert) numbers."""
    out = {}
    for chunk_idx, chunk in enumerate(model_chunks):
        root = chunk
        while hasattr(root, "module"):
            root = root.module
        layers = getattr(getattr(root, "decoder", None), "layers", None)
        offset = layers[0].layer_number - 1 if layers is not None and len(layers) else 0
        n_local = max((len(m.local_experts) for m in root.modules()
                       if hasattr(m, "local_experts")), default=0)
        prefix = "sv/" if len(model_chunks) == 1 else f"sv/chunk{chunk_idx}/"
        for key, value in stats.items():
            if not key.startswith(prefix):
                continue
            name = _LAYER.sub(lambda m, o=offset: f"decoder.layers.{o + int(m.group(1))}.",
                              key[len(prefix):])
            first = ep_rank * n_local
            name = _EXPERT.sub(lambda m, f=first: f"local_experts.{f + int(m.group(1))}.", name)
            out[f"scalevec/{name}"] = value
    return out


def summary_line(stats: dict) -> str:
    """One stdout line: means over every vector of the model."""
    parts = []
    for suffix, label in (("/norm", "|gamma|"), ("/beta", "beta"),
                          ("/conservation", "gamma^2-|w|^2")):
        vals = [v for k, v in stats.items() if k.endswith(suffix) and math.isfinite(v)]
        if vals:
            parts.append(f"{label} mean {sum(vals) / len(vals):.4g} (n={len(vals)})")
    return "scale vectors: " + (" | ".join(parts) if parts else "none")


def log_vector_stats(model_chunks, iteration: int) -> dict:
    """Collect the statistics of every pipeline stage and write them on the logging rank."""
    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core import parallel_state  # noqa: PLC0415

    from megatron_scalevec.training.monitor import scale_vector_stats  # noqa: PLC0415

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    stats = global_stat_names(scale_vector_stats(model_chunks), model_chunks, ep_rank)
    if dist.is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        gathered = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, stats,
                               group=parallel_state.get_pipeline_model_parallel_group())
        stats = {k: v for part in gathered for k, v in part.items()}
    from megatron.training import (  # noqa: PLC0415
        get_tensorboard_writer,
        get_wandb_writer,
        print_rank_last,
    )

    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    if writer is not None:
        for k, v in stats.items():
            writer.add_scalar(k, v, iteration)
    if wandb_writer:
        wandb_writer.log(stats, iteration)
    print_rank_last(f" [iteration {iteration}] {summary_line(stats)}")
    return stats


def wrap_training_log(original):
    """``training_log`` that adds the scale-vector statistics every ``--log-interval``."""
    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        if _state["model"] is not None and not kwargs.get("is_first_iteration", False):
            from megatron.training import get_args  # noqa: PLC0415

            if iteration % get_args().log_interval == 0:
                log_vector_stats(_state["model"], iteration)
        return result

    setattr(training_log, _MARK, original)
    return training_log


# --------------------------------------------------------------------------- block
BLOCK_HOOK = ("megatron.core.transformer.transformer_block", "_get_block_submodules")


def wrap_block_submodules(original):
    """megatron-core's ``_get_block_submodules(config, spec, vp_stage, pp_rank)`` (private,
    called by ``TransformerBlock.__init__``; the same signature in 0.16.1 and 0.19.2) that
    sizes our lazy block spec for the chunk being built: Megatron-LM passes ``vp_stage`` to
    the model provider and on to the block, never to parallel_state, and hands every chunk the
    same spec object. Any other spec goes to the original. The first block built also checks
    that every rank read the same strategy (megatron_lm_strategy.agree_once)."""
    from megatron_scalevec.specs import ScaleVecBlockSubmodules  # noqa: PLC0415

    @functools.wraps(original)
    def _get_block_submodules(config, spec, vp_stage=None, pp_rank=None):
        sub = getattr(spec, "submodules", None)
        if isinstance(sub, ScaleVecBlockSubmodules):
            agree_once(sub.scalevec)  # every rank builds a block, torch.distributed is up
            return sub.resolve(config, vp_stage, pp_rank)
        return original(config, spec, vp_stage, pp_rank)

    setattr(_get_block_submodules, _MARK, original)
    return _get_block_submodules


def install_block_hook() -> bool:
    """Install :func:`wrap_block_submodules` (idempotent); False where megatron-core lacks it
    (the lazy spec then refuses to build, specs._build_context)."""
    module = importlib.import_module(BLOCK_HOOK[0])
    fn = getattr(module, BLOCK_HOOK[1], None)
    if fn is None:
        return False
    if not hasattr(fn, _MARK):
        setattr(module, BLOCK_HOOK[1], wrap_block_submodules(fn))
    return True


# --------------------------------------------------------------------------- resume
def wrap_load_checkpoint(original):
    """``load_checkpoint`` that first refuses a checkpoint recorded with another strategy
    (megatron_lm_strategy.check_resume), before Megatron-LM reads any tensor."""
    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        from megatron.training import get_args  # noqa: PLC0415

        margs = get_args()
        scalevec = strategy_of_spec(getattr(margs, "spec", None))
        if scalevec is not None:
            check_resume(margs, scalevec)
        return original(*args, **kwargs)

    setattr(load_checkpoint, _MARK, original)
    return load_checkpoint


# --------------------------------------------------------------------------- install
_WRAPPERS = {"get_megatron_optimizer_config": wrap_optimizer_config,
             "get_megatron_optimizer": wrap_optimizer_builder,
             "get_megatron_muon_optimizer": wrap_optimizer_builder,
             "training_log": wrap_training_log,
             "load_checkpoint": wrap_load_checkpoint}


def install_into(training_module) -> list:
    """Wrap the functions of ``training_module`` (idempotent). Returns the names wrapped now."""
    done = []
    for name, wrap in _WRAPPERS.items():
        fn = getattr(training_module, name, None)
        if fn is None or hasattr(fn, _MARK):
            continue
        setattr(training_module, name, wrap(fn))
        done.append(name)
    return done


def install() -> bool:
    """Install into Megatron-LM when it is there and at the checked version; else no-op."""
    if _state["installed"]:
        return True
    try:
        training = importlib.import_module("megatron.training.training")
        from megatron.core.package_info import __version__ as core_version  # noqa: PLC0415
    except ImportError:
        return False  # not inside Megatron-LM: nothing to install
    from megatron_scalevec.convert.safe_load import install_metadata_guard  # noqa: PLC0415

    install_metadata_guard()  # Megatron-LM's --load: DCP .metadata never unpickles code
    missing = [n for n in WRAPPED if not hasattr(training, n)]
    force = os.environ.get(ENV_FORCE, "") == "1"
    line = ".".join(core_version.split(".")[:2])
    if (line not in MEGATRON_LM_TAGS and not force) or missing:
        checked = ", ".join(f"{k} ({v})" for k, v in MEGATRON_LM_TAGS.items())
        warnings.warn(
            f"megatron_scalevec: Megatron-LM integration NOT installed (megatron-core "
            f"{core_version}, checked against {checked}; missing names: "
            f"{missing or 'none'}). The model still uses the "
            f"scale-vector spec, but IWD falls back to Megatron's default weight decay and no "
            f"scale-vector statistics are logged. Set {ENV_FORCE}=1 to try anyway.",
            stacklevel=2)
        return False
    install_into(training)
    checkpointing = importlib.import_module("megatron.training.checkpointing")
    install_into(checkpointing)  # the same wrapper where other callers look it up
    _state["installed"] = True
    return True
