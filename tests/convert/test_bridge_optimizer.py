"""``optim.BridgeOverrides``, Megatron-Bridge's ``optimizer_config_override_provider`` for our
strategies: megatron-core's optimizer over the overrides it builds gives the vectors their LR
(peak and floor) and IWD's decay. Bridge's ``setup_optimizer`` itself cannot be imported here
(its training package imports Hugging Face ``datasets``, which CI does not install), so the
call it makes is read from its source: ``build_config_overrides(context)`` with the optimizer
config and the model on the context."""

import importlib.util
import pathlib
import re
import types

import pytest

from scalevec_testing.distributed import init_model_parallel, run_on_ranks

LR, MIN_LR, WD, MULT = 0.5, 0.05, 0.2, 7.0
VECTOR = re.compile(r"(scale_in\.|_norm\.|layernorm\.)(\w+\.)?"
                    r"(weight|magnitude|direction|alpha|logit)$")
INPUT_DECAYED = re.compile(r"(scale_in\.\w+|final_layernorm)\.magnitude$")


def _groups(rank, world):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.optim import BridgeOverrides
    from scalevec_testing.models import build_gpt, tiny_config

    init_model_parallel()
    cfg = ScaleVecConfig.from_string("unified", vector_lr_mult=MULT)
    config = tiny_config()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                  build_gpt(config, cfg))
    opt_cfg = OptimizerConfig(optimizer="sgd", lr=LR, min_lr=MIN_LR, weight_decay=WD)
    context = types.SimpleNamespace(optimizer_config=opt_cfg, model=ddp, scheduler_config=None)
    overrides = BridgeOverrides(cfg).build_config_overrides(context)
    opt = get_megatron_optimizer(opt_cfg, [ddp], config_overrides=overrides)
    OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=0,
                            lr_decay_steps=10, lr_decay_style="cosine", start_wd=WD,
                            end_wd=WD, wd_incr_steps=10, wd_incr_style="constant")
    names = {id(p): n for n, p in ddp.named_parameters()}
    return {names[id(p)]: (g["max_lr"], g["min_lr"], g["weight_decay"])
            for g in opt.param_groups for p in g["params"]}


def test_bridge_overrides_give_vectors_their_lr_and_decay():
    groups = run_on_ranks(_groups, 1)[0]
    vectors = [n for n in groups if VECTOR.search(n)]
    assert len(vectors) >= 5
    for n, (peak, floor, wd) in groups.items():
        m = MULT if n in vectors else 1.0
        assert (peak, floor) == (pytest.approx(LR * m), pytest.approx(MIN_LR * m)), n
        decays = INPUT_DECAYED.search(n) or not (VECTOR.search(n) or n.endswith("bias"))
        assert wd == pytest.approx(WD if decays else 0.0), n


def test_bridge_calls_the_provider_as_ours_expects():
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None:
        pytest.skip("megatron-bridge is not installed")
    root = pathlib.Path(spec.submodule_search_locations[0]) / "training"
    optim = (root / "optim.py").read_text()
    assert "optimizer_config_override_provider.build_config_overrides(" in optim
    assert re.search(r"OptimizerConfigOverrideProviderContext\(\s*scheduler_config,\s*"
                     r"optimizer_config,\s*model\s*\)", optim)
    config = (root / "config.py").read_text()
    assert re.search(r"class OptimizerConfigOverrideProviderContext:[^@]*optimizer_config:"
                     r"[^@]*model:", config)
