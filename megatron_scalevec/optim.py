"""Individualized weight decay (IWD) through megatron-core's optimizer parameter groups.

The policy is a short ordered list of named rules; the first rule that matches a parameter
decides its group. Rules read only a vector part's marks (its role, its part and whether its
parameterization decays that part: ``parameterizations.mark`` / ``part_decays``), the shape
and the name, never a layer class:

==================  ===================================================  ================
rule                matches                                               weight decay
==================  ===================================================  ================
input_vectors       Input-Norm vector parts that decay (plain ``weight``, scale-vector wd
                    OR ``magnitude``, ER ``alpha``; every part with
                    ``decay_direction``)
input_directions    the other Input-Norm parts (OR's direction, ER's     none
                    logit: scale-invariant)
output_vectors      every Output-Norm vector part                         none
other_1d            any other 1-D parameter or bias (Megatron default)   none
matrices            everything else (Megatron default)                    the matrices' wd
==================  ===================================================  ================

Without IWD the list is Megatron's own default (``other_1d`` + ``matrices``) after a
``vectors`` rule (every scale-vector part; no decay, as ``other_1d``) that names the vectors for
their learning rate.

Learning rate: ``ScaleVecConfig.vector_lr_mult`` = m != 1 gives every vector rule's group
``max_lr`` and ``min_lr`` m times the base ones (both schedulers, 0.16.1 and 0.19.2, read
them per group) and ``lr_mult`` m, which neither scheduler reads: megatron-core 0.16.1 pairs a
checkpoint's param groups with the run's by (wd_mult, lr_mult, is_expert_parallel,
is_decoupled_lr) only, so a vector group differing from another only in ``max_lr`` would take
that group's LR after a resume. m = 1 adds nothing (megatron-core's groups, unchanged).

Rules become megatron-core ``ParamKey`` -> ``ParamGroupOverride`` entries merged with
``get_standard_config_overrides`` (whose 1-D rule ours replaces, since two conflicting
``wd_mult`` overrides raise). Decay values follow megatron-core's convention, group decay =
scheduler decay x ``wd_mult``, so the vectors follow the matrices' schedule
(``start_wd`` -> ``end_wd``):

* ``scale_vector_weight_decay`` unset: Input-Norm vectors sit in the matrices' group.
* set to ``s`` with matrices' ``weight_decay`` ``w > 0``: ``wd_mult = s / w``, i.e. the
  vectors' decay is ``s`` when the matrices' is ``w`` and scales with it along the schedule.
* ``w = 0`` (the matrices never decay): a constant ``s`` (``start_wd = end_wd``).

megatron-core applies ``wd_mult`` only when ``OptimizerParamScheduler.step()`` runs (its
constructor does); :func:`build_optimizer` sets each group's decay itself, so the first step
is right whatever constructs (or never constructs) a scheduler.

Muon: megatron-core 0.16.1 ships ``get_megatron_muon_optimizer`` (needs the optional
``emerging_optimizers`` package and no distributed optimizer). It orthogonalizes 2-D
non-embedding weights only and sends every other parameter to its Adam part; scale vectors are
1-D (scalars ``[1]``), so they always land in the Adam part with the same overrides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.optimizer import (
    OptimizerConfig,
    ParamKey,
    ParamWithNamePredicate,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.optimizer_param_scheduler import ParamGroupOverride

from megatron_scalevec import parameterizations, sharding
from megatron_scalevec.config import ScaleVecConfig

logger = logging.getLogger(__name__)

NO_DECAY: ParamGroupOverride = {"wd_mult": 0.0}
VECTOR_WD_MULT = 2.0


@dataclass(frozen=True)
class DecayRule:
    """One named weight-decay rule: a predicate, the override it applies, and whether the
    strategy guarantees a match (a required rule that matches nothing is a bug)."""

    name: str
    match: Callable[[torch.nn.Parameter, str], bool]
    override: Optional[ParamGroupOverride]  # None: Megatron's default (decay as matrices)
    required: bool = False
    decays: bool = False
    vectors: bool = False  # scale-vector parts: the vectors' learning rate applies


def _role(p) -> Optional[str]:
    return getattr(p, "scalevec_role", None)


def _is_1d_or_bias(p, name: str) -> bool:
    return p.dim() == 1 or name.endswith(".bias")


def is_vector(p, name: str = "") -> bool:
    """A scale-vector part (vectors.py marks each; layers/te.py TE's trainable Pre-Norm gamma)."""
    return _role(p) is not None


def decay_rules(scalevec: ScaleVecConfig, weight_decay: float) -> list[DecayRule]:
    """The ordered rules for ``scalevec`` (first match wins)."""
    rules = []
    if scalevec.iwd:
        every_part = scalevec.decay_direction
        decaying = every_part or any(
            p.decays for p in parameterizations.get(scalevec.parameterization).parts)
        svwd = scalevec.scale_vector_weight_decay
        vec_override = vector_override(float(weight_decay), None if svwd is None else
                                       float(svwd))
        rules += [
            DecayRule("input_vectors",
                      lambda p, n: _role(p) == "input" and (
                          every_part or parameterizations.part_decays(p)),
                      vec_override, required=decaying, decays=True, vectors=True),
            DecayRule("input_directions", lambda p, n: _role(p) == "input", NO_DECAY,
                      vectors=True),
            DecayRule("output_vectors", lambda p, n: _role(p) == "output", NO_DECAY,
                      required=scalevec.dnp or (scalevec.dp and scalevec.dp_output_role ==
                                                "output"), vectors=True),
        ]
    elif scalevec.vectors:
        rules.append(DecayRule("vectors", is_vector, NO_DECAY, vectors=True,
                               required=scalevec.vector_lr_mult != 1.0))
    rules += [
        DecayRule("other_1d", _is_1d_or_bias, NO_DECAY),
        DecayRule("matrices", lambda p, n: True, None, required=True, decays=weight_decay > 0),
    ]
    return rules


def vector_override(weight_decay: float, svwd: Optional[float]
                    ) -> Optional[ParamGroupOverride]:
    """The Input-Norm vectors' override (module docstring). None: the matrices' group.

    megatron-core 0.16.1 re-matches param groups at checkpoint load by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr) only, so a group of its own needs a wd_mult of its
    own: never 1.0 (the matrices') unless it is the matrices' group."""
    if svwd is None or svwd == weight_decay:
        return None
    if svwd == 0.0:
        return NO_DECAY
    if weight_decay > 0.0:
        return {"wd_mult": svwd / weight_decay}
    # 2.0 x (svwd / 2), exact in binary floating point, is svwd.
    return {"wd_mult": VECTOR_WD_MULT, "start_wd": svwd / VECTOR_WD_MULT,
            "end_wd": svwd / VECTOR_WD_MULT}


def lr_override(scalevec: ScaleVecConfig, config: OptimizerConfig
                ) -> Optional[ParamGroupOverride]:
    """The vectors' learning-rate override (module docstring); None at m = 1."""
    m = scalevec.vector_lr_mult
    if m == 1.0:
        return None
    if config.lr is None:
        raise ValueError("vector_lr_mult needs OptimizerConfig.lr (the base learning rate)")
    out: ParamGroupOverride = {"max_lr": config.lr * m, "lr_mult": m}
    if config.min_lr is not None:
        out["min_lr"] = config.min_lr * m
    return out


def set_initial_weight_decay(optimizer, weight_decay: float) -> None:
    """Each param group's decay (and LR) before any scheduler step, as the scheduler would set
    them at ``weight_decay`` without warmup: ``start_wd`` (if the group has one, else
    ``weight_decay``) x ``wd_mult``; the group's ``max_lr``."""
    for group in optimizer.param_groups:
        group["weight_decay"] = group.get("start_wd", weight_decay) * group.get("wd_mult", 1.0)
        if group.get("max_lr") is not None:
            group["lr"] = group["max_lr"]


def classify(rules: Sequence[DecayRule], param, name: str) -> DecayRule:
    for rule in rules:
        if rule.match(param, name):
            return rule
    raise AssertionError("the last rule matches everything")


def config_overrides(rules: Sequence[DecayRule], config: OptimizerConfig,
                     scalevec: Optional[ScaleVecConfig] = None
                     ) -> dict[ParamKey, ParamGroupOverride]:
    """megatron-core overrides: the standard ones minus their 1-D wd rule, plus ours (and the
    vectors' LR when ``scalevec`` asks for one)."""
    overrides = {k: v for k, v in get_standard_config_overrides(config).items()
                 if dict(v) != dict(NO_DECAY)}
    lr = None if scalevec is None else lr_override(scalevec, config)
    for rule in rules:
        override = rule.override
        if lr is not None and rule.vectors:
            override = {**(override or {}), **lr}
        if override is None:
            continue

        def first_match(p, n, _rule=rule):
            return classify(rules, p, n) is _rule

        key = ParamKey(with_name_predicate=ParamWithNamePredicate(
            name=f"scalevec_iwd_{rule.name}", fn=first_match))
        overrides[key] = override
    return overrides


def _named_params(model_chunks):
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                yield name, p


def decay_summary(rules: Sequence[DecayRule], model_chunks, weight_decay: float,
                  scalevec: ScaleVecConfig, lr: Optional[float] = None) -> str:
    """One screen: per rule the decay, the peak LR (``lr`` x the vectors' multiplier for
    vector rules; omitted when ``lr`` is None), tensors and parameters (this rank's shards; a
    rule's match is checked over all ranks). Raises if a required rule matches nothing
    anywhere."""
    counts = {r.name: [0, 0] for r in rules}
    for name, p in _named_params(model_chunks):
        c = counts[classify(rules, p, name).name]
        c[0] += 1
        c[1] += p.numel()
    totals = torch.tensor([counts[r.name][0] for r in rules], dtype=torch.long)
    totals = sharding.sum_over_world(totals)
    missing = [r.name for r, t in zip(rules, totals.tolist()) if r.required and t == 0]
    if missing:
        raise RuntimeError(f"optimizer rule(s) {missing} matched no parameter on any rank for "
                           f"strategy {scalevec.describe()!r}: the model does not carry the "
                           f"scale-vector attributes the strategy implies (built with the "
                           f"wrong spec?)")
    svwd = scalevec.scale_vector_weight_decay
    m = scalevec.vector_lr_mult
    lr_note = "" if lr is None else f", peak LR (vectors at {m:g} x --lr {lr:g})"
    lines = [f"weight decay groups (strategy {scalevec.to_string()}; the wd each rule applies, "
             f"before the schedule{lr_note}; this rank's shards):",
             f"  {'rule':<18}{'wd':>7}" + ("" if lr is None else f"{'lr':>11}")
             + f"{'tensors':>9}{'params':>13}"]
    for r in rules:
        wd = (svwd if svwd is not None else weight_decay) if r.name == "input_vectors" else \
            (weight_decay if r.decays else 0.0)
        n_t, n_p = counts[r.name]
        peak = "" if lr is None else f"{lr * (m if r.vectors else 1.0):>11.4g}"
        lines.append(f"  {r.name:<18}{wd:>7g}{peak}{n_t:>9}{n_p:>13,}")
    return "\n".join(lines)


def build_optimizer(config: OptimizerConfig, model_chunks, scalevec: ScaleVecConfig,
                    use_muon: bool = False, log: Callable[[str], None] = print):
    """``get_megatron_optimizer`` (or Muon) with the IWD rules and the vectors' LR; logs the
    one-screen summary."""
    rules = decay_rules(scalevec, config.weight_decay)
    summary = decay_summary(rules, model_chunks, config.weight_decay, scalevec, config.lr)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log(summary)
    overrides = config_overrides(rules, config, scalevec)
    if use_muon:
        from megatron_scalevec.compat.mcore import get_muon_optimizer  # noqa: PLC0415

        optimizer = get_muon_optimizer(config, model_chunks, overrides)
    else:
        optimizer = get_megatron_optimizer(config, model_chunks, config_overrides=overrides)
    set_initial_weight_decay(optimizer, config.weight_decay)
    return optimizer



@dataclass(frozen=True)
class BridgeOverrides:
    """Megatron-Bridge's ``optimizer_config_override_provider`` (``ConfigContainer`` field,
    ``setup_optimizer`` argument) for a strategy: IWD and the vectors' LR as in our trainer
    (Bridge's default provider knows neither). Bridge calls ``build_config_overrides(context)``
    with the optimizer config and the model; the one-screen summary is logged there."""

    scalevec: ScaleVecConfig

    def build_config_overrides(self, context) -> dict:
        config = context.optimizer_config
        chunks = context.model if isinstance(context.model, list) else [context.model]
        rules = decay_rules(self.scalevec, config.weight_decay)
        summary = decay_summary(rules, chunks, config.weight_decay, self.scalevec, config.lr)
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(summary)
        return config_overrides(rules, config, self.scalevec)
