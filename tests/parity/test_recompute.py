"""Activation recompute (megatron-core's full and selective) gives the same loss and gradients
as no recompute, for every strategy family: the fused DNP functions and the folded linears are
plain autograd functions that a recompute re-runs."""

import pytest

from megatron_scalevec import ScaleVecConfig
from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
           moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2)
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective",
                      recompute_modules=["core_attn", "layernorm", "mlp"]),
    "selective_moe": dict(recompute_granularity="selective",
                          recompute_modules=["core_attn", "layernorm", "moe"]),
}


def _run(rank, world, moe, grouped, strategy):
    from megatron_scalevec.layers import fused

    init_model_parallel()
    calls = []
    qkv_norm = fused.qkv_norm
    fused.qkv_norm = lambda *a, **k: calls.append(1) or qkv_norm(*a, **k)  # this rank only
    out, counts = {}, {}
    kinds = ["none", "full", "selective_moe" if moe else "selective"]
    for kind in kinds:
        extra = dict(MOE, moe_grouped_gemm=grouped) if moe else {}
        config = M.tiny_config(**extra, **RECOMPUTE[kind])
        model = M.build_gpt(config, ScaleVecConfig.from_string(strategy))
        M.perturb_vectors(model)
        b = M.batches(1, 2)[0]
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean()
        loss.backward()
        counts[kind] = len(calls)
        calls.clear()
        out[kind] = (float(loss), {n: p.grad.detach().clone()
                                   for n, p in model.named_parameters() if p.grad is not None})
    ref_loss, ref = out.pop("none")
    bad = []
    for kind, (loss, grads) in out.items():
        if abs(loss - ref_loss) > 1e-6 * abs(ref_loss):
            bad.append(f"{kind}: loss {loss} vs {ref_loss}")
        bad += [f"{kind}: {m}" for m in M.relative_mismatches(ref, grads, rtol=1e-5)]
    return bad, len(ref), counts


@pytest.mark.parametrize("moe,grouped,strategy", [
    (False, False, "unified"), (False, False, "hg+dp+er"), (False, False, "shared"),
    (True, False, "unified"), (True, True, "unified"),
])
def test_recompute_gives_the_same_loss_and_gradients(moe, grouped, strategy):
    bad, n, counts = run_on_ranks(_run, 1, moe, grouped, strategy)[0]
    assert n > 10 and not bad, "\n".join(bad[:10])
    if strategy == "unified":  # the fused QKV norm ran again in backward: recompute happened
        assert counts["none"] == 2 and counts["full"] == 4, counts
