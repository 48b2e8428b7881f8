"""Grouped-GEMM experts (layers/grouped.py) against ScaleVecSequentialMLP: same parameters and
checkpoint keys, same outputs, loss and every gradient (relative to each tensor's scale), in
one process for every strategy and at EP2, expert TP2 and with the alltoall dispatcher.

Layout runs reuse the harness of tests/layers/test_moe.py: the sequential model at one process
is the reference (weights with perturbed vectors saved through dist_checkpointing); the grouped
model loads that checkpoint at each layout, so checkpoint interchange is exercised by every
layout test. The MoE
config, layouts and checkpoint rank functions are shared with the TE grouped tests
(scalevec_testing/experts.py).
"""

import pytest
import torch

from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.experts import (
    EXPERT_LAYOUTS,
    EXPERTS,
    moe_config,
    rel_diffs,
    save_or_load,
    strategy_config,
)

REL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(a.float().abs().max()), 1e-30)


# ---------------------------------------------------------------- one process
def _one_process(rank, world, cases, dtype_name="float32", shared_ffn=None, **overrides):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_scalevec.layers.grouped import ScaleVecGroupedMLP

    init_model_parallel()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    dtype = getattr(torch, dtype_name)
    batch = M.batches(1, 2)[0]
    out = {}
    for strategy, expert_vectors in cases:
        cfg = strategy_config(strategy, expert_vectors)
        results = []
        for grouped in (False, True):
            config = moe_config(grouped, moe_layer_freq=1, params_dtype=dtype,
                                moe_shared_expert_intermediate_size=shared_ffn, **overrides)
            model = M.build_gpt(config, cfg).to(dtype)
            experts = model.decoder.layers[0].mlp.experts
            assert isinstance(experts, ScaleVecGroupedMLP) == grouped, type(experts)
            M.perturb_vectors(model)
            model.zero_grad()
            logits = model(batch["tokens"], batch["position_ids"], None)
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
            results.append((model.state_dict(), logits.detach(), float(loss), grads))
        (sd_s, y_s, l_s, g_s), (sd_g, y_g, l_g, g_g) = results
        assert set(sd_s) == set(sd_g), sorted(set(sd_s) ^ set(sd_g))[:5]
        assert all(torch.equal(sd_s[k], sd_g[k]) for k in sd_s if torch.is_tensor(sd_s[k]))
        assert set(g_s) == set(g_g), sorted(set(g_s) ^ set(g_g))[:5]
        rel = M.relative_differences(g_s, g_g)
        worst = max(rel, key=rel.get)
        n_expert_vec = sum(1 for n in g_s if ".experts." in n and
                           ("scale_" in n or "_norm" in n))
        out[(strategy, expert_vectors)] = dict(
            out=_rel(y_s, y_g), loss=abs(l_s - l_g) / abs(l_s), grad=rel[worst],
            worst=worst, n_grads=len(g_s), n_expert_vec=n_expert_vec)
    return out


CASES = [("unified", "per_expert"), ("hg+dp+er", "per_expert"), ("hg+dnp", "per_expert"),
         ("hg+dp", "per_expert"), ("shared", "per_expert"), ("none", "per_expert"),
         ("unified", "shared"), ("hg+dp+er", "shared")]


def test_grouped_equals_sequential_every_strategy():
    res = run_on_ranks(_one_process, 1, CASES, shared_ffn=40)[0]
    for case, r in res.items():
        assert r["out"] < REL and r["loss"] < REL, (case, r)
        assert r["grad"] < 1e-4, (case, r)  # relative to each tensor's max
        assert r["n_grads"] >= 20, (case, r)
    assert res[("unified", "per_expert")]["n_expert_vec"] >= 4 * EXPERTS
    assert res[("shared", "per_expert")]["n_expert_vec"] == 0


def test_grouped_equals_sequential_bf16_and_layernorm():
    res = run_on_ranks(_one_process, 1, [("unified", "per_expert")], "bfloat16")[0]
    r = res[("unified", "per_expert")]
    assert r["out"] < 2e-2 and r["loss"] < 1e-2, r  # bf16 rounding of two GEMM orders
    res = run_on_ranks(_one_process, 1, [("hg+dnp+or", "per_expert")],
                       normalization="LayerNorm")[0]
    r = res[("hg+dnp+or", "per_expert")]
    assert r["out"] < REL and r["grad"] < 1e-4, r


# ---------------------------------------------------------------- layouts
def _case(rank, world, grouped, *, tp=1, ep=1, etp=None, sp=False, dispatcher="allgather",
          ref_dir=None, load_dir=None, out_dir=None):
    init_model_parallel(tp=tp, ep=ep, etp=etp)
    config = moe_config(grouped, sequence_parallel=sp, moe_token_dispatcher_type=dispatcher)
    return M.run_case(config, strategy_config("unified"), ref_dir=ref_dir, load_dir=load_dir,
                      out_dir=out_dir, check=lambda m: _check_experts(m, grouped))


def _check_experts(model, grouped):
    from megatron_scalevec.layers.grouped import ScaleVecGroupedMLP

    kinds = {isinstance(m, ScaleVecGroupedMLP) for n, m in model.named_modules()
             if n.endswith("mlp.experts")}
    assert kinds == {grouped}, kinds


@pytest.fixture(scope="module")
def sequential_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("grouped_ref")
    ref, grads = str(root / "weights"), str(root / "grads")
    losses = run_on_ranks(_case, 1, False, ref_dir=ref, out_dir=grads)[0]["losses"]
    return ref, grads, losses


@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_grouped_matches_sequential_across_layouts(sequential_reference, tmp_path, layout):
    ref, ref_grads, ref_losses = sequential_reference
    opts = dict(EXPERT_LAYOUTS[layout])
    world = opts.pop("world")
    out = str(tmp_path / "grads")
    losses = [r["losses"] for r in run_on_ranks(_case, world, True, load_dir=ref, out_dir=out,
                                                **opts)]
    assert abs(losses[0][0] - ref_losses[0]) < REL * abs(ref_losses[0]), (losses, ref_losses)
    diffs = run_on_ranks(rel_diffs, 1, ref_grads, out)[0]
    worst = max(diffs, key=diffs.get)
    assert any(".experts.experts.linear_fc1.scale_in" in k for k in diffs)
    assert any(".experts.experts.gate_norm" in k for k in diffs)
    assert diffs[worst] < 1e-4, f"{layout}: grad of {worst} differs by {diffs[worst]:.2e} (rel)"


# ---------------------------------------------------------------- checkpoint interchange
@pytest.mark.parametrize("save_grouped", [True, False], ids=["grouped_to_seq", "seq_to_grouped"])
def test_checkpoint_moves_between_grouped_and_sequential(tmp_path, save_grouped):
    saved = str(tmp_path / "ckpt")
    kinds = ("grouped", "sequential") if save_grouped else ("sequential", "grouped")
    at_ep2 = run_on_ranks(save_or_load, 2, kinds[0], ep=2, save_dir=saved)
    at_ep1 = run_on_ranks(save_or_load, 1, kinds[1], ep=1, load_dir=saved)[0]
    assert at_ep1 == pytest.approx(at_ep2[0], rel=1e-6)


# ---------------------------------------------------------------- guards and helpers
def test_grouped_spec_and_guards():
    from megatron_scalevec.layers.grouped import ScaleVecGroupedMLP, grouped_mm_available
    from megatron_scalevec.specs import moe_spec

    assert grouped_mm_available()
    spec = moe_spec(strategy_config("unified"), num_experts=4, grouped_gemm=True)
    assert spec.submodules.experts.module is ScaleVecGroupedMLP
    with pytest.raises(ValueError, match="num_experts"):
        moe_spec(strategy_config("unified"), num_experts=0)


def test_probs_on_input_one_rule_for_local_and_te_grouped_experts():
    """``moe_apply_probs_on_input`` (layers/grouped.py ``probs_on_input``, used by local and TE
    grouped experts): top-1 only; the probabilities, [T] (local) or [T, 1] (TE grouped), scale
    the input rows and become ones."""
    from types import SimpleNamespace

    from megatron_scalevec.layers.grouped import probs_on_input

    x, probs = torch.randn(5, 8), torch.rand(5)
    off = SimpleNamespace(moe_apply_probs_on_input=False, moe_router_topk=2)
    same_x, same_probs = probs_on_input(off, x, probs)
    assert same_x is x and same_probs is probs
    with pytest.raises(ValueError, match="only works with moe_router_topk=1"):
        probs_on_input(SimpleNamespace(moe_apply_probs_on_input=True, moe_router_topk=2),
                       x, probs)
    on = SimpleNamespace(moe_apply_probs_on_input=True, moe_router_topk=1)
    for p in (probs, probs[:, None]):
        scaled, ones = probs_on_input(on, x, p)
        torch.testing.assert_close(scaled, x * probs[:, None], rtol=0, atol=0)
        assert ones.shape == p.shape and bool((ones == 1).all())


def _misaligned(rank, world):
    init_model_parallel()
    with pytest.raises(ValueError, match="multiples of 4"):
        M.build_gpt(moe_config(True, moe_ffn_hidden_size=22), strategy_config("unified"))
    return True


def test_grouped_refuses_misaligned_widths():
    assert run_on_ranks(_misaligned, 1)[0]


def _moe_act(rank, world):
    init_model_parallel()
    with pytest.raises(NotImplementedError, match="do not recompute 'moe_act'"):
        M.build_gpt(moe_config(True, recompute_granularity="selective",
                               recompute_modules=["moe_act"]), strategy_config("unified"))
    M.build_gpt(moe_config(True, recompute_granularity="selective",  # recomputed whole
                           recompute_modules=["moe"]), strategy_config("unified"))
    return True


def test_grouped_refuses_moe_act_recompute_it_would_ignore():
    assert run_on_ranks(_moe_act, 1)[0]


def test_grouped_linear_matches_per_group_matmul_with_empty_group():
    from megatron_scalevec.layers.grouped import grouped_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 4, 8, generator=g, requires_grad=True)
    counts = [3, 0, 7]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_linear(x, w, offs)
    ref = torch.cat([xi @ wi.T for xi, wi in zip(torch.split(x, counts), w.unbind(0))])
    assert torch.allclose(y, ref, atol=1e-6)
    y.sum().backward()  # expanded gradient: made contiguous before grouped_mm's backward
    assert w.grad[1].abs().max() == 0 and x.grad.shape == x.shape


def _kept(rank, world):
    from benchmarks.ledger import kept_bytes  # noqa: PLC0415

    init_model_parallel()
    batch = M.batches(1, 2)[0]
    out = {}
    for strategy in ("shared", "hg+dp", "unified"):
        for grouped in (False, True):
            model = M.build_gpt(moe_config(grouped, moe_layer_freq=1), strategy_config(
                strategy, "per_expert"))
            out[strategy, grouped] = kept_bytes(
                lambda m=model: m(batch["tokens"], batch["position_ids"], None))
            out["experts"] = sum(p.numel() * p.element_size() for n, p in
                                 model.named_parameters() if ".experts." in n)
    return out


def test_grouped_experts_keep_no_stacked_weights():
    """grouped_mm saves the [E, out, in] weight it multiplies: the stacked (and folded) expert
    weights are released after each GEMM and rebuilt before its backward, so a forward keeps
    what megatron-core's sequential experts keep (which multiply each weight itself), not a
    copy of every expert's fc1 and fc2 per micro-batch."""
    kept = run_on_ranks(_kept, 1)[0]
    for strategy in ("shared", "hg+dp", "unified"):
        extra = kept[strategy, True] - kept[strategy, False]
        assert extra < kept["experts"] / 4, (strategy, extra, kept)
