"""IWD in megatron-core's optimizer: which parameters decay, and that a step decays exactly those.

Expected roles come from SPEC.md's table, written here by parameter *name* (not by the
attributes optim.py reads), so a wrong attribute or rule shows up as a mismatch.
"""

import re

import pytest

from megatron_scalevec.config import ScaleVecConfig
from scalevec_testing import models as M
from scalevec_testing.distributed import init_model_parallel, run_on_ranks

LR, WD, SVWD = 0.5, 0.2, 0.6  # distinct values: the shrink factor tells which rule applied

# Input-Norm (decay on weight / magnitude / alpha): HG input vectors, router, experts, Pre-Norm
# and final norm gammas, DP output vectors (default reading).
INPUT = re.compile(r"(scale_in\.|final_layernorm\.|input_layernorm\.|pre_mlp_layernorm\.)")
OUTPUT = re.compile(r"(q_norm|k_norm|v_norm|gate_norm|up_norm|scale_out\.)")


def expected_decay(name: str, p, cfg: ScaleVecConfig) -> float:
    """Weight decay SPEC.md asks for, from the name alone."""
    part = name.rsplit(".", 1)[-1]
    dp_input = cfg.dp and "scale_out." in name and cfg.dp_output_role == "input"
    if OUTPUT.search(name) and not dp_input:
        return 0.0
    if INPUT.search(name) or dp_input:
        if not cfg.iwd:
            return 0.0 if p.dim() == 1 else WD
        decayed = {"weight", "magnitude", "alpha"}
        if cfg.decay_direction:
            decayed |= {"direction", "logit"}
        return (SVWD if cfg.scale_vector_weight_decay is not None else WD) \
            if part in decayed else 0.0
    return 0.0 if p.dim() == 1 or name.endswith(".bias") else WD


def _build(strategy, tp, ep, moe, svwd, dist_opt, scheduler=True, **readings):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_scalevec.optim import build_optimizer
    from scalevec_testing.models import build_gpt, tiny_config

    init_model_parallel(tp=tp, ep=ep)
    # the decay alone: the vectors at the base LR (their multiplier: tests/test_vector_lr.py)
    cfg = ScaleVecConfig.from_string(strategy, scale_vector_weight_decay=svwd,
                                     vector_lr_mult=1.0, **readings)
    extra = {}
    if moe:
        extra = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                     expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
                     sequence_parallel=tp > 1, moe_grouped_gemm=False)
    model = build_gpt(tiny_config(**extra), cfg)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt,
                                                    grad_reduce_in_fp32=True), model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD,
                              use_distributed_optimizer=dist_opt, clip_grad=0.0)
    lines = []
    opt = build_optimizer(opt_cfg, [ddp], cfg, log=lines.append)
    if scheduler:
        OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
                                lr_decay_steps=10, lr_decay_style="constant", start_wd=WD,
                                end_wd=WD, wd_incr_steps=10, wd_incr_style="constant")
    return cfg, ddp, opt, lines


def _decay_step(rank, world, strategy, tp, ep, moe, svwd, dist_opt, scheduler=True,
                **readings):
    """Zero gradients, one step: Adam's update is 0, so p -> p (1 - lr wd). Returns mismatches."""
    cfg, ddp, opt, lines = _build(strategy, tp, ep, moe, svwd, dist_opt, scheduler, **readings)
    params = dict(ddp.named_parameters())
    factors = M.zero_grad_step_factors(ddp, opt)
    bad, seen = [], {"input_decayed": 0, "output": 0}
    for n, got in factors.items():
        want = 1.0 - LR * expected_decay(n, params[n], cfg)
        if abs(got - want) > 1e-5:
            bad.append(f"{n}: shrink {got:.4f}, expected {want:.4f}")
        if OUTPUT.search(n):
            seen["output"] += 1
        elif INPUT.search(n) and want < 1.0:
            seen["input_decayed"] += 1
    return bad, seen, lines


@pytest.mark.parametrize("layout", [
    dict(tp=2, ep=1, moe=False),
    dict(tp=1, ep=2, moe=True),
])
def test_iwd_decay_acts_exactly_on_input_norm_vectors(layout):
    """Distributed optimizer, 2 ranks: after a zero-gradient step exactly the Input-Norm
    vector parts (and matrices) shrank, by their own decay values; Output-Norm ones did not."""
    results = run_on_ranks(_decay_step, 2, "unified", svwd=SVWD, dist_opt=True, **layout)
    for bad, seen, _ in results:
        assert not bad, "\n".join(bad)
        assert seen["input_decayed"] > 0 and seen["output"] > 0
    summary = "\n".join(results[0][2])  # rank 0 prints the summary
    assert "input_vectors" in summary and "output_vectors" in summary


def test_iwd_off_is_megatron_default():
    """Without IWD (hg+dnp+or) no 1-D parameter decays, as in stock Megatron."""
    for bad, _, _ in run_on_ranks(_decay_step, 2, "hg+dnp+or", tp=2, ep=1, moe=False,
                                  svwd=None, dist_opt=False):
        assert not bad, "\n".join(bad)


def test_iwd_plain_vectors_and_decay_direction():
    """shared+iwd (plain gammas: Pre-Norm and final norm weights decay) in one process."""
    def fn(rank, world):
        return _decay_step(rank, world, "shared+iwd", 1, 1, False, None, False)

    for bad, seen, _ in run_on_ranks(fn, 1):
        assert not bad, "\n".join(bad)
        assert seen["input_decayed"] > 0


def test_iwd_without_scheduler_from_the_first_step():
    """build_optimizer alone (no OptimizerParamScheduler ever built) gives every group its
    decay: Output-Norm vectors and OR directions none, scale_vector_weight_decay honoured."""
    for svwd in (None, SVWD):
        for bad, seen, _ in run_on_ranks(_decay_step, 1, "unified", tp=1, ep=1, moe=False,
                                         svwd=svwd, dist_opt=False, scheduler=False):
            assert not bad, f"svwd={svwd}:\n" + "\n".join(bad)
            assert seen["input_decayed"] > 0 and seen["output"] > 0


@pytest.mark.parametrize("strategy,readings", [
    ("hg+dp+iwd", {}),                                   # DP vectors: Input-Norm (reading)
    ("hg+dp+er+iwd", {"dp_output_role": "output"}),      # DP vectors as Output-Norm
    ("hg+dnp+or+iwd", {"decay_direction": True}),        # OR directions decay too
    ("hg+dp+er+iwd", {"decay_direction": True}),         # ER logits decay too
])
def test_iwd_readings(strategy, readings):
    """The IWD readings of config.py, 2 ranks TP=2, distributed optimizer, no scheduler."""
    for bad, seen, _ in run_on_ranks(_decay_step, 2, strategy, tp=2, ep=1, moe=False,
                                     svwd=SVWD, dist_opt=True, scheduler=False, **readings):
        assert not bad, "\n".join(bad)
        assert seen["input_decayed"] > 0


def _schedule(rank, world, svwd):
    """Matrices' decay ramps 0.1 -> 0.5 (linear, 10 steps): the decay per group at step 5."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_scalevec.optim import classify, decay_rules

    cfg, ddp, opt, _ = _build("unified", 1, 1, False, svwd, False, scheduler=False)
    sched = OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
                                    lr_decay_steps=10, lr_decay_style="constant", start_wd=0.1,
                                    end_wd=0.5, wd_incr_steps=10, wd_incr_style="linear")
    sched.step(5)
    rules = decay_rules(cfg, WD)
    names = {id(p): n for n, p in ddp.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            rule = classify(rules, p, names[id(p)]).name
            out.setdefault(rule, set()).add(round(group["weight_decay"], 12))
    return out


def test_vector_decay_follows_the_matrices_schedule():
    """Unset: the vectors decay exactly as the matrices (0.3 at step 5 of 0.1 -> 0.5, not the
    base WD = 0.2); set to SVWD = 3 x WD: three times the matrices' decay along the schedule."""
    same = run_on_ranks(_schedule, 1, None)[0]
    assert same["matrices"] == same["input_vectors"] == {0.3}, same
    scaled = run_on_ranks(_schedule, 1, SVWD)[0]
    assert scaled["matrices"] == {0.3}
    assert scaled["input_vectors"] == {round(0.3 * SVWD / WD, 12)}, scaled
    assert scaled["output_vectors"] == scaled["input_directions"] == {0.0}


def _missing_rule(rank, world):
    from megatron_scalevec.optim import decay_rules, decay_summary
    from scalevec_testing.models import build_gpt, tiny_config

    init_model_parallel()
    model = build_gpt(tiny_config(), None)  # stock spec: no scale-vector attributes
    try:
        decay_summary(decay_rules(ScaleVecConfig.from_string("unified"), WD), [model], WD,
                      ScaleVecConfig.from_string("unified"))
    except RuntimeError as e:
        return str(e)
    return None


def test_rule_matching_nothing_fails():
    (msg,) = run_on_ranks(_missing_rule, 1)
    assert msg is not None and "input_vectors" in msg
