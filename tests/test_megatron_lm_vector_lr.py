"""The vectors' learning rate in the Megatron-LM integration, without a checkout: the variable,
the overrides the installed optimizer-config wrapper returns (``shared`` included, whose decay
stays Megatron's own), and an override of someone else's that also sets a vector's LR
(megatron-core 0.19's MuP under SGD) named in one line instead of megatron-core's raw error.
The real script: tests/megatron_lm/test_vector_lr.py."""

import re

import pytest

from megatron_scalevec import megatron_lm
from megatron_scalevec.megatron_lm_strategy import env_for
from scalevec_testing.distributed import init_model_parallel, run_on_ranks

LR, MIN_LR, WD, MULT = 0.5, 0.05, 0.2, 7.0
VECTOR = re.compile(r"(scale_in\.|_norm\.|layernorm\.)(\w+\.)?"
                    r"(weight|magnitude|direction|alpha|logit)$")
VAR = "MEGATRON_SCALEVEC_VECTOR_LR_MULT"


def test_variable_parsed_recorded_and_refused_in_one_line():
    cfg = megatron_lm.env_strategy({VAR: "7"})
    assert cfg.to_string() == "hg+dnp+or+iwd" and cfg.vector_lr_mult == 7.0
    assert f"{VAR}=7" in env_for(cfg)
    assert f"{VAR}=1 " in env_for(cfg.replace(vector_lr_mult=1.0)) + " "  # not the default
    assert VAR not in env_for(cfg.replace(vector_lr_mult=30.0))  # unified's default
    assert megatron_lm.env_strategy({"MEGATRON_SCALEVEC": "unified"}).vector_lr_mult == 30.0
    assert megatron_lm.env_strategy({"MEGATRON_SCALEVEC": "shared"}).vector_lr_mult == 1.0
    assert megatron_lm.env_strategy({VAR: "1", "MEGATRON_SCALEVEC": "shared"}).is_baseline
    for bad, why in (("seven", "use a number"), ("0", "must be a number > 0")):
        with pytest.raises(ValueError) as err:
            megatron_lm.env_strategy({VAR: bad})
        assert VAR in str(err.value) and why in str(err.value) and "\n" not in str(err.value)


def _groups(rank, world, strategy):
    """megatron-core's optimizer over the overrides of the installed wrapper's function:
    each parameter's (max_lr, min_lr, weight decay) with the matrices' decay WD."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import (
        OptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_scalevec.config import ScaleVecConfig
    from scalevec_testing.models import build_gpt, tiny_config

    init_model_parallel()
    cfg = ScaleVecConfig.from_string(strategy, vector_lr_mult=MULT)
    config = tiny_config()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                  build_gpt(config, cfg))
    opt_cfg = OptimizerConfig(optimizer="sgd", lr=LR, min_lr=MIN_LR, weight_decay=WD)
    overrides = megatron_lm.iwd_overrides(opt_cfg, get_standard_config_overrides(opt_cfg), cfg)
    opt = get_megatron_optimizer(opt_cfg, [ddp], config_overrides=overrides)
    OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=0,
                            lr_decay_steps=10, lr_decay_style="cosine", start_wd=WD,
                            end_wd=WD, wd_incr_steps=10, wd_incr_style="constant")
    names = {id(p): n for n, p in ddp.named_parameters()}
    return {names[id(p)]: (g["max_lr"], g["min_lr"], g["weight_decay"])
            for g in opt.param_groups for p in g["params"]}


@pytest.mark.parametrize("strategy", ["shared", "unified"])
def test_wrapper_overrides_give_every_vector_its_lr(strategy):
    """``shared`` (no IWD: Megatron's decay, 1-D none) and ``unified`` (IWD's decay)."""
    groups = run_on_ranks(_groups, 1, strategy)[0]
    vectors = [n for n in groups if VECTOR.search(n)]
    assert len(vectors) >= 5, sorted(groups)
    for n, (peak, floor, wd) in groups.items():
        m = MULT if n in vectors else 1.0
        assert (peak, floor) == (pytest.approx(LR * m), pytest.approx(MIN_LR * m)), n
        if strategy == "shared" or n not in vectors:
            assert wd == (0.0 if n.endswith((".bias", "norm.weight")) else WD), n


def _conflict(rank, world, source):
    """``lr_conflict`` over a tiny unified model for the overrides of ``source``."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        ParamKey,
        ParamWithNamePredicate,
        get_standard_config_overrides,
    )

    from megatron_scalevec.config import ScaleVecConfig
    from scalevec_testing.models import build_gpt, tiny_config

    init_model_parallel()
    cfg = ScaleVecConfig.from_string("unified", vector_lr_mult=MULT)
    model = build_gpt(tiny_config(), cfg)
    opt_cfg = OptimizerConfig(optimizer="sgd", lr=LR, min_lr=MIN_LR, weight_decay=WD)
    ours = megatron_lm.iwd_overrides(opt_cfg, get_standard_config_overrides(opt_cfg), cfg)
    if source == "mup":  # megatron-core 0.19's own, as Megatron-LM's --use-mup adds it
        from megatron.core.optimizer import get_mup_config_overrides

        other = get_mup_config_overrides(opt_cfg, mup_width_mult=2.0, optimizer_type="sgd")
    elif source == "one_d_lr":
        other = {ParamKey(with_name_predicate=ParamWithNamePredicate(
            name="someone_elses_1d_lr", fn=lambda p, n: p.dim() == 1)): {"max_lr": 1.0}}
    else:  # decay only: no conflict
        other = {ParamKey(with_name_predicate=ParamWithNamePredicate(
            name="someone_elses_1d_wd", fn=lambda p, n: p.dim() == 1)): {"start_wd": 0.0}}
    return megatron_lm.lr_conflict({**ours, **other}, [model])


@pytest.mark.parametrize("source,named", [
    ("one_d_lr", "someone_elses_1d_lr"), ("decay_only", None),
    pytest.param("mup", "mup_sgd_vector_like", marks=pytest.mark.skipif(
        not hasattr(__import__("megatron.core.optimizer").core.optimizer,
                    "get_mup_config_overrides"), reason="MuP overrides: megatron-core 0.19+")),
])
def test_another_lr_override_on_a_vector_is_named(source, named):
    line = run_on_ranks(_conflict, 1, source)[0]
    if named is None:
        assert line is None
    else:
        assert line and named in line and VAR in line and "\n" not in line, line
