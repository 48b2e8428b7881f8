"""Under Transformer Engine's FP8 the fold runs only where TE reads the folded weight: where it
quantizes it (the step's first micro-batch through megatron-core's schedule), never for an FP8
backward, which reads only FP8 copies (layers/te.py ``te_reads_weight``, layers/fold.py
``FoldedWeights.plan``). Checked through TE's own Python over the CPU stand-in, in forked ranks:
the folds counted per step against bf16, the results equal to folding on every micro-batch and
before every backward, and the rule itself against TE's caching cases."""

import pytest
import torch

from scalevec_testing import init_model_parallel, run_on_ranks, te_stub
from scalevec_testing import models as M
from scalevec_testing.markers import needs_te

pytestmark = needs_te

BASE = dict(transformer_impl="transformer_engine", hidden_size=64, ffn_hidden_size=128)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.0,
           moe_grouped_gemm=True)


def _counting_folds(model) -> tuple:
    """(counts, folded TE modules): ``counts["fold"]`` grows by one per pass folding a folded
    TE module's weights (refolds included), ``counts["refold"]`` per refold before a
    backward."""
    from megatron_scalevec.layers import fold

    te = [m for m in model.modules() if getattr(m, "has_scale_vectors", False)
          and hasattr(m, "_fp8_workspaces")]
    ptrs = {p.data_ptr() for m in te for n, p in m.named_parameters(recurse=False)
            if n.startswith("weight")}
    counts = {"fold": 0, "refold": 0}
    real, held = fold.fold, fold._Held.refold

    def counted(weights, *args, **kwargs):
        counts["fold"] += weights[0].data_ptr() in ptrs
        return real(weights, *args, **kwargs)

    def refold(self):
        counts["refold"] += 1
        return held(self)

    fold.fold, fold._Held.refold = counted, refold
    return counts, len(te)


def _train(rank, world, recipe, grouped, always_fold=False):
    te_stub.activate()
    init_model_parallel()
    from megatron_scalevec.layers import te, te_grouped

    if always_fold:  # the path before: folded on every micro-batch, refolded before backward
        te.te_reads_weight = te_grouped.te_reads_weight = lambda *a: (True, True)
    fp8 = dict(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=4,
               fp8_amax_compute_algo="max") if recipe else {}
    config = M.tiny_config(**BASE, **fp8, **(MOE if grouped else {}))
    with te_stub.cuda_claimed():
        model = M.build_gpt(config, "unified")
    M.perturb_vectors(model)
    M.te_fused_wgrad_accumulation(model)
    counts, modules = _counting_folds(model)
    ddp = M.wrap_ddp(model, config)
    opt = M.make_optimizer(ddp, lr=0.1, optimizer="sgd")
    steps, data = [], M.batches(3, 2)
    for _ in range(2):
        before = dict(counts)
        loss = M.train_steps(ddp, config, data, 1, opt, forward_context=te_stub.cuda_claimed)[0]
        steps.append((loss, *(counts[k] - before[k] for k in ("fold", "refold"))))
    return dict(steps=steps, modules=modules,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "te_grouped"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_folds_once_a_step_and_equals_folding_every_micro_batch(recipe, grouped):
    """Two SGD steps of 3 micro-batches through megatron-core's schedule, TE's fused wgrad
    accumulation on: under FP8 each folded TE module folds once a step (the first micro-batch,
    where TE quantizes) and never refolds; in bf16 it folds and refolds on every micro-batch
    (6 a step). The losses and the parameters after both steps are bit for bit those of the
    same FP8 run folding on every micro-batch and before every backward."""
    fp8 = run_on_ranks(_train, 1, recipe, grouped)[0]
    bf16 = run_on_ranks(_train, 1, None, grouped)[0]
    n = fp8["modules"]
    assert n == 4 and bf16["modules"] == n, (fp8["modules"], bf16["modules"])
    assert [s[1:] for s in fp8["steps"]] == [(n, 0)] * 2, fp8["steps"]
    assert [s[1:] for s in bf16["steps"]] == [(6 * n, 3 * n)] * 2, bf16["steps"]
    every = run_on_ranks(_train, 1, recipe, grouped, True)[0]
    assert [s[0] for s in every["steps"]] == [s[0] for s in fp8["steps"]]
    assert all(torch.equal(every["params"][k], v) for k, v in fp8["params"].items())


def _rule(rank, world):
    """te_reads_weight on a real folded TE linear, through TE's caching cases."""
    te_stub.activate()
    init_model_parallel()
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
    from transformer_engine.pytorch.quantization import autocast

    from megatron_scalevec.layers.te import te_reads_weight

    config = M.tiny_config(**BASE, fp8="hybrid", fp8_recipe="delayed")
    with te_stub.cuda_claimed():
        model = M.build_gpt(config, "unified")
    lin = model.decoder.layers[0].self_attention.linear_qkv
    x = torch.randn(32, 1, 64, requires_grad=True)
    out = {"no_fp8": te_reads_weight(lin, x, ("weight",))}
    with te_stub.cuda_claimed(), autocast(recipe=DelayedScaling()):
        lin.is_first_microbatch = True
        out["first"] = te_reads_weight(lin, x, ("weight",))
        lin(x)[0].sum().backward()  # caches the FP8 weight, transpose included
        out["cached"] = te_reads_weight(lin, x, ("weight",))
        lin.disable_parameter_transpose_cache = True
        out["no_cache"] = te_reads_weight(lin, x, ("weight",))
        lin.disable_parameter_transpose_cache = False
        ws = lin._fp8_workspaces["weight"]
        ws._transpose = None
        out["no_transpose"] = te_reads_weight(lin, x, ("weight",))
        with torch.no_grad():
            out["no_transpose_no_grad"] = te_reads_weight(lin, x, ("weight",))
        if hasattr(Float8CurrentScaling(), "backward_override"):  # TE >= 2.17
            hp = Float8CurrentScaling(backward_override="high_precision")
            with autocast(recipe=hp):  # (the rule reads the recipe before the workspace)
                out["high_precision"] = te_reads_weight(lin, x, ("weight",))
        del lin._fp8_workspaces["weight"]
        out["not_cached"] = te_reads_weight(lin, x, ("weight",))
    return out


def test_te_reads_weight_follows_tes_caching():
    """Read (so folded) without FP8, on a step's first micro-batch, without megatron-core's
    transpose cache, with no workspace cached, and with one cached without the transpose a
    Hopper backward needs; not read from a valid cached workspace, nor from a transpose-less
    one in a no-grad forward of a LayerNormLinear (TE only needs row-wise data there). The FP8
    backward never reads it, except under TE 2.17's high-precision override (both read it)."""
    r = run_on_ranks(_rule, 1)[0]
    assert r.pop("no_fp8") == (True, True)
    # TE 2.17's high-precision backward multiplies the saved weight: folded, kept for backward
    assert r.pop("high_precision", (True, True)) == (True, True), r
    want = dict(first=True, cached=False, no_cache=True, no_transpose=True,
                no_transpose_no_grad=False, not_cached=True)
    assert {k: v[0] for k, v in r.items()} == want, r
    assert not any(v[1] for v in r.values()), r
