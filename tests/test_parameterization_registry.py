"""A parameterization is one class in one registry (issue 53): a softplus gamma, defined and
registered in this file alone, parses as a strategy token, builds, trains through our trainer,
checkpoints and resumes exactly, folds to stock, exports ``--to hf``, warm-starts from stock, has
its decay classified and its statistics reported, with no change to the package.

``softplus``: one part ``u`` [m], ``gamma = softplus(u)``, ``u = log(expm1(gamma))`` back
(gamma > 0 only), init ``u = log(e - 1)`` (gamma = 1). IWD does **not** decay ``u``: decay pulls
``u`` toward 0, i.e. gamma toward ``log 2``, not toward 0, so it is not the shrinking IWD means;
its Input-Norm parts sit in the no-decay input rule (``decay_direction`` decays them).
"""

import functools
import json
import math
import os

import pytest
import torch

from megatron_scalevec import parameterizations, sharding
from megatron_scalevec.parameterizations import Parameterization, Part
from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.trainer_flags import TINY, run_convert, run_converter_cli, run_trainer

NAME = "softplus"
STRATEGY = "hg+dp+softplus+iwd"  # foldable (no DNP): converts to stock and to HF


class Softplus(Parameterization):
    """``gamma = softplus(u)``: elementwise, so a split vector needs no collective."""

    name = NAME
    parts = (Part("u", scalar=False, init=math.log(math.e - 1), decays=False),)
    domain = "gamma > 0"

    def gamma(self, part, vec):
        return torch.nn.functional.softplus(part("u"))

    def inverse(self, gamma, vec):
        return {"u": torch.log(torch.expm1(gamma))}

    def outside_domain(self, gamma):
        return gamma <= 0

    def statistics(self, vec):
        u = vec.u.detach().float()  # the whole vector's mean where it is split
        return {"u_mean": sharding.all_reduce_sum(u.sum(), vec.split_group) / vec.global_size}


@pytest.fixture(scope="module", autouse=True)
def softplus():
    """Registered for this file's tests (forked ranks inherit it), forgotten after."""
    parameterizations.register(Softplus())
    yield
    parameterizations.unregister(NAME)


def test_config_knows_it():
    from megatron_scalevec import ScaleVecConfig
    from megatron_scalevec.config import strategy_tokens

    assert NAME in strategy_tokens()
    cfg = ScaleVecConfig.from_string("HG + DNP + softplus + iwd")
    assert cfg.parameterization == NAME and cfg.to_string() == "hg+dnp+softplus+iwd"
    assert ScaleVecConfig.from_string(cfg.to_string()) == cfg and not cfg.stock_gamma
    with pytest.raises(ValueError, match="'or' and 'softplus' conflict"):
        ScaleVecConfig.from_string("hg+or+softplus")
    with pytest.raises(ValueError, match="none"):
        ScaleVecConfig.from_string("none+softplus")


def _built(rank, world):
    """A tiny dense model under hg+dnp+softplus+iwd: its vector parts, value at init, decay
    rule per part, invariant magnitudes, monitor statistics, and the set/get round trip."""
    from megatron_scalevec import ScaleVecConfig
    from megatron_scalevec.invariance import invariant_magnitudes
    from megatron_scalevec.optim import classify, decay_rules
    from megatron_scalevec.training.monitor import scale_vector_stats
    from megatron_scalevec.vectors import ScaleVector

    init_model_parallel()
    model = M.build_gpt(M.tiny_config(), "hg+dnp+softplus+iwd")
    vectors = {n: v for n, v in model.named_modules() if isinstance(v, ScaleVector) and v.enabled}
    at_init = max(float((v() - 1).abs().max()) for v in vectors.values())
    parts = {n: p.scalevec_part for n, p in model.named_parameters()
             if hasattr(p, "scalevec_part")}
    rules = {}
    for every_part in (False, True):
        cfg = ScaleVecConfig.from_string("hg+dnp+softplus+iwd", decay_direction=every_part)
        rules[every_part] = {n: classify(decay_rules(cfg, 0.1), p, n).name
                             for n, p in model.named_parameters() if n in parts}
    roles = {n: p.scalevec_role for n, p in model.named_parameters() if n in parts}
    M.perturb_vectors(model)
    stats = scale_vector_stats([model])
    name, vec = next(iter(vectors.items()))
    want = torch.linspace(0.5, 2.0, vec.size)
    vec.set_from_gamma(want)
    round_trip = float((vec() - want).abs().max())
    with pytest.raises(ValueError) as refused:
        vec.set_from_gamma(-want)
    return (at_init, parts, rules, roles, invariant_magnitudes(model), stats, round_trip,
            str(refused.value))


def test_parts_init_decay_statistics_and_inverse():
    at_init, parts, rules, roles, magnitudes, stats, round_trip, refused = run_on_ranks(
        _built, 1)[0]
    assert at_init < 1e-6  # gamma = 1 at init: the function of shared
    assert set(parts.values()) == {"u"} and any(".linear_qkv.scale_in.q.u" in n for n in parts)
    for n in parts:  # decay from the class: input parts not decayed unless every part is
        want = "output_vectors" if roles[n] == "output" else "input_directions"
        assert rules[False][n] == want, (n, rules[False][n])
        assert rules[True][n] == ("input_vectors" if roles[n] == "input" else want)
    assert {"input", "output"} <= set(roles.values())
    assert magnitudes == []  # no magnitude part: nothing DNP makes invariant
    means = {k: v for k, v in stats.items() if k.endswith("/u_mean")}
    assert len(means) == len(parts) and all(math.isfinite(v) for v in means.values())
    assert round_trip < 1e-5
    assert "SOFTPLUS parameterization needs gamma > 0" in refused


def _moe_count(rank, world, strategy):
    from scalevec_testing.experts import build_stock_moe, moe_config

    init_model_parallel()
    config = moe_config(False, moe_shared_expert_intermediate_size=40)
    stock = sum(p.numel() for p in build_stock_moe(config).parameters())
    return sum(p.numel() for p in M.build_gpt(config, strategy).parameters()) - stock


def test_moe_parameter_count():
    from megatron_scalevec import ScaleVecConfig
    from megatron_scalevec.layers.moe import moe_new_parameters
    from scalevec_testing.experts import EXPERTS

    shape = dict(num_layers=2, hidden=32, heads=4, query_groups=2, head_dim=8, ffn=64,
                 num_experts=EXPERTS, moe_ffn=24, shared_ffn=40, moe_layers=[1, 0])
    for strategy in ("hg+dp+softplus", "shared+softplus"):
        built = run_on_ranks(_moe_count, 1, strategy)[0]
        assert moe_new_parameters(ScaleVecConfig.from_string(strategy), **shape)["total"] == built


def _run(flags, run_dir, world=1):
    return run_on_ranks(run_trainer, world, TINY + ["--scalevec", STRATEGY, "--run-dir",
                                                    str(run_dir)] + flags, timeout=180)[0]


def _warm_refused(rank, world):
    """A stock state dict with a negative Pre-Norm gamma warm-started into softplus."""
    from megatron_scalevec.convert.arch import ModelArch
    from megatron_scalevec.convert.build import build_model
    from megatron_scalevec.convert.warmstart import warm_start

    arch = ModelArch(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=64, vocab_size=64, max_sequence_length=32)
    sd = {k: v.detach().clone() for k, v in build_model(arch.replace(scalevec="stock"))
          .state_dict().items() if not k.endswith("_extra_state")}
    sd["decoder.layers.0.input_layernorm.weight"][0] = -0.5
    with pytest.raises(ValueError) as err:
        warm_start(sd, arch, "hg+softplus")
    return str(err.value)


def test_trains_resumes_converts(tmp_path):
    """6 steps straight == 3 steps, exit, resume to 6; TP2 + SP gives the same losses; the
    monitor logs its statistic; the checkpoint folds to stock and exports to HF exactly; stock
    warm-starts into it exactly."""
    j = functools.partial(os.path.join, str(tmp_path))
    common = ["--train-iters", "6", "--weight-decay", "0.1"]
    straight = _run(common + ["--no-save"], j("a"))
    first = _run(common + ["--exit-interval", "3", "--save", j("ck")], j("b"))
    second = _run(common + ["--load", j("ck"), "--save", j("ck")], j("b"))
    assert len(straight) == 6 and first + second == straight, (first, second, straight)
    # TP2 + SP splits the DP output vectors (their parts sharded by the class's shapes)
    split = _run(["--train-iters", "3", "--weight-decay", "0.1", "--no-save",
                  "--tensor-model-parallel-size", "2", "--sequence-parallel"], j("tp2"), world=2)
    assert len(split) == 3 and all(abs(a - b) < 1e-4 * abs(b) for a, b in zip(split, straight)), \
        (split, straight)
    last = json.loads(open(j("b", "metrics.jsonl")).read().splitlines()[-1])
    assert any(k.endswith(".scale_in.q/u_mean") for k in last), sorted(last)[:20]
    from megatron_scalevec.training.plotting import gamma_panels, read_metrics, read_sites

    assert gamma_panels(read_metrics(j("b")), "u_mean", read_sites(j("b")))[
        "attention input (HG)"]["q"]

    stock = run_on_ranks(run_convert, 1, j("ck"), j("stock"), "stock")[0]
    assert stock["max_logit_diff"] < 1e-5, stock
    rc, out = run_on_ranks(run_converter_cli, 1,
                           ["--load", j("ck"), "--to", "hf", "--save", j("hf")])[0]
    assert rc == 0, out
    assert json.loads(out)["max_logit_diff"] < 1e-4, out
    warm = run_on_ranks(run_convert, 1, j("stock"), j("warm"), "hg+dp+softplus")[0]
    assert warm["target"] == "hg+dp+softplus" and warm["max_logit_diff"] < 1e-5, warm
    refused = run_on_ranks(_warm_refused, 1)[0]
    assert "SOFTPLUS parameterization needs gamma > 0" in refused, refused
    assert "decoder.layers.0." in refused
