"""Every parameter we read is ready under megatron-core's overlapped parameter all-gather.

With the distributed optimizer and ``overlap_param_gather``, after an optimizer step each rank
holds only its own shard of the updated parameters; the rest arrive by an all-gather that DDP
waits for in a forward pre-hook of the module that owns the parameter. A scale vector read
without calling its module, or running its hooks (its parameters handed to a fused kernel
directly, a batched evaluation of several vectors), would use the previous step's values. Each
case trains the same model on DP=2 twice in one set of gloo ranks, with small buckets (many
all-gathers) and linear (SGD-like) updates, without and with the overlap (and with
``align_param_gather``): losses and the parameters after every step must agree bit for bit
(float32, same reduction order).
"""

import contextlib

import pytest

from megatron_scalevec import ScaleVecConfig
from scalevec_testing import init_model_parallel, run_on_ranks, te_stub
from scalevec_testing import models as M
from scalevec_testing.markers import needs_te

STEPS = 4
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
           moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2)
STRATEGIES = ("shared", "hg+dp", "hg+or", "hg+dp+er", "hg+dnp", "unified")
KINDS = {
    "dense": ({}, {}),
    "moe_sequential": (MOE, {}),
    "moe_sequential_shared_vectors": (MOE, dict(expert_vectors="shared")),
    "moe_grouped": (dict(MOE, moe_grouped_gemm=True), {}),
    "moe_grouped_shared_vectors": (dict(MOE, moe_grouped_gemm=True),
                                   dict(expert_vectors="shared")),
}
TE = dict(MOE, moe_grouped_gemm=True, transformer_impl="transformer_engine")
TE_KINDS = {  # TE's dense parts and grouped experts, through TE's own autograd functions
    "te_grouped": (TE, {}),
    "te_grouped_shared_vectors": (TE, dict(expert_vectors="shared")),
}
OVERLAPS = {
    "plain": {},
    "overlap": dict(overlap_param_gather=True, overlap_grad_reduce=True),
    "overlap_aligned": dict(overlap_param_gather=True, overlap_grad_reduce=True,
                            align_param_gather=True),
}


def _train(config, strategy, sv, ddp_options, claim):
    """``claim``: a context factory around building and each forward-backward (TE's stand-in
    claims CUDA there; the optimizer steps outside it)."""
    with claim():
        model = M.build_gpt(config, ScaleVecConfig.from_string(strategy, **sv))
        M.perturb_vectors(model)
        ddp = M.wrap_ddp(model, config, True, bucket_size=200, **ddp_options)
    opt = M.make_optimizer(ddp, True, lr=0.05, optimizer="sgd")
    data = M.batches(4, 2)
    losses, params = [], []
    for _ in range(STEPS):
        losses += M.train_steps(ddp, config, data, 1, opt, forward_context=claim)
        M.sync_params(ddp)  # only to read them here: training itself relies on the hooks
        params.append({k: p.detach().clone() for k, p in model.named_parameters()})
    config.param_sync_func = None
    return losses, params


def _case(rank, world, kind):
    te = kind in TE_KINDS
    if te:
        te_stub.activate()
    init_model_parallel()
    overrides, sv = {**KINDS, **TE_KINDS}[kind]
    config = M.tiny_config(**overrides)
    out = {}
    claim = te_stub.cuda_claimed if te else contextlib.nullcontext
    for strategy in STRATEGIES:
        runs = {name: _train(config, strategy, sv, opts, claim)
                for name, opts in OVERLAPS.items()}
        ref_losses, ref_params = runs["plain"]
        for name, (losses, params) in runs.items():
            bad = [f"loss {losses} vs {ref_losses}"] if losses != ref_losses else []
            for step, (got, want) in enumerate(zip(params, ref_params)):
                bad += [f"step {step + 1} {b}" for b in
                        M.relative_mismatches(want, got, rtol=0.0, tiny=0.0)]
            out[(strategy, name)] = bad
        out[(strategy, "trained")] = ref_losses[-1] < ref_losses[0]
    return out


@pytest.mark.parametrize("kind", list(KINDS) + [
    pytest.param(k, marks=needs_te) for k in TE_KINDS])
def test_overlapped_param_gather_is_exact(kind):
    for res in run_on_ranks(_case, 2, kind, timeout=600):
        failed = {k: v[:3] for k, v in res.items() if k[1] != "trained" and v}
        assert not failed, f"{kind}: " + "\n".join(f"{k}: {v}" for k, v in failed.items())
        assert all(v for k, v in res.items() if k[1] == "trained"), res
