"""Megatron-LM integration without a Megatron-LM checkout (CI has none).

* the ``--spec megatron_scalevec.megatron_lm_spec scalevec_*`` import contract and the built
  model;
* the installer: a no-op without ``megatron.training``; against a stand-in
  ``megatron.training.training`` (in a forked process) it wraps once, importing the ``--spec``
  module installs it and applies ``MEGATRON_SCALEVEC``, importing ``specs`` installs nothing,
  and the old ``--spec megatron_scalevec.specs`` is refused inside Megatron-LM;
* the IWD override function, called with a fake ``args``, decays exactly the Input-Norm parts.
"""

import importlib
import importlib.util
import re
import sys
import types
import warnings

import pytest
import torch

from megatron_scalevec import megatron_lm
from megatron_scalevec.config import ScaleVecConfig
from scalevec_testing import models as M
from scalevec_testing.distributed import init_model_parallel, run_on_ranks

LR, WD = 0.5, 0.2
OUTPUT = re.compile(r"(q_norm|k_norm|v_norm|gate_norm|up_norm|scale_out\.)")
INPUT = re.compile(r"(scale_in\.|final_layernorm\.|input_layernorm\.|pre_mlp_layernorm\.)")
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
           moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)


def test_import_module_returns_our_block_module_spec():
    """Megatron's own importer returns the real module attribute: a TransformerBlock spec."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_scalevec import megatron_lm_spec, specs

    for name in ("scalevec_moe", "scalevec_dense"):
        spec = import_module(["megatron_scalevec.megatron_lm_spec", name])
        assert spec is vars(megatron_lm_spec)[name]
        assert isinstance(spec, ModuleSpec) and issubclass(spec.module, TransformerBlock)
        assert isinstance(spec.submodules, specs.ScaleVecBlockSubmodules)
        assert spec.submodules.scalevec.to_string() == "hg+dnp+or+iwd"


def _build_and_forward(rank, world, moe):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import import_module

    from megatron_scalevec.norms import ScaleVecNorm
    from megatron_scalevec.specs import building
    from scalevec_testing.models import SEQ, VOCAB, tiny_config

    init_model_parallel()
    config = tiny_config(**(dict(MOE, moe_layer_freq=[1, 0]) if moe else {}))
    spec = import_module(["megatron_scalevec.megatron_lm_spec",
                          "scalevec_moe" if moe else "scalevec_dense"])
    torch.manual_seed(0)
    with building(config):
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope")
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    loss = model(tokens, pos, None, labels=tokens).float().mean()
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    return (float(loss), len(model.decoder.layers),
            isinstance(model.decoder.final_layernorm, ScaleVecNorm),
            any(".mlp.experts." in n for n in names), any(".mlp.router." in n for n in names),
            any("layers.1.mlp.experts" in n for n in names))


@pytest.mark.parametrize("moe", [False, True])
def test_spec_object_builds_a_working_gpt(moe):
    """GPTModel(config, <the --spec object>) inside building(config): forward and backward run,
    our final norm is used, and moe_layer_freq=[1, 0] puts experts in layer 0 only."""
    loss, n_layers, our_final_norm, has_experts, has_router, layer1_moe = \
        run_on_ranks(_build_and_forward, 1, moe)[0]
    assert torch.isfinite(torch.tensor(loss)) and 0.0 < loss < 20.0
    assert n_layers == 2 and our_final_norm
    assert has_experts == moe and has_router == moe and not layer1_moe


def test_installer_is_a_noop_without_megatron_training():
    if importlib.util.find_spec("megatron.training") is not None:
        pytest.skip("a Megatron-LM checkout is importable here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not inside Megatron-LM: silent
        from megatron_scalevec import megatron_lm_spec  # noqa: F401

        assert megatron_lm.install() is False
    assert "megatron.training" not in sys.modules
    assert megatron_lm._state["installed"] is False


def test_env_strategy():
    assert megatron_lm.env_strategy({}) is None
    cfg = megatron_lm.env_strategy({"MEGATRON_SCALEVEC": "hg+dp+er"})
    assert cfg.to_string() == "hg+dp+er" and cfg.scale_vector_weight_decay is None
    cfg = megatron_lm.env_strategy({"MEGATRON_SCALEVEC_VECTOR_WD": "0.05"})
    assert cfg.to_string() == "hg+dnp+or+iwd" and cfg.scale_vector_weight_decay == 0.05
    with pytest.raises(ValueError, match="MEGATRON_SCALEVEC"):
        megatron_lm.env_strategy({"MEGATRON_SCALEVEC": "hg+bogus"})


def _fake_megatron_lm(log_interval=2):
    """Stand-ins for the megatron.training names the installer wraps or calls."""
    calls = {"config": 0, "optimizer": 0, "log": [], "scalars": {}, "printed": []}
    training = types.ModuleType("megatron.training.training")

    def get_megatron_optimizer_config(args):
        from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

        calls["config"] += 1
        config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD,
                                 clip_grad=0.0)
        return config, get_standard_config_overrides(config)

    def get_megatron_optimizer(config, model_chunks, config_overrides=None, **kw):
        calls["optimizer"] += 1
        return config_overrides

    def training_log(loss_dict, total, lr, iteration, *rest, **kw):
        calls["log"].append(iteration)
        return "flag"

    training.get_megatron_optimizer_config = get_megatron_optimizer_config
    training.get_megatron_optimizer = get_megatron_optimizer
    training.get_megatron_muon_optimizer = get_megatron_optimizer
    training.training_log = training_log
    training.load_checkpoint = lambda *args, **kwargs: (0, 0)
    checkpointing = types.ModuleType("megatron.training.checkpointing")
    checkpointing.load_checkpoint = training.load_checkpoint
    writer = types.SimpleNamespace(add_scalar=lambda k, v, it: calls["scalars"].setdefault(
        it, {}).update({k: v}))
    package = types.ModuleType("megatron.training")
    package.training = training
    package.get_args = lambda: types.SimpleNamespace(log_interval=log_interval)
    package.get_tensorboard_writer = lambda: writer
    package.get_wandb_writer = lambda: None
    package.print_rank_last = calls["printed"].append
    sys.modules["megatron.training"] = package
    sys.modules["megatron.training.training"] = training
    sys.modules["megatron.training.checkpointing"] = checkpointing
    return training, calls


def _hook_and_wrappers(rank, world):
    """In a fork: importing specs installs nothing; importing the --spec module installs into a
    stand-in Megatron-LM, applies the environment's strategy, wraps once; the wrappers then do
    their jobs."""
    import os

    from megatron.core.models.gpt.gpt_model import GPTModel

    from scalevec_testing.models import SEQ, VOCAB, tiny_config

    init_model_parallel()
    for name in [n for n in sys.modules if n.startswith("megatron.training")]:
        sys.modules.pop(name)  # this fork's Megatron-LM is the stand-in only
    megatron_lm._state.update(installed=False, model=None, scalevec=None)
    training, calls = _fake_megatron_lm()
    os.environ["MEGATRON_SCALEVEC"] = "hg+dp+er+iwd"
    sys.modules.pop("megatron_scalevec.specs", None)
    sys.modules.pop("megatron_scalevec.megatron_lm_spec", None)
    specs = importlib.import_module("megatron_scalevec.specs")
    out = {"specs_installed": megatron_lm._state["installed"]
           or hasattr(training.training_log, "__scalevec_original__")}
    lm_spec = importlib.import_module("megatron_scalevec.megatron_lm_spec")  # installs
    out.update({"installed": megatron_lm._state["installed"],
                "strategy": lm_spec.scalevec_moe.submodules.scalevec.to_string(),
                "specs_strategy": specs.scalevec_moe.submodules.scalevec.to_string(),
                "wrapped_again": megatron_lm.install_into(training)})
    config = tiny_config()
    with specs.building(config):
        model = GPTModel(config, lm_spec.scalevec_moe, vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope")
    args = types.SimpleNamespace(spec=["megatron_scalevec.megatron_lm_spec", "scalevec_moe"])
    opt_config, overrides = training.get_megatron_optimizer_config(args)
    printed = []
    builder = megatron_lm.wrap_optimizer_builder(lambda c, m, **kw: kw["config_overrides"],
                                                 log=printed.append)
    out["builder_passes_overrides"] = builder(opt_config, [model],
                                              config_overrides=overrides) is overrides
    out["summary"] = "\n".join(printed)
    out["log_returns"] = [training.training_log({}, {}, LR, it, 1.0, True) for it in (1, 2, 3, 4)]
    out["calls"] = {k: v for k, v in calls.items()}
    return out


def test_import_hook_installs_into_megatron_lm_once():
    out = run_on_ranks(_hook_and_wrappers, 1)[0]
    assert not out["specs_installed"]  # specs is a leaf: no hook on import
    assert out["installed"] and out["wrapped_again"] == []
    assert out["strategy"] == "hg+dp+er+iwd" and out["specs_strategy"] == "hg+dnp+or+iwd"
    assert out["builder_passes_overrides"]
    assert "input_vectors" in out["summary"] and "hg+dp+er+iwd" in out["summary"]
    calls = out["calls"]
    assert calls["config"] == 1 and calls["log"] == [1, 2, 3, 4]
    assert out["log_returns"] == ["flag"] * 4
    # statistics every log_interval=2 iterations, under global layer names
    assert sorted(calls["scalars"]) == [2, 4]
    keys = calls["scalars"][2]
    assert any(k.startswith("scalevec/decoder.layers.1.") and k.endswith("/norm") for k in keys)
    assert any(k.endswith("/conservation") for k in keys)
    assert len(calls["printed"]) == 2 and "|gamma| mean" in calls["printed"][0]


def test_old_spec_module_is_refused_inside_megatron_lm(monkeypatch):
    """`--spec megatron_scalevec.specs ...` (no hooks installed) fails when the block is built
    inside Megatron-LM, naming the --spec module to use, instead of silently training without
    IWD or with stage 0's layers in every virtual stage."""
    from megatron_scalevec import specs

    package = types.ModuleType("megatron.training")
    package.get_args = lambda: types.SimpleNamespace(spec=["megatron_scalevec.specs", "x"])
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    for name in [n for n in sys.modules if n.startswith("megatron.training.")]:
        monkeypatch.delitem(sys.modules, name)  # a real one (Megatron-Bridge imports some)
    monkeypatch.delitem(sys.modules, specs.MEGATRON_LM_SPEC_MODULE, raising=False)
    with pytest.raises(RuntimeError, match="--spec megatron_scalevec.megatron_lm_spec"):
        _ = specs.scalevec_moe.submodules.layer_specs
    # with the --spec module imported, a block read outside megatron-core's block hook (which
    # the spec module installs) is refused too: it could not know its pipeline stage
    monkeypatch.setitem(sys.modules, specs.MEGATRON_LM_SPEC_MODULE, types.ModuleType("x"))
    with pytest.raises(RuntimeError, match="_get_block_submodules"):
        _ = specs.scalevec_moe.submodules.layer_specs


def _expected_wd(name, p):
    part = name.rsplit(".", 1)[-1]
    if OUTPUT.search(name):
        return 0.0
    if INPUT.search(name):
        return WD if part in ("weight", "magnitude", "alpha") else 0.0
    return 0.0 if p.dim() == 1 else WD


def _iwd_groups(rank, world, moe):
    """Overrides from the installed function (fake args) into megatron-core's optimizer: a
    zero-gradient step shrinks each parameter by exactly (1 - lr * its expected decay), the
    scale vectors' lr 30 x the base (unified's default multiplier)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_scalevec import specs
    from scalevec_testing.models import SEQ, VOCAB, tiny_config

    init_model_parallel()
    training, _ = _fake_megatron_lm()
    wrapped = megatron_lm.wrap_optimizer_config(training.get_megatron_optimizer_config)
    foreign = types.SimpleNamespace(spec=["megatron.core.models.gpt.gpt_layer_specs",
                                          "get_gpt_layer_local_spec"])
    _, stock = wrapped(foreign)
    name = "scalevec_moe" if moe else "scalevec_dense"
    config, overrides = wrapped(
        types.SimpleNamespace(spec=["megatron_scalevec.megatron_lm_spec", name]))
    mconf = tiny_config(**(MOE if moe else {}))
    with specs.building(mconf):
        model = GPTModel(mconf, getattr(specs, name), vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope")
    ddp = DistributedDataParallel(mconf, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(config, [ddp], config_overrides=overrides)
    OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
                            lr_decay_steps=10, lr_decay_style="constant", start_wd=WD,
                            end_wd=WD, wd_incr_steps=10, wd_incr_style="constant")
    params = dict(ddp.named_parameters())
    factors = M.zero_grad_step_factors(ddp, opt)
    bad, decayed_vectors, output_vectors = [], 0, 0
    for n, got in factors.items():
        lr = LR * (30.0 if INPUT.search(n) or OUTPUT.search(n) else 1.0)
        want = 1.0 - lr * _expected_wd(n, params[n])
        if abs(got - want) > 1e-5:
            bad.append(f"{n}: {got:.4f} != {want:.4f}")
        decayed_vectors += bool(INPUT.search(n)) and want < 1.0
        output_vectors += bool(OUTPUT.search(n))
    return bad, decayed_vectors, output_vectors, len(stock), len(overrides)


@pytest.mark.parametrize("moe", [False, True])
def test_installed_iwd_override_function(moe):
    bad, decayed, outputs, n_stock, n_ours = run_on_ranks(_iwd_groups, 1, moe)[0]
    assert not bad, "\n".join(bad)
    assert decayed > 0 and outputs > 0
    assert n_stock == 1 and n_ours > n_stock  # a foreign --spec keeps Megatron's overrides


def test_global_stat_names():
    """Local layer/expert indices become global ones (pipeline offset, expert rank)."""
    class Layer(torch.nn.Module):
        def __init__(self, number):
            super().__init__()
            self.layer_number = number
            self.local_experts = torch.nn.ModuleList([torch.nn.Identity()] * 2)

    root = torch.nn.Module()
    root.decoder = torch.nn.Module()
    root.decoder.layers = torch.nn.ModuleList([Layer(5), Layer(6)])
    stats = {"sv/decoder.layers.1.mlp.experts.local_experts.1.scale_in.up/norm": 2.0,
             "sv/decoder.final_layernorm/norm": 1.0}
    out = megatron_lm.global_stat_names(stats, [root], ep_rank=1)
    assert out == {"scalevec/decoder.layers.5.mlp.experts.local_experts.3.scale_in.up/norm": 2.0,
                   "scalevec/decoder.final_layernorm/norm": 1.0}
    assert "n=2" in megatron_lm.summary_line(out)


def test_megatron_fsdp_is_refused_in_one_line(capsys):
    """Megatron-LM's --use-megatron-fsdp with our --spec: one line naming the flag, exit 2,
    when the optimizer config is asked for (after the model, before any step)."""
    from types import SimpleNamespace

    wrapped = megatron_lm.wrap_optimizer_config(lambda args: ("config", {}))
    args = SimpleNamespace(spec=["megatron_scalevec.megatron_lm_spec", "scalevec_dense"],
                           use_megatron_fsdp=True)
    with pytest.raises(SystemExit) as exit_info:
        wrapped(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--use-megatron-fsdp is not supported" in err[0], err
    args.spec = ["megatron.core.models.gpt.gpt_layer_specs", "nothing"]  # not our spec
    assert wrapped(args) == ("config", {})


UNSUPPORTED_FLAGS = [
    (dict(use_torch_fsdp2=True), "--use-torch-fsdp2"),
    (dict(enable_cuda_graph=True), "--enable-cuda-graph"),
    (dict(cuda_graph_impl="transformer_engine"), "--cuda-graph-impl"),
    (dict(tp_comm_overlap=True), "--tp-comm-overlap"),
    (dict(context_parallel_size=2), "--context-parallel-size > 1"),
    (dict(fp4="e2m1"), "--fp4-format"),
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), "--fp8-recipe mxfp8"),
    (dict(mtp_num_layers=1), "--mtp-num-layers"),
    (dict(fp8="hybrid", fp8_recipe="blockwise"), "--fp8-recipe blockwise"),
    (dict(fp8="e4m3", fp8_recipe="custom"), "--fp8-recipe custom"),
]


@pytest.mark.parametrize("flags,named", UNSUPPORTED_FLAGS, ids=[n for _, n in UNSUPPORTED_FLAGS])
def test_untested_gpu_features_are_refused_before_the_model_is_built(monkeypatch, capsys, flags,
                                                                     named):
    """Each GPU feature the scale vectors are untested with: one line naming the flag, exit 2,
    when Megatron-LM's --spec imports our spec module (before gpt_builder builds the model);
    the same args without the flag pass, and so do the FP8 recipes that are not refused."""
    from types import SimpleNamespace

    args = SimpleNamespace(spec=["megatron_scalevec.megatron_lm_spec", "scalevec_dense"],
                           cuda_graph_impl="none", context_parallel_size=1)
    package = types.ModuleType("megatron.training")
    package.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    unified = ScaleVecConfig.from_string("unified")
    megatron_lm.start(unified)  # none set: nothing refused (and the strategy recorded)
    assert ScaleVecConfig.from_dict(args.scalevec) == unified
    for recipe in ("delayed", "tensorwise"):
        args.fp8, args.fp8_recipe = "hybrid", recipe
        megatron_lm.start(unified)
    args.fp8, args.fp8_recipe = None, "blockwise"  # a recipe without FP8 on: nothing
    megatron_lm.start(unified)
    for k, v in flags.items():
        setattr(args, k, v)
    with pytest.raises(SystemExit) as exit_info:
        megatron_lm.start(unified)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "is not supported" in err[0], err


CONFIG_FIELDS = [(f, n) for f, n in UNSUPPORTED_FLAGS if "use_torch_fsdp2" not in f]


@pytest.mark.parametrize("fields,named", CONFIG_FIELDS, ids=[n for _, n in CONFIG_FIELDS])
def test_untested_gpu_features_are_refused_when_the_spec_is_built(fields, named):
    """The same features set on a TransformerConfig (our trainer, Megatron-Bridge's providers):
    building our block spec raises one line naming the flag, before any model exists; the
    config without it has nothing refused."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_scalevec.config import unsupported_feature
    from megatron_scalevec.specs import get_scalevec_block_spec

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert unsupported_feature(config) is None
    for k, v in fields.items():
        object.__setattr__(config, k, v)  # past __post_init__'s own checks (CUDA, TE)
    with pytest.raises(ValueError) as err:
        get_scalevec_block_spec(config, "unified")
    assert named in str(err.value) and "\n" not in str(err.value), err.value
