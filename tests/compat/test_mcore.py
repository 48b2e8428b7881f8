"""compat/mcore.py on whichever megatron-core is installed (0.16.1 on 3.11, 0.19.x on 3.12):
each helper picks the API that release has, and the result is the same everywhere."""

import importlib.util
import logging

import pytest
import torch

from megatron_scalevec.compat import mcore
from scalevec_testing import models as M
from scalevec_testing.distributed import init_model_parallel, run_on_ranks

HAVE_MUON = importlib.util.find_spec("emerging_optimizers") is not None


def _save_with_common_state(rank, world, ckpt_dir):
    """A dist checkpoint whose common state holds a non-tensor object; load_tensors_only reads
    the tensors back and never that object (it would be an unpickle of arbitrary code)."""
    from megatron.core import dist_checkpointing

    init_model_parallel()
    model = M.build_gpt(M.tiny_config(), "unified")
    sd = model.sharded_state_dict()
    sd["args"] = {"note": "common state"}
    dist_checkpointing.save(sd, ckpt_dir)
    fresh = M.build_gpt(M.tiny_config(), "unified", seed=99)
    full = dist_checkpointing.load(fresh.sharded_state_dict() | {"args": None}, ckpt_dir)
    state = mcore.load_tensors_only(fresh.sharded_state_dict(), ckpt_dir)
    fresh.load_state_dict(state, strict=False)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    return "args" in full, "args" in state, same


def test_load_tensors_only_skips_the_common_state(tmp_path):
    stored, leaked, same = run_on_ranks(_save_with_common_state, 1, str(tmp_path))[0]
    assert stored and not leaked and same


def test_accepted_kwargs_drops_keywords_a_class_does_not_take():
    from megatron.core.transformer.mlp import MLP

    class Old:
        def __init__(self, config, tp_group=None):
            pass

    assert mcore.accepted_kwargs(Old, tp_group=1, name="x", is_mtp_layer=False) == \
        {"tp_group": 1}
    assert "tp_group" in mcore.accepted_kwargs(MLP, tp_group=1)


def test_results_queue_factory_and_sync_save_class_exist():
    module, name = mcore.get_results_queue_factory()
    assert callable(getattr(module, name))
    cls = mcore.sync_save_strategy_class()
    assert "save" in vars(cls), "the CPU layer wraps save() on the class that runs it"


def _two_models(rank, world):
    init_model_parallel()
    M.build_gpt(M.tiny_config(), "unified")
    M.build_gpt(M.tiny_config(), "shared")


def test_known_notices_at_most_once(capfd):
    """0.19's GPTModel deprecation notice and <= 0.17's "Unknown MLP type": never shown."""
    mcore.quiet_known_notices()
    mcore.quiet_known_notices()  # idempotent: one filter per notice
    for name, prefix, _ in mcore._NOTICES:
        filters = [f for f in logging.getLogger(name).filters
                   if isinstance(f, mcore._DropRepeats) and f.prefix == prefix]
        assert len(filters) == 1
    run_on_ranks(_two_models, 1)
    err = capfd.readouterr().err
    assert "GPTModel IS DEPRECATED" not in err
    assert "Unknown MLP type" not in err


def _muon_step(rank, world):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.optim import build_optimizer

    init_model_parallel()
    config = M.tiny_config()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(),
                                  M.build_gpt(config, "unified"))
    opt = build_optimizer(OptimizerConfig(optimizer="adam", lr=0.1, weight_decay=0.0),
                          [ddp], ScaleVecConfig.from_string("unified"), use_muon=True,
                          log=lambda s: None)
    kinds = {type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])}
    inner = {type(getattr(o, "optimizer", o)).__name__
             for o in getattr(opt, "chained_optimizers", [opt])}
    return kinds, inner


@pytest.mark.skipif(not HAVE_MUON, reason="emerging-optimizers is not installed (Python 3.11)")
def test_muon_builds_muon_on_every_release():
    """From 0.18 the old getter is a shim that would silently build Adam: ours builds Muon."""
    _, inner = run_on_ranks(_muon_step, 1)[0]
    assert any("Muon" in name for name in inner), inner


@pytest.mark.skipif(HAVE_MUON, reason="emerging-optimizers is installed")
def test_muon_refused_clearly_without_emerging_optimizers():
    with pytest.raises(RuntimeError, match="emerging-optimizers"):
        mcore.get_muon_optimizer(None, [], {})
