"""Megatron-LM integration: what ``--spec megatron_scalevec.megatron_lm_spec scalevec_moe``
installs.

Megatron-LM's ``pretrain_gpt.py`` imports the spec module inside ``gpt_builder()`` (after its
arguments are parsed, while ``setup_model_and_optimizer`` runs) and has no plugin hook, so that
module (:mod:`megatron_scalevec.megatron_lm_spec`, the only one with an effect on import) calls
:func:`install`, which puts three wrappers into ``megatron.training.training``. Importing this
module does nothing. Each wrapper calls the original and only adds to it; each is looked up by
Megatron at call time, after the model is built:

* ``get_megatron_optimizer_config`` -- IWD: Megatron's ``config_overrides`` with its 1-D
  no-decay rule replaced by the rules of :mod:`megatron_scalevec.optim` for the strategy the
  ``--spec`` object carries (other overrides, e.g. ``--decoupled-lr``, are kept).
* ``get_megatron_optimizer`` / ``get_megatron_muon_optimizer`` -- remember the model chunks and
  print the one-screen decay summary (which fails loudly when the model lacks the vectors).
* ``training_log`` -- every ``--log-interval``: scale-vector statistics (norm, OR magnitude,
  conservation quantity) per layer and branch to TensorBoard / W&B as ``scalevec/...`` and one
  summary line to stdout. (Megatron's MoE aux-loss tracker would need no wrap but is only read
  for MoE models and sums per micro-batch; these statistics are per-parameter, not per-batch.)

Guards: nothing happens unless ``megatron.training`` is importable and megatron-core reports a
release line this was checked against (:data:`MEGATRON_LM_TAGS`: 0.16 to 0.19, each with its
Megatron-LM tag); otherwise a warning says why and Megatron-LM runs unchanged
(``MEGATRON_SCALEVEC_FORCE_INSTALL=1`` installs anyway when the wrapped names exist).
``get_megatron_muon_optimizer`` is wrapped where it exists (Megatron-LM up to 0.17; from 0.18
Muon is built by ``get_megatron_optimizer`` itself). Installing twice is a no-op.

Strategy (no new CLI flags; Megatron-LM rejects unknown ones): the ``--spec`` attributes carry
the unified strategy (hg+dnp+or+iwd). The environment variable ``MEGATRON_SCALEVEC`` (any
:meth:`ScaleVecConfig.from_string` text, e.g. ``hg+dp+er``) and
``MEGATRON_SCALEVEC_VECTOR_WD`` (decay of Input-Norm vectors; default ``--weight-decay``),
read when the spec module is imported, choose the strategy of both attributes
(:func:`spec_objects`). The strategy is not stored in
Megatron-LM checkpoints: resume with the same environment.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import sys
import warnings
from typing import Optional

from megatron_scalevec.config import ScaleVecConfig, unsupported_feature

logger = logging.getLogger(__name__)

# megatron-core release line -> the Megatron-LM tag whose training loop this was checked on
MEGATRON_LM_TAGS = {"0.16": "core_v0.16.1", "0.17": "core_v0.17.1", "0.18": "core_v0.18.2",
                    "0.19": "core_v0.19.0"}
ENV_STRATEGY = "MEGATRON_SCALEVEC"
ENV_VECTOR_WD = "MEGATRON_SCALEVEC_VECTOR_WD"
ENV_FORCE = "MEGATRON_SCALEVEC_FORCE_INSTALL"
# The variables that choose the strategy inside Megatron-LM (which takes no new flags); our own
# trainer has flags for them and refuses them when set (training/arguments.py).
STRATEGY_ENV_VARS = (ENV_STRATEGY, ENV_VECTOR_WD)
SPEC_ATTRS = ("scalevec_dense", "scalevec_moe")
WRAPPED = ("get_megatron_optimizer_config", "get_megatron_optimizer", "training_log")
OPTIONAL = ("get_megatron_muon_optimizer",)  # gone from training.py in Megatron-LM 0.18
_MARK = "__scalevec_original__"

_state: dict = {"installed": False, "model": None, "scalevec": None}


# --------------------------------------------------------------------------- strategy
def env_strategy(environ=None) -> Optional[ScaleVecConfig]:
    """The strategy the environment asks for, or None when it asks for nothing."""
    environ = os.environ if environ is None else environ
    text, wd = environ.get(ENV_STRATEGY, "").strip(), environ.get(ENV_VECTOR_WD, "").strip()
    if not text and not wd:
        return None
    try:
        svwd = float(wd) if wd else None
        return ScaleVecConfig.from_string(text or "unified", scale_vector_weight_decay=svwd)
    except ValueError as e:
        raise ValueError(f"{ENV_STRATEGY}={text!r} / {ENV_VECTOR_WD}={wd!r}: {e}") from None


def spec_objects(environ=None) -> tuple:
    """``(scalevec_dense, scalevec_moe)`` for the ``--spec`` module: lazy block specs of the
    environment's strategy, else of the unified one."""
    from megatron_scalevec import specs  # noqa: PLC0415 (megatron-core only when used)

    environ = os.environ if environ is None else environ
    cfg = env_strategy(environ)
    if cfg is not None:
        logger.warning("megatron_scalevec: %s=%s: --spec scalevec_* use strategy %s",
                       ENV_STRATEGY, environ.get(ENV_STRATEGY, ""), cfg.to_string())
    return tuple(specs.block_module_spec(cfg or "unified") for _ in SPEC_ATTRS)


def strategy_of_spec(spec_tokens) -> Optional[ScaleVecConfig]:
    """The strategy of a Megatron-LM ``args.spec`` (module, attribute) if it is one of ours."""
    if not spec_tokens or len(spec_tokens) != 2:
        return None
    from megatron_scalevec.specs import ScaleVecBlockSubmodules  # noqa: PLC0415 (when used)

    try:
        obj = getattr(importlib.import_module(spec_tokens[0]), spec_tokens[1], None)
    except ImportError:
        return None
    sub = getattr(obj, "submodules", None)
    return sub.scalevec if isinstance(sub, ScaleVecBlockSubmodules) else None


# --------------------------------------------------------------------------- IWD
def iwd_overrides(config, overrides: Optional[dict], scalevec: ScaleVecConfig) -> dict:
    """Megatron's ``config_overrides`` with our decay rules in place of its 1-D rule.

    Without IWD the strategy's decay is Megatron's own, so ``overrides`` is returned as is.
    """
    overrides = dict(overrides or {})
    if not scalevec.iwd:
        return overrides
    from megatron_scalevec import optim  # noqa: PLC0415 (optimizer imports only when used)

    rules = optim.decay_rules(scalevec, config.weight_decay)
    merged = {k: v for k, v in overrides.items() if dict(v) != dict(optim.NO_DECAY)}
    merged.update(optim.config_overrides(rules, config))
    return merged


def refuse_unsupported(args) -> None:
    """One line and exit 2 for a flag the scale-vector specs do not support (when Megatron-LM
    imports our --spec module, before the model is built; again for the optimizer config)."""
    why = unsupported_feature(args)
    if why:
        print(f"megatron_scalevec: {why}", file=sys.stderr)
        raise SystemExit(2)


def refuse_unsupported_args() -> None:
    """Megatron-LM's parsed args checked where its ``--spec`` imports our spec module (inside
    ``gpt_builder``, before the model is built); a no-op outside Megatron-LM."""
    try:
        from megatron.training import get_args  # noqa: PLC0415

        args = get_args()
    except (ImportError, AssertionError, AttributeError):  # no Megatron-LM, or no args yet
        return
    if args is not None:
        refuse_unsupported(args)


def wrap_optimizer_config(original):
    """``get_megatron_optimizer_config(args)`` that applies IWD for our ``--spec``."""
    def get_megatron_optimizer_config(args):
        config, overrides = original(args)
        scalevec = strategy_of_spec(getattr(args, "spec", None))
        if scalevec is None:
            return config, overrides
        refuse_unsupported(args)
        _state["scalevec"] = scalevec
        return config, iwd_overrides(config, overrides, scalevec)

    setattr(get_megatron_optimizer_config, _MARK, original)
    return get_megatron_optimizer_config


def wrap_optimizer_builder(original, log=None):
    """An optimizer builder that remembers the model and prints the decay summary."""
    def builder(config, model_chunks, *args, **kwargs):
        _state["model"] = list(model_chunks)
        scalevec = _state["scalevec"]
        if scalevec is not None and scalevec.iwd:
            import torch.distributed as dist  # noqa: PLC0415

            from megatron_scalevec import optim  # noqa: PLC0415

            rules = optim.decay_rules(scalevec, config.weight_decay)
            summary = optim.decay_summary(rules, _state["model"], config.weight_decay,
                                          scalevec)
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


# --------------------------------------------------------------------------- install
_WRAPPERS = {"get_megatron_optimizer_config": wrap_optimizer_config,
             "get_megatron_optimizer": wrap_optimizer_builder,
             "get_megatron_muon_optimizer": wrap_optimizer_builder,
             "training_log": wrap_training_log}


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
    _state["installed"] = True
    return True
