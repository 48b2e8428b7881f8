"""A transformer layer evaluates its cached scale vectors at once (layers/layer.py): held for
the layer's forward only, stacked by kind, one cycle per layer per step; off in the reference
path (which the whole-model fused-vs-reference tests compare with)."""

import contextlib

import pytest

from megatron_scalevec.testing import init_model_parallel, run_on_ranks
from megatron_scalevec.testing import models as M


def _held(rank, world, strategy, moe, reference):
    init_model_parallel()
    from megatron_scalevec import vectors
    from megatron_scalevec.layers import fold_cache, fused
    from megatron_scalevec.layers.layer import layer_vectors

    moe_kw = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                  moe_grouped_gemm=True) if moe else {}
    config = M.tiny_config(**moe_kw)
    model = M.build_gpt(config, strategy)
    layer = model.decoder.layers[0]
    vecs = layer_vectors(layer)
    seen, stacks = [], []
    layer.mlp.register_forward_pre_hook(
        lambda *_: seen.append(sum(v._once is not None for v in vecs)))
    real = vectors.stacked
    vectors.stacked = lambda vs: stacks.append(len(vs)) or real(vs)
    try:
        ddp = M.wrap_ddp(model, config)
        with fused.reference() if reference else contextlib.nullcontext():
            M.train_steps(ddp, config, M.batches(4, 2), 1)
    finally:
        vectors.stacked = real
    released = all(v._once is None for v in vecs)
    return dict(n=len(vecs), seen=seen, released=released, stacks=stacks,
                cycles=fold_cache.completed_cycles(layer))


@pytest.mark.parametrize("strategy,moe,n", [("unified", False, 5), ("hg+dnp+er", False, 5),
                                            ("unified", True, 3 + 1 + 8)])
def test_layer_holds_its_vectors_for_its_forward(strategy, moe, n):
    """unified dense: a_q, a_k, a_v, a_g, a_u; MoE: a_q, a_k, a_v, the router's, each of 4
    experts' a_g, a_u. Held while the layer runs (4 micro-batches), released after, one
    cycle per step, alike vectors stacked (the three per-head ones together)."""
    r = run_on_ranks(_held, 1, strategy, moe, False)[0]
    assert r["n"] == n and r["released"], r
    assert r["seen"] == [n] * 4, r["seen"]
    assert r["cycles"] == 1, r
    assert 3 in r["stacks"], r["stacks"]


def test_reference_path_holds_nothing():
    r = run_on_ranks(_held, 1, "unified", False, True)[0]
    assert r["seen"] == [0] * 4 and r["cycles"] == 0, r


def _evaluations(rank, world, strategy, micro_batches):
    init_model_parallel()
    from megatron_scalevec import vectors

    config = M.tiny_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                           moe_grouped_gemm=True) if strategy == "unified/moe" else M.tiny_config()
    model = M.build_gpt(config, strategy.split("/")[0])
    ddp = M.wrap_ddp(model, config)
    calls = []
    real = vectors._gamma
    vectors._gamma = lambda v0, part: calls.append(v0) or real(v0, part)
    try:
        M.train_steps(ddp, config, M.batches(micro_batches, 2), 1)
    finally:
        vectors._gamma = real
    return len(calls)


@pytest.mark.parametrize("strategy", ["unified", "hg+dnp+er", "unified/moe"])
def test_vectors_are_evaluated_once_per_step(strategy):
    """The fold once per step evaluates its vectors in the first micro-batch and maps back
    through those same tensors in the last one: a 4-micro-batch step evaluates every vector
    (layer-held ones and the weight folds' inputs) as often as a 1-micro-batch step does."""
    once = run_on_ranks(_evaluations, 1, strategy, 1)[0]
    four = run_on_ranks(_evaluations, 1, strategy, 4)[0]
    assert once > 0 and four == once, (once, four)
