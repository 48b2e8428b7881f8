"""What is fixed within an optimizer step is paid once per step (megatron_scalevec/steps.py):
with megatron-core's micro-batch calculator set up (as Megatron-LM, Bridge and our trainer do),
every micro-batch's ``G = dL/dW_eff`` is accumulated into W's ``main_grad`` and the step's last
micro-batch maps the sum (layers/fold.py ``StepMap``), and each scale vector is computed once
per step and its gradient reduced over its group once per step (vectors.py ``_value``); without
a calculator every micro-batch does both. Both give the same losses, grad norms and SGD updates
(relative to each tensor's scale) in one process (local linears, local grouped experts, TE's
linears and TE grouped experts over the test stand-in, with TE's fused wgrad accumulation on and
off), at DP2 with the distributed optimizer and overlapped reduction, and at TP2 with and
without sequence parallelism; the map runs once per folded weight per step; at TP2 the vectors
add at most 2 collectives per layer per micro-batch (DNP's statistics over the split FFN width,
forward and backward); a calculator that disagrees with the schedule's micro-batch count is
refused in one line."""

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.module import Float16Module

from megatron_scalevec.layers import fold
from scalevec_testing import init_model_parallel, run_on_ranks, te_stub
from scalevec_testing import models as M
from scalevec_testing.markers import needs_te

STEPS, MICRO = 2, 8
# Summing 8 micro-batches' gradients in another order changes an fp32 weight gradient by up to
# 1.3e-4 of its scale (an expert's fc1 here: the per-micro-batch path itself, micro-batches
# reversed); a wrong map or a map on the wrong micro-batch is off by the vectors' perturbation.
REL = 1e-3


def _train(rank, world, strategy, per_step, *, tp=1, dist_opt=False, overlap=False,
           experts=0, steps=STEPS, recompute=False, sequence_parallel=None, te=False,
           te_fused_wgrad=False, grouped=False, bf16=False, extra=None):
    context = contextlib.nullcontext
    if te:  # TE's real Python over the test stand-in (scalevec_testing/te_stub.py)
        te_stub.activate()
        context, kw_te = te_stub.cuda_claimed, dict(transformer_impl="transformer_engine")
    init_model_parallel(tp=tp)
    kw = dict(sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel)
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=24,
                  moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped)
    if te:
        kw.update(kw_te)
    if bf16:  # bf16 parameters and main_grad (no fp32 gradient accumulation)
        kw.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    config = M.tiny_config(**kw, **(extra or {}))
    with context():
        model = M.build_gpt(config, strategy)
    if te_fused_wgrad:  # TE's linears only: the output layer would need APEX's CUDA kernel
        assert M.te_fused_wgrad_accumulation(model) > 0
    M.perturb_vectors(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = Float16Module(config, model) if bf16 else model
    ddp = M.wrap_ddp(wrapped, config, dist_opt, overlap_grad_reduce=overlap,
                     grad_reduce_in_fp32=not bf16)
    opt = M.make_optimizer(ddp, dist_opt, lr=1e-2, optimizer="sgd")
    maps = [0]
    real = fold.map_in_place

    def counted(*args):
        maps[0] += 1
        return real(*args)

    ours = [0]  # all-reduces our package adds (sharding.py's), each rank's own count
    all_reduce = dist.all_reduce

    def all_reduce_counted(*args, **kwargs):
        caller = sys._getframe(2).f_globals["__name__"]  # who called sharding.py
        # layers/linear.py's backward reduces a column-parallel input gradient over TP where
        # megatron-core's own linear (stock's) does the same: not an addition
        ours[0] += (sys._getframe(1).f_globals["__name__"].startswith("megatron_scalevec")
                    and caller != "megatron_scalevec.layers.linear")
        return all_reduce(*args, **kwargs)

    fold.map_in_place, dist.all_reduce = counted, all_reduce_counted
    try:
        norms: list = []
        losses = M.train_steps(ddp, config, M.batches(MICRO, 2), steps, opt, norms,
                               per_step_map=per_step,
                               forward_context=te_stub.cuda_claimed if te else None)
    finally:
        fold.map_in_place, dist.all_reduce = real, all_reduce
        M.set_microbatches(None)
    M.sync_params(ddp)
    folded = _folded_weights(model)
    if bf16:  # bf16 parameters round away an SGD update's detail: the step's gradients
        deltas = {n: p.main_grad.float() for n, p in model.named_parameters()}
    else:
        deltas = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    return dict(losses=losses, norms=norms, deltas=deltas, maps=maps[0], folded=folded,
                steps=steps, ours=ours[0], layers=config.num_layers)


def _folded_weights(model) -> int:
    """Weights a step's map must map once: each folded linear's, each expert's of a grouped
    linear or grouped experts module."""
    n, read_only = 0, set()  # grouped experts read their fc1 modules' weights, never call them
    for m in model.modules():
        if getattr(m, "_step_map", None) is None or id(m) in read_only:
            continue
        if hasattr(m, "local_experts"):  # local grouped experts: their fc1 modules hold vectors
            read_only |= {id(e.linear_fc1) for e in m.local_experts}
            n += len(m.local_experts) * m.local_experts[0].linear_fc1.has_scale_vectors
        elif m.has_scale_vectors and getattr(m, "scalevec_mode", "weight") == "weight":
            n += getattr(m, "num_gemms", 1)
    return n


def _compare(world, strategy, rel=REL, loss_rel=1e-5, **kw):
    per_step = run_on_ranks(_train, world, strategy, True, **kw)
    per_micro = run_on_ranks(_train, world, strategy, False, **kw)
    for a, b in zip(per_step, per_micro):
        assert a["maps"] == a["steps"] * a["folded"] and b["maps"] == 0, (a["maps"], a["folded"])
        for x, y in zip(a["losses"] + a["norms"], b["losses"] + b["norms"]):
            assert abs(x - y) <= loss_rel * max(abs(y), 1e-3), (a["losses"], b["losses"],
                                                                a["norms"], b["norms"])
        diffs = M.relative_differences(b["deltas"], a["deltas"])
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < rel, (worst, diffs[worst])
    return per_step


@pytest.mark.parametrize("strategy", ["hg+dp", "unified", "hg+dp+er"])
def test_map_once_per_step_equals_map_per_micro_batch(strategy):
    r = _compare(1, strategy)[0]
    assert r["folded"] > 0


@needs_te
@pytest.mark.parametrize("fusion", [True, False], ids=["fused_wgrad", "unfused"])
@pytest.mark.parametrize("strategy", ["hg+dp", "unified"])
def test_te_map_once_per_step(strategy, fusion):
    # TE's linears: G summed in W's main_grad by TE's GEMM (fuse_wgrad_accumulation, as
    # Megatron-LM configures it by default) or by the fold's backward, then mapped once
    r = _compare(1, strategy, te=True, te_fused_wgrad=fusion)[0]
    assert r["folded"] > 0


@needs_te
@pytest.mark.parametrize("fusion", [True, False], ids=["fused_wgrad", "unfused"])
def test_te_grouped_experts_map_once_per_step(fusion):
    # every expert's G summed in its own main_grad, all experts mapped on the last micro-batch
    r = _compare(1, "unified", te=True, te_fused_wgrad=fusion, experts=4, grouped=True)[0]
    assert r["folded"] > 0


@needs_te
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "te_grouped"])
def test_te_map_once_per_step_with_biases(experts):
    # linear biases (DP refuses one: hg+dnp) under TE's fused wgrad accumulation: the bias
    # gradients TE's GEMMs compute ride along with the per-step map, dense and TE grouped
    r = _compare(1, "hg+dnp", te=True, te_fused_wgrad=True, experts=experts,
                 grouped=bool(experts), extra=dict(add_bias_linear=True))[0]
    moved = [n for n, d in r["deltas"].items() if n.rsplit(".", 1)[-1].startswith("bias")
             and float(d.abs().sum()) > 0]
    assert r["folded"] > 0 and len(moved) >= 4, moved  # the biases trained, in both modes


@pytest.mark.parametrize("strategy", ["hg+dp", "unified"])
def test_grouped_experts_map_once_per_step(strategy):
    r = _compare(1, strategy, experts=4, grouped=True)[0]
    assert r["folded"] > 0


def test_map_once_per_step_bf16_main_grad():
    # bf16 parameters and main_grad: G summed in bf16 then mapped, against each micro-batch's
    # mapped dW summed in bf16: equal to bf16 rounding (2^-8 relative per add, 8 adds)
    _compare(1, "unified", bf16=True, steps=1, rel=3e-2, loss_rel=1e-2)


def test_map_once_per_step_dp2_distributed_optimizer_overlapped():
    _compare(2, "unified", dist_opt=True, overlap=True)


def test_map_once_per_step_tp2_sequence_parallel_moe():
    # one step: a second one's top-k routing would amplify rounding-level differences
    _compare(2, "hg+dp+or", tp=2, experts=4, steps=1)


@pytest.mark.parametrize("sp", [False, True])
def test_vectors_once_per_step_tp2_at_most_two_collectives_per_layer_per_micro_batch(sp):
    r = _compare(2, "unified", tp=2, sequence_parallel=sp)[0]
    # a layer a micro-batch: DNP's statistics over the split FFN width, forward and backward;
    # a layer a step: the split OR vectors' (a_g, a_u, read together) forward statistic; the
    # model a step: one sum of every replicated vector's gradient and every split vector's
    # backward statistic (vectors.py _close)
    layers = r["layers"]
    assert r["ours"] / r["steps"] == layers * 2 * MICRO + layers + 1, r["ours"]


def test_split_er_vectors_once_per_step_tp2():
    # ER's split statistics (sum(v) forward, sum(g * gamma) backward in the step's close)
    _compare(2, "hg+dp+er", tp=2)


def test_map_once_per_step_under_full_recompute():
    _compare(1, "unified", recompute=True)


def _wrong_count(rank, world, calculator, schedule):
    init_model_parallel()
    config = M.tiny_config()
    model = M.build_gpt(config, "unified")
    ddp = M.wrap_ddp(model, config)
    data = M.batches(schedule, 2)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(it, m):
        b = next(it)
        out = m(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, lambda t: (t.float().mean(), {})

    M.set_microbatches(calculator)
    try:
        for _ in range(2):
            ddp.zero_grad_buffer()
            get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(data), model=[ddp],
                num_microbatches=schedule, seq_length=M.SEQ, micro_batch_size=2,
                forward_only=False)
    except RuntimeError as err:
        return str(err)
    finally:
        M.set_microbatches(None)
    return "no error"


def test_a_calculator_that_disagrees_with_the_schedule_is_refused():
    more = run_on_ranks(_wrong_count, 1, 2, 4)[0]  # the schedule runs more micro-batches
    assert "get_num_microbatches() is 2" in more, more
    fewer = run_on_ranks(_wrong_count, 1, 4, 2)[0]  # ... fewer: the map never ran
    assert "never mapped" in fewer, fewer
