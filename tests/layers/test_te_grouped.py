"""Every strategy on Transformer Engine grouped experts (layers/te_grouped.py), run through TE's
own autograd functions on CPU (scalevec_testing/te_stub.py, te_ops.py: the grouped GEMM, GEMM and
norm kernels in torch, fp32), against our sequential experts: same loss and every gradient
(relative to each tensor's scale), in one process for every strategy, per-expert and shared
expert vectors, and at EP2, expert TP2 + SP and with the alltoall dispatcher; checkpoints move
between TE grouped, local grouped and sequential experts.
"""

import os
import re

import pytest
import torch

from scalevec_testing import init_model_parallel, run_on_ranks, te_ops, te_stub
from scalevec_testing import models as M
from scalevec_testing.experts import (
    EXPERT_LAYOUTS,
    EXPERTS,
    rel_diffs,
    save_or_load,
    strategy_config,
    te_moe_config,
)
from scalevec_testing.markers import needs_te
from scalevec_testing.te_compare import compare_with_local, start_te

REL = 1e-5


def _te_experts(model) -> int:
    """How many MoE layers run our TE grouped experts (each must)."""
    from megatron_scalevec.layers.te_classes import ScaleVecTEGroupedMLP as cls
    kinds = [isinstance(m, cls) for n, m in model.named_modules() if n.endswith("mlp.experts")]
    assert kinds and all(kinds), kinds
    return len(kinds)


# ---------------------------------------------------------------- one process, every strategy
def _every_strategy(rank, world, cases, tmp, te_overrides=None, **overrides):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    start_te()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    batch = M.batches(1, 2)[0]
    out = {}
    for strategy, expert_vectors in cases:
        cfg = strategy_config(strategy, expert_vectors)
        local = M.build_gpt(te_moe_config(False, False, **overrides), cfg)
        M.perturb_vectors(local)
        where = os.path.join(tmp, f"{strategy}-{expert_vectors}")
        M.save_model(local, where)
        with te_stub.cuda_claimed():
            model = M.build_gpt(te_moe_config(True, True, **{**overrides, **(te_overrides or {})}),
                                cfg)
        _te_experts(model)
        M.load_model(model, where, te_extra_state=True)
        te_ops.CALLS.clear()
        r = compare_with_local(local, model, batch)
        worst = max(r["rel"], key=r["rel"].get)
        expert_vec = [n for n in r["names"] if ".experts." in n and ("scale_" in n or "_norm" in n)]
        out[(strategy, expert_vectors)] = dict(
            loss=r["dloss"] / r["loss"], grad=r["rel"][worst], worst=worst,
            only_one=r["only_one"], n_grads=len(r["names"]), expert_vec=len(expert_vec),
            grouped_gemms=te_ops.CALLS.get("te_general_grouped_gemm", 0),
            recomputed=[getattr(m, "activation_checkpoint", None) is not None
                        for n, m in model.named_modules() if n.endswith("mlp.experts")])
    return out


CASES = [("unified", "per_expert"), ("hg+dnp", "per_expert"), ("hg+dnp+or", "per_expert"),
         ("hg+dp+er", "per_expert"), ("hg+dp", "per_expert"), ("hg+or", "per_expert"),
         ("hg", "per_expert"), ("shared", "per_expert"), ("none", "per_expert"),
         ("unified", "shared"), ("hg+dp+er", "shared"), ("hg+dnp", "shared")]


@needs_te
def test_te_grouped_equals_sequential_every_strategy(tmp_path):
    res = run_on_ranks(_every_strategy, 1, CASES, str(tmp_path),
                       moe_shared_expert_intermediate_size=40)[0]
    for case, r in res.items():
        assert not r["only_one"], (case, r["only_one"][:5])
        assert r["loss"] < REL and r["grad"] < 1e-4, (case, r)
        assert r["n_grads"] >= 15 and r["grouped_gemms"] >= 4, (case, r)  # TE grouped GEMMs ran
    # gamma_g, gamma_u, a_g, a_u, each an OR direction and magnitude: per expert, or once
    assert res[("unified", "per_expert")]["expert_vec"] == 8 * EXPERTS
    assert res[("unified", "shared")]["expert_vec"] == 8
    assert res[("shared", "per_expert")]["expert_vec"] == 0


@needs_te
def test_te_grouped_layernorm_recompute_and_probs_on_input(tmp_path):
    """LayerNorm statistics; megatron-core's ``moe_act`` recompute around the DNP GLU norm;
    top-1 routing with the probabilities applied to the input."""
    recompute = dict(recompute_granularity="selective", recompute_modules=["moe_act"])
    res = run_on_ranks(_every_strategy, 1, [("hg+dnp+or", "per_expert")], str(tmp_path),
                       recompute, normalization="LayerNorm")[0]
    r = res[("hg+dnp+or", "per_expert")]
    assert r["loss"] < REL and r["grad"] < 1e-4 and not r["only_one"], r
    assert r["recomputed"] == [True], r  # the GLU norm ran under CheckpointWithoutOutput
    res = run_on_ranks(_every_strategy, 1, [("unified", "per_expert")], str(tmp_path),
                       moe_router_topk=1, moe_router_pre_softmax=True,
                       moe_apply_probs_on_input=True)[0]
    r = res[("unified", "per_expert")]
    assert r["loss"] < REL and r["grad"] < 1e-4 and not r["only_one"], r


# ---------------------------------------------------------------- memory
def _saved_bytes(rank, world):
    from benchmarks.overhead import kept_bytes, saved_activation_bytes

    start_te()
    out = {}
    x, probs = torch.randn(40, 32), torch.rand(40)
    tokens_per_expert = torch.tensor([10, 6, 14, 10])
    for strategy in ("shared", "hg+dp", "unified"):
        with te_stub.cuda_claimed():
            model = M.build_gpt(te_moe_config(True, True, moe_layer_freq=1, moe_ffn_hidden_size=64),
                                strategy_config(strategy))
            experts = model.decoder.layers[0].mlp.experts
            out[strategy] = saved_activation_bytes(
                lambda e=experts: e(x, tokens_per_expert, probs))
            out["kept " + strategy] = kept_bytes(lambda e=experts: e(x, tokens_per_expert, probs))
    return out


@needs_te
def test_te_grouped_dnp_keeps_no_more_than_the_stock_glu():
    """Bytes autograd saves in the experts' forward (40 rows, hidden 32, FFN 64, 4 experts).
    The DNP GLU norm keeps fc1's output and two statistics per row: no more than megatron-core's
    GLU under the same fold (hg+dp). The fold itself: TE saves the folded fc1 weights it
    multiplied, for its dgrad (4 x 128 x 32 fp32 = 64 KiB here), but what is *kept* after the
    forward excludes them: their storage is released until TE's backward (layers/fold.py), so
    every strategy keeps no more than ``shared`` plus the small vectors."""
    saved = run_on_ranks(_saved_bytes, 1)[0]
    assert saved["unified"] <= saved["hg+dp"], saved
    folded = 4 * 128 * 32 * 4
    assert folded <= saved["hg+dp"] - saved["shared"] <= folded + 8192, saved
    for strategy in ("hg+dp", "unified"):
        assert saved["kept " + strategy] <= saved["kept shared"] + 8192, saved
        assert saved["kept " + strategy] <= saved[strategy] - folded, saved


# ---------------------------------------------------------------- layouts
def _layout(rank, world, te, strategy, expert_vectors, *, tp=1, ep=1, etp=None, sp=False,
            dispatcher="allgather", ref_dir=None, load_dir=None, out_dir=None):
    if te:
        te_stub.activate()
    init_model_parallel(tp=tp, ep=ep, etp=etp)
    config = te_moe_config(te, te, sequence_parallel=sp, moe_token_dispatcher_type=dispatcher)
    cfg = strategy_config(strategy, expert_vectors)
    if not te:  # the reference: sequential experts, one process
        return M.run_case(config, cfg, ref_dir=ref_dir, out_dir=out_dir)["losses"]
    with te_stub.cuda_claimed():
        model = M.build_gpt(config, cfg)
        _te_experts(model)
        M.load_model(model, load_dir, te_extra_state=True)
        ddp = M.wrap_ddp(model, config)
        losses = M.train_steps(ddp, config, M.batches(4, 2), 1)
        M.save_grads(model, out_dir)
    return losses


LAYOUTS = {**EXPERT_LAYOUTS, "tp2_sp_ep2_etp1": dict(world=2, tp=2, sp=True, ep=2, etp=1)}
RUNS = [("unified", "per_expert", k) for k in LAYOUTS] + \
    [("unified", "shared", k) for k in ("ep2", "tp2_sp_etp2", "tp2_sp_ep2_etp1")]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The sequential model's weights and gradients at one process, per expert-vector kind."""
    root, refs = tmp_path_factory.mktemp("te_grouped_ref"), {}
    for kind in ("per_expert", "shared"):
        ref, grads = str(root / kind / "weights"), str(root / kind / "grads")
        losses = run_on_ranks(_layout, 1, False, "unified", kind, ref_dir=ref,
                              out_dir=grads)[0]
        refs[kind] = ref, grads, losses
    return refs


@needs_te
@pytest.mark.parametrize("strategy,expert_vectors,layout", RUNS)
def test_te_grouped_matches_sequential_across_layouts(references, tmp_path, strategy,
                                                      expert_vectors, layout):
    ref, ref_grads, ref_losses = references[expert_vectors]
    opts = dict(LAYOUTS[layout])
    world = opts.pop("world")
    out = str(tmp_path / "grads")
    losses = run_on_ranks(_layout, world, True, strategy, expert_vectors, load_dir=ref,
                          out_dir=out, **opts)
    assert abs(losses[0][0] - ref_losses[0]) < REL * abs(ref_losses[0]), (losses, ref_losses)
    diffs = run_on_ranks(rel_diffs, 1, ref_grads, out)[0]
    worst = max(diffs, key=diffs.get)
    vec = "shared_vectors" if expert_vectors == "shared" else "experts.experts"
    assert any(re.search(rf"{vec}\.(linear_fc1\.)?scale_in", k) for k in diffs), sorted(diffs)
    assert any(re.search(rf"{vec}\.gate_norm", k) for k in diffs), sorted(diffs)
    assert diffs[worst] < 1e-4, f"{layout}: grad of {worst} differs by {diffs[worst]:.2e} (rel)"


@needs_te
@pytest.mark.parametrize("grouped", [True, False], ids=["te_grouped", "te_sequential"])
def test_te_shared_expert_vectors_are_owned_once_and_lent(grouped):
    """As tests/test_moe.py for local experts: one owner per MoE layer, each expert's fc1
    vectors (inside the grouped linear, or a TE column linear) and norms lent it, nothing
    registered twice."""
    from scalevec_testing.experts import vector_ownership

    shared = run_on_ranks(vector_ownership, 1, True, grouped, "unified", "shared")[0]
    assert shared["params_once"] and shared["modules_once"], shared
    assert (shared["owners"], shared["users"], shared["elsewhere"]) == (1, 2 * EXPERTS, 0)
    assert shared["in_owner"] and not shared["outside_owner"], shared
    own = run_on_ranks(vector_ownership, 1, True, grouped, "unified", "per_expert")[0]
    assert own["params_once"] and (own["owners"], own["users"]) == (0, 0), own
    assert len(own["outside_owner"]) == EXPERTS * len(shared["in_owner"]), own


# ---------------------------------------------------------------- checkpoint interchange
MOVES = [("te", "sequential", "per_expert"), ("te", "grouped", "per_expert"),
         ("sequential", "te", "per_expert"), ("grouped", "te", "per_expert"),
         ("te", "sequential", "shared"), ("grouped", "te", "shared")]


@needs_te
@pytest.mark.parametrize("saved,loaded,expert_vectors", MOVES)
def test_checkpoint_moves_between_te_grouped_and_other_experts(tmp_path, saved, loaded,
                                                               expert_vectors):
    where = str(tmp_path / "ckpt")
    at_ep2 = run_on_ranks(save_or_load, 2, saved, expert_vectors, ep=2, save_dir=where)
    at_ep1 = run_on_ranks(save_or_load, 1, loaded, expert_vectors, ep=1, load_dir=where)[0]
    assert at_ep1 == pytest.approx(at_ep2[0], rel=1e-6)


# ---------------------------------------------------------------- refusals
def _refused(rank, world, overrides):
    start_te()
    try:
        with te_stub.cuda_claimed():
            M.build_gpt(te_moe_config(True, True, **overrides), strategy_config("unified"))
    except (NotImplementedError, ValueError) as err:
        return str(err)
    return None


@needs_te
@pytest.mark.parametrize("overrides,names", [
    (dict(activation_func_clamp_value=7.0), "config.activation_func_clamp_value"),
    (dict(glu_linear_offset=1.0), "config.glu_linear_offset"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]),
     "config.offload_modules"),
])
def test_te_grouped_refusals_are_one_line(overrides, names):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not all(hasattr(TransformerConfig, k) or k in TransformerConfig.__dataclass_fields__
               for k in overrides):
        pytest.skip("not a field of this megatron-core")
    msg = run_on_ranks(_refused, 1, overrides)[0]
    assert msg and names in msg and "\n" not in msg, msg


def _conservation(rank, world):
    from megatron_scalevec.layers.te_grouped import ExpertFc1Vectors
    from megatron_scalevec.training.monitor import scale_vector_stats

    te_stub.activate()
    init_model_parallel(tp=2, ep=2, etp=1)
    config = te_moe_config(True, True, sequence_parallel=True)
    with te_stub.cuda_claimed():
        model = M.build_gpt(config, strategy_config("hg"))
        _te_experts(model)
        M.perturb_vectors(model)
        stats = scale_vector_stats([model])
        out = {}
        for name, owner in model.named_modules():
            if not isinstance(owner, ExpertFc1Vectors):
                continue
            w = owner.weight.detach().float().view(owner.groups, len(owner.slots), owner.rows, -1)
            for branch, vec in owner.scale_in.items():  # etp 1: the expert's whole fc1 here
                rows = w[:, [i for i, s in enumerate(owner.slots) if s == branch]]
                sq = rows.pow(2).reshape(-1, rows.shape[-1]).sum(0)
                key = f"sv/{name}.scale_in.{branch}/conservation"
                out[key] = (stats.get(key), float((vec().float().pow(2) - sq).mean()))
    return out


@needs_te
def test_expert_conservation_sums_over_the_expert_tp_group():
    """TP2 + EP2 with expert TP 1: each expert's fc1 is whole on its rank, so the logged
    conservation reads it alone (not summed with the other rank's experts over dense TP)."""
    for out in run_on_ranks(_conservation, 2):
        assert len(out) >= 2, out
        bad = {k: v for k, v in out.items() if v[0] is None or abs(v[0] - v[1]) > 1e-5 * max(
            1.0, abs(v[1]))}
        assert not bad, bad
