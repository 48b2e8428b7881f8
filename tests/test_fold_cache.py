"""The fold once per optimizer step (layers/fold_cache.py) equals the fold per micro-batch.

Each case trains the same model twice in one set of gloo ranks, ``fold_per_step`` on and off,
through megatron-core's DDP, optimizer and forward-backward schedule: the loss, every
``main_grad`` after the first step (per rank, so any layout compares as it is) and the
updates of two SGD steps (the second one runs on a W_eff rebuilt after the first step) must
agree, with tolerances relative to each tensor's scale. The cases cover 1 and 4 micro-batches
per rank, ``overlap_grad_reduce`` on and off, the distributed optimizer, dense and MoE with
sequential and grouped experts, TP2 with sequence parallelism, EP2, and pipeline parallelism
(PP2, and PP2 with two virtual stages per rank: the interleaved schedule runs micro-batches of
the two model chunks in turn, each chunk's cycle must still see its own n forwards and map
back in its own last backward); and that the mode was
really used (or not: 1 micro-batch, activation recompute). The same switch turns on the scale
vectors' own gamma once per step (vectors.py ``cache_per_step``): the counts of completed
vector cycles show it ran, for OR and ER vectors, split or reduced over TP, per expert and
shared by the experts. Then each safety check raises.
"""

import pytest
import torch

from megatron_scalevec import ScaleVecConfig
from megatron_scalevec.layers.layer import ScaleVecTransformerLayer, layer_vectors
from megatron_scalevec.testing import init_model_parallel, run_on_ranks
from megatron_scalevec.testing import models as M
from megatron_scalevec.vectors import ScaleVector

RTOL = 1e-5  # measured worst: ~1e-6 (float32 summation order of the micro-batches)
TINY = 2e-8  # an OR magnitude's gradient is a cancelling sum (see M.relative_mismatches)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
           moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2)


STEPS = 3  # one step of gradients, then two SGD steps


def _train(config, strategy, on, n_micro, world_dp, dist_opt, overlap, sv=None):
    from megatron_scalevec.layers import fold_cache

    chunks = M.build_gpt_chunks(config, ScaleVecConfig.from_string(
        strategy, fold_per_step=on, **(sv or {})))  # one chunk but under VPP
    model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)  # names: "i.name"
    M.perturb_vectors(model)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    ddp = M.wrap_ddp(chunks, config, dist_opt, overlap_grad_reduce=overlap)
    opt = M.make_optimizer(ddp, dist_opt, lr=0.1, optimizer="sgd")
    data = M.batches(n_micro * world_dp, 2)
    losses = M.train_steps(ddp, config, data, 1)  # gradients of one step, no update
    grads = {k: p.main_grad.detach().clone() for k, p in model.named_parameters()}
    losses += M.train_steps(ddp, config, data, 2, opt)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    cycles = sum(fold_cache.completed_cycles(m) for m in model.modules()
                 if not isinstance(m, (ScaleVector, ScaleVecTransformerLayer)))
    # A vector's cycles: its own, or its layer's when the layer evaluates it (layers/layer.py)
    by_layer = {id(v): fold_cache.completed_cycles(m) for m in model.modules()
                if isinstance(m, ScaleVecTransformerLayer) for v in layer_vectors(m)}
    cached = [m for m in model.modules() if isinstance(m, ScaleVector) and m._step is not None]
    vec_cycles = [fold_cache.completed_cycles(m) + by_layer.get(id(m), 0) for m in cached]
    assert not any(fold_cache.completed_cycles(m) for m in cached if id(m) in by_layer)
    layer_cycles = [fold_cache.completed_cycles(m) for m in model.modules()
                    if isinstance(m, ScaleVecTransformerLayer) and layer_vectors(m)]
    return dict(losses=losses, grads=grads, params=params, start=start, cycles=cycles,
                vec_cycles=vec_cycles, layer_cycles=layer_cycles)


def _case(rank, world, strategy, *, n_micro, tp=1, pp=1, vpp=None, ep=1, sp=False,
          dist_opt=False, overlap=False, config=None, sv=None):
    init_model_parallel(tp=tp, pp=pp, vpp=vpp, ep=ep)
    from megatron.core import parallel_state as ps

    kw = dict(sequence_parallel=sp, **(config or {}))
    if "num_moe_experts" in kw:
        kw.update(expert_model_parallel_size=ep)
    config = M.tiny_config(**kw)
    dp = ps.get_data_parallel_world_size()
    step, mb = (_train(config, strategy, on, n_micro, dp, dist_opt, overlap, sv)
                for on in (True, False))
    bad = M.relative_mismatches(mb["grads"], step["grads"], rtol=RTOL, tiny=TINY)
    bad += [f"update {b}" for b in M.relative_mismatches(
        mb["params"], step["params"], rtol=1e-4, tiny=TINY, base=mb["start"])]
    return dict(bad=bad, losses=(step["losses"], mb["losses"]),
                cycles=(step["cycles"], mb["cycles"]), keys=len(mb["grads"]),
                vec_cycles=(step["vec_cycles"], mb["vec_cycles"]),
                layer_cycles=(step["layer_cycles"], mb["layer_cycles"]))


CASES = {
    "dense_dp2": dict(world=2),
    "dense_dp2_overlap": dict(world=2, overlap=True),
    "dense_dp2_distopt": dict(world=2, dist_opt=True),
    "dense_dp2_distopt_overlap": dict(world=2, dist_opt=True, overlap=True),
    "dense_tp2_sp_overlap": dict(world=2, tp=2, sp=True, overlap=True),
    "moe_sequential_ep2_distopt_overlap": dict(world=2, ep=2, dist_opt=True, overlap=True,
                                               config=MOE),
    "moe_grouped_dp2_overlap": dict(world=2, overlap=True,
                                    config=dict(MOE, moe_grouped_gemm=True)),
    "moe_grouped_ep2_distopt": dict(world=2, ep=2, dist_opt=True,
                                    config=dict(MOE, moe_grouped_gemm=True)),
    "moe_grouped_tp2_sp": dict(world=2, tp=2, sp=True, config=dict(MOE, moe_grouped_gemm=True)),
    # 4 layers: 2 per rank; under VPP2 two chunks per rank of 1 layer each (interleaved 1F1B)
    "dense_pp2": dict(world=2, pp=2, config=dict(num_layers=4)),
    "dense_pp2_vpp2": dict(world=2, pp=2, vpp=2, config=dict(num_layers=4)),
}


def _check(case, strategy, n_micro, **extra):
    opts = dict(CASES[case], **extra)
    world = opts.pop("world")
    res = run_on_ranks(_case, world, strategy, n_micro=n_micro, **opts)
    for r in res:
        assert not r["bad"], f"{case} {strategy} x{n_micro}:\n" + "\n".join(r["bad"])
        step, mb = r["losses"]
        assert step == pytest.approx(mb, rel=1e-6), r["losses"]
        assert step[-1] < step[1], r["losses"]  # the SGD steps did something
        assert r["keys"] >= 9
    return res


@pytest.mark.parametrize("case", list(CASES))
def test_step_fold_equals_micro_batch_fold(case):
    res = _check(case, "unified", 4)
    for r in res:
        assert r["cycles"][0] > 0 and r["cycles"][1] == 0, r["cycles"]  # the mode really ran
        _assert_vectors_cached(case, r)


def _assert_vectors_cached(case, r):
    """Every vector that opted in completed one cycle per step (its layer's, grouped experts'
    per-expert norms too), and so did every layer that evaluates vectors (all of this rank's
    layers: 2 per rank in the pipeline cases); none did with the mode off."""
    on, off = r["vec_cycles"]
    assert on and not any(off), r["vec_cycles"]
    assert set(on) == {STEPS}, on
    on, off = r["layer_cycles"]
    assert on and set(on) == {STEPS} and not any(off), r["layer_cycles"]
    if "pp2" in case:
        assert len(on) == 2, r["layer_cycles"]


@pytest.mark.parametrize("case,strategy,sv", [
    ("dense_dp2_distopt_overlap", "hg+dnp+er", None),
    ("dense_pp2_vpp2", "hg+dnp+er", None),  # ER vectors, chunks interleaved
    ("dense_tp2_sp_overlap", "er", None),  # Pre-Norm gammas reduced over TP (SP)
    ("dense_tp2_sp_overlap", "hg+dnp+er", None),  # split ER over the FFN width
    ("moe_sequential_ep2_distopt_overlap", "hg+dnp+er", None),
    ("moe_sequential_ep2_distopt_overlap", "unified", dict(expert_vectors="shared")),
    ("moe_grouped_tp2_sp", "unified", dict(expert_vectors="shared")),
])
def test_vectors_once_per_step_equal_per_micro_batch(case, strategy, sv):
    """The vectors' gamma once per step (OR and ER, plain Pre-Norm ones under SP, computed
    once per forward when shared by the experts) equals computing it per micro-batch."""
    for r in _check(case, strategy, 4, sv=sv):
        _assert_vectors_cached(case, r)


@pytest.mark.parametrize("case,strategy", [("dense_tp2_sp_overlap", "hg+dp+er"),
                                           ("dense_tp2_sp_overlap", "hg+dp"),
                                           ("moe_grouped_tp2_sp", "hg+dp+er")])
def test_step_fold_equals_micro_batch_fold_output_vectors(case, strategy):
    """Both sides of the fold (DP's output vector, plain and ER), TP2: split output rows."""
    _check(case, strategy, 4)


@pytest.mark.parametrize("case", ["dense_dp2_distopt_overlap", "moe_grouped_dp2_overlap"])
def test_one_micro_batch_folds_per_micro_batch(case):
    res = _check(case, "unified", 1)
    assert all(r["cycles"] == (0, 0) for r in res), res
    assert all(not any(r["vec_cycles"][0] + r["vec_cycles"][1]) for r in res), res


def test_activation_recompute_folds_per_micro_batch():
    """Recompute re-runs forwards in backward (here the MLP's, fc1 folded): the step fold
    must stay off there. (Full recompute cannot run on CPU: its recompute in the autograd
    thread escapes the CPU layer's device mapping.)"""
    recompute = dict(recompute_granularity="selective", recompute_modules=["mlp"])
    res = run_on_ranks(_case, 1, "unified", n_micro=4, config=recompute)
    assert not res[0]["bad"], res[0]["bad"]
    assert res[0]["cycles"] == (0, 0), res[0]["cycles"]
    assert not any(res[0]["vec_cycles"][0]), res[0]["vec_cycles"]


def _norm_case(rank, world, modules):
    """One OR Pre-Norm under selective recompute of ``modules``, 4 micro-batches by hand:
    (completed vector cycles with the mode on and off, gradients equal)."""
    init_model_parallel()
    from megatron_scalevec.layers import fold_cache
    from megatron_scalevec.norms import ScaleVecNorm

    config = M.tiny_config(recompute_granularity="selective", recompute_modules=modules)
    xs = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(0))
    grads, cycles = [], []
    for on in (True, False):
        norm = ScaleVecNorm(config, 32, scalevec=ScaleVecConfig.from_string(
            "or", fold_per_step=on))
        M.perturb_vectors(norm)
        with fold_cache.step(len(xs)):
            for x in xs:
                norm(x).pow(3).sum().backward()
        grads.append([p.grad.clone() for p in norm.parameters()])
        cycles.append(fold_cache.completed_cycles(norm))
    same = all(float((a - b).abs().max()) <= RTOL * float(b.abs().max()) for a, b in zip(*grads))
    return tuple(cycles), same


@pytest.mark.parametrize("modules,cycles", [(["layernorm"], (0, 0)), (["core_attn"], (1, 0))])
def test_norm_recompute_computes_vectors_per_micro_batch(modules, cycles):
    """Recomputing the norms re-runs their forward in backward: their gamma stays per
    micro-batch then; a recompute that never re-runs a norm keeps it once per step.
    (megatron-core's norm recompute itself cannot run here: without TE it raises NameError.)"""
    assert run_on_ranks(_norm_case, 1, modules)[0] == (cycles, True)


# ----------------------------------------------------------------- safety checks, one layer

def _layer_case(rank, world, check):
    """One folded qkv projection, unified, driven by hand."""
    init_model_parallel()
    from megatron_scalevec.layers import fold_cache
    from megatron_scalevec.layers.linear import ScaleVecColumnParallelLinear

    config = M.tiny_config()
    lin = ScaleVecColumnParallelLinear(
        32, 64, scalevec=ScaleVecConfig.from_string("unified"), branches="qkv", config=config,
        init_method=torch.nn.init.normal_, bias=False, gather_output=False)
    M.perturb_vectors(lin)
    x = torch.randn(3, 2, 32)

    def mb():
        out, _ = lin(x)
        out.square().sum().backward()

    try:
        if check == "too_few":  # 4 announced, 2 run
            with fold_cache.step(4):
                mb()
                mb()
        elif check == "weight_changed":  # found at the last forward, before the map back
            fold_cache.begin_step(4)
            mb()
            with torch.no_grad():
                lin.weight.add_(1.0)
            mb()
            mb()
            mb()
        elif check == "new_step":
            fold_cache.begin_step(4)
            mb()
            fold_cache.begin_step(4)
        elif check == "missing_backward":  # a micro-batch whose backward never ran
            with fold_cache.step(4):
                lin(x)
                mb()
                mb()
                mb()
        elif check == "accumulates_fp32":
            lin.to(torch.bfloat16)
            x = x.to(torch.bfloat16)
            with fold_cache.step(4):
                mb()
                mb()
                cycle = lin.__dict__["_scalevec_step_fold"]
                dtype = cycle.acc.dtype
                mb()
                mb()
            return str(dtype)
    except RuntimeError as e:
        return str(e)
    finally:
        fold_cache._STATE["n"] = None
    return None


@pytest.mark.parametrize("check,message", [
    ("too_few", "the optimizer step ended while 1 folded weight(s) or vector(s) had not mapped"),
    ("weight_changed", "the weight changed within the step"),
    ("new_step", "a new optimizer step began while 1 folded weight(s) or vector(s)"),
    ("missing_backward", "found 2 of the 3 earlier micro-batches' gradients"),
])
def test_unsound_cycle_raises(check, message):
    result = run_on_ranks(_layer_case, 1, check)[0]
    assert result is not None and message in result, result


def test_bf16_gradients_accumulate_in_fp32():
    assert run_on_ranks(_layer_case, 1, "accumulates_fp32")[0] == "torch.float32"


def test_bench_variant_folds_per_micro_batch_on_request():
    from megatron_scalevec.bench import parse_variant

    assert parse_variant("unified")[0].fold_per_step
    assert not parse_variant("unified@mbfold,eager")[0].fold_per_step
