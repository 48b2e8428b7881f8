"""MoE with scale vectors: parity with megatron-core's MoE layer, layout invariance (EP, ETP,
TP+SP, PP with mixed dense/MoE layers, distributed optimizer), checkpoint resharding across
EP, per-expert and shared expert vectors (router options and the parameter count:
tests/layers/test_moe_options.py).

Layout runs reuse the harness of tests/parity/test_layouts.py: reference weights (vectors
perturbed away from 1) are saved once at one process, loaded at each layout through
dist_checkpointing, and the gradients (after megatron-core's DDP and finalize_model_grads) saved
and read back as full tensors, so expert tensors are compared at their global expert ids.
"""

import pytest
import torch

from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.experts import EXPERTS, build_stock_moe, moe_config, strategy_config

LOSS_TOL = 2e-5
RTOL = 1e-4  # relative to each tensor's own scale (M.relative_mismatches)


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss = out.float().mean()
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}


# ---------------------------------------------------------------- parity with megatron-core
def _parity(rank, world, strategies, shared_ffn):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    init_model_parallel()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    config = moe_config(False, moe_shared_expert_intermediate_size=shared_ffn, moe_layer_freq=1)
    stock = build_stock_moe(config)
    sd = {k: v for k, v in stock.state_dict().items() if "_extra_state" not in k}
    batch = M.batches(1, 2)[0]
    ref_loss, ref_grads = _loss_and_grads(stock, batch)
    result = {}
    for strategy in strategies:
        model = M.build_gpt(config, strategy)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        vectors = {n for n, p in model.named_parameters() if hasattr(p, "scalevec_part")}
        assert set(missing) <= vectors, sorted(set(missing) - vectors)[:5]
        # HG moves the Pre-Norm gammas into the branches: only those stock keys are unused.
        assert all(k.endswith("layernorm.weight") for k in unexpected), unexpected
        loss, grads = _loss_and_grads(model, batch)
        common = [n for n in ref_grads if n in grads]
        worst = max(float((ref_grads[n] - grads[n]).abs().max()) for n in common)
        n_vec = sum(1 for n in grads if n in vectors)
        names = [n for n in vectors if ".experts." in n or ".router." in n
                 or ".shared_experts." in n]
        result[strategy] = (loss - ref_loss, worst, len(common), n_vec, names)
    return result


@pytest.mark.parametrize("shared_ffn", [None, 40], ids=["no_shared", "shared_expert"])
def test_init_equals_megatron_moe_layer(shared_ffn):
    """All vectors at init: loss and gradients equal megatron-core's MoE (top-2, aux loss)."""
    res = run_on_ranks(_parity, 1, ["hg", "hg+dp", "hg+or", "hg+er"], shared_ffn)[0]
    for strategy, (dloss, worst, n_common, n_vec, names) in res.items():
        assert abs(dloss) < 1e-5, (strategy, dloss)
        assert worst < 1e-5, (strategy, worst)
        assert n_common >= 20 and n_vec > 0
        # router gamma_r, per-expert gamma_g^e/gamma_u^e for all 4 experts, shared experts'
        assert any(".router.scale_in." in n for n in names), strategy
        for e in range(EXPERTS):
            assert any(f"local_experts.{e}.linear_fc1.scale_in.gate" in n for n in names)
        assert any(".shared_experts." in n for n in names) == (shared_ffn is not None)
        if "dp" in strategy:
            assert any("local_experts.3.linear_fc1.scale_out.up" in n for n in names)


# ---------------------------------------------------------------- layouts
def _case(rank, world, strategy, *, tp=1, pp=1, ep=1, etp=None, sp=False, dispatcher="allgather",
          apply_mode=None, expert_vectors="per_expert", **kw):
    from megatron_scalevec.config import ScaleVecConfig

    init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    config = moe_config(False, sequence_parallel=sp, moe_token_dispatcher_type=dispatcher)
    strategy = ScaleVecConfig.from_string(strategy, expert_vectors=expert_vectors,
                                          **({"apply_mode": apply_mode} if apply_mode else {}))
    check = _check_shared_expert_vectors if expert_vectors == "shared" else \
        _check_expert_vector_groups
    return M.run_case(config, strategy, check=lambda m: check(m, ep), **kw)


def _check_expert_vector_groups(model, ep):
    """Expert vectors: expert-TP groups, DDP's expert buckets under EP, no SP attribute."""
    from megatron.core import parallel_state as ps

    from megatron_scalevec.vectors import ScaleVector

    etp_group = ps.get_expert_tensor_parallel_group()
    dense_tp = ps.get_tensor_model_parallel_group()
    seen = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, ScaleVector) or ".experts." not in name or not mod.enabled:
            continue
        seen += 1
        assert mod.tp_group is etp_group, name
        for group in (mod.split_group, mod.grad_group):
            assert group is None or group is etp_group, name
            assert group is None or etp_group is not dense_tp or ep == 1, name
        for p in mod.parameters():
            assert not hasattr(p, "sequence_parallel"), name
            assert p.allreduce == (ep == 1), name
    assert seen > 0 or not any(".experts." in n for n, _ in model.named_parameters())


LAYOUTS = {
    "ep2": dict(world=2, ep=2),
    "ep2_alltoall": dict(world=2, ep=2, dispatcher="alltoall"),
    "tp2_sp_ep2_etp1": dict(world=2, tp=2, sp=True, ep=2, etp=1),
    "tp2_sp_etp2": dict(world=2, tp=2, sp=True, etp=2),
    "tp2_sp_etp2_activation": dict(world=2, tp=2, sp=True, etp=2, apply_mode="activation"),
    "tp2_sp_etp2_alltoall": dict(world=2, tp=2, sp=True, etp=2, dispatcher="alltoall"),
    "pp2_mixed_dense_moe": dict(world=2, pp=2),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Reference weights (vectors perturbed) and gradients at one process, per strategy."""
    cache = {}

    def get(strategy, expert_vectors="per_expert"):
        key = (strategy, expert_vectors)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"moe_{expert_vectors}_" + strategy.replace("+", "_"))
            ref, grads = str(root / "weights"), str(root / "grads")
            res = run_on_ranks(_case, 1, strategy, expert_vectors=expert_vectors,
                               ref_dir=ref, out_dir=grads)[0]
            cache[key] = (ref, grads, res["losses"])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(references):
    return references("unified")


def _compare(ref_dir, out_dir, base_dir=None, rtol=RTOL):
    """(mismatching keys, all keys), tolerance relative to each tensor (updates if base_dir)."""
    return run_on_ranks(M.saved_mismatches, 1, ref_dir, out_dir, base_dir, rtol)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_unified_loss_and_gradients_match_across_layouts(reference, tmp_path, layout):
    ref, ref_grads, ref_losses = reference
    opts = dict(LAYOUTS[layout])
    world = opts.pop("world")
    out = str(tmp_path / "grads")
    res = run_on_ranks(_case, world, "unified", load_dir=ref, out_dir=out, **opts)
    assert abs(res[0]["losses"][0] - ref_losses[0]) < LOSS_TOL, (res, ref_losses)
    bad, keys = _compare(ref_grads, out)
    expert_vectors = [k for k in keys if ".experts." in k and ("scale_" in k or "_norm" in k)]
    assert expert_vectors and any("router.scale_in" in k for k in keys)
    assert not bad, f"{layout}:\n" + "\n".join(bad)


@pytest.mark.parametrize("layout", ["tp2_sp_etp2", "tp2_sp_ep2_etp1"])
def test_dp_er_vectors_match_across_expert_layouts(references, tmp_path, layout):
    """DP's output vectors split with expert fc1 columns, ER's mean over the split vector."""
    ref, ref_grads, ref_losses = references("hg+dp+er")
    opts = dict(LAYOUTS[layout])
    world = opts.pop("world")
    out = str(tmp_path / "grads")
    res = run_on_ranks(_case, world, "hg+dp+er", load_dir=ref, out_dir=out, **opts)
    assert abs(res[0]["losses"][0] - ref_losses[0]) < LOSS_TOL, (res, ref_losses)
    bad, keys = _compare(ref_grads, out)
    assert any(".experts." in k and "scale_out.up.logit" in k for k in keys)
    assert not bad, f"{layout}:\n" + "\n".join(bad)


def test_distributed_optimizer_steps_equal_at_ep1_and_ep2(reference, tmp_path):
    """Three linear (SGD-equivalent) steps, clipping on: updates equal at EP1 and EP2."""
    ref, _, _ = reference
    one, two = str(tmp_path / "ep1"), str(tmp_path / "ep2")
    kw = dict(steps=3, dist_opt=True, load_dir=ref, clip_grad=0.05, lr=0.5)
    base = run_on_ranks(_case, 1, "unified", out_dir=one, **kw)[0]
    other = run_on_ranks(_case, 2, "unified", ep=2, out_dir=two, **kw)
    assert base["losses"][-1] < base["losses"][0]
    for a, b in zip(base["losses"], other[0]["losses"]):
        assert abs(a - b) < 1e-4, (base, other)
    for r in other:
        assert r["grad_norms"] == pytest.approx(base["grad_norms"], rel=1e-5)
    bad, _ = _compare(one, two, base_dir=ref, rtol=1e-3)
    assert not bad, "after 3 steps EP1 vs EP2:\n" + "\n".join(bad)


# Layouts where the grad norm must count each expert and vector once: expert TP differs from
# TP, EP > 1, shared vectors.
NORM_LAYOUTS = {
    "tp2_sp_ep2_etp1": dict(world=2, tp=2, sp=True, ep=2, etp=1),
    "tp1_etp2_ep2": dict(world=4, ep=2, etp=2),
    "tp2_sp_etp2": dict(world=2, tp=2, sp=True, etp=2),
    "shared_ep2": dict(world=2, ep=2, expert_vectors="shared"),
    "shared_tp2_sp_ep2_etp1": dict(world=2, tp=2, sp=True, ep=2, etp=1,
                                   expert_vectors="shared"),
}


@pytest.mark.parametrize("dist_opt", [False, True], ids=["opt", "distopt"])
@pytest.mark.parametrize("layout", list(NORM_LAYOUTS))
def test_vector_grad_norm_matches_single_process(references, layout, dist_opt):
    """Only the vectors trainable, clipping on: the grad norm optimizer.step() returns equals
    one process (each expert vector counted exactly once, as megatron-core's conventions
    require: tensor_model_parallel / shared markers, sharding.py)."""
    opts = dict(NORM_LAYOUTS[layout])
    world = opts.pop("world")
    ev = opts.get("expert_vectors", "per_expert")
    ref, _, _ = references("unified", ev)
    kw = dict(steps=1, load_dir=ref, clip_grad=1e-3, only_vectors=True, dist_opt=dist_opt)
    base = run_on_ranks(_case, 1, "unified", expert_vectors=ev, **kw)[0]
    res = run_on_ranks(_case, world, "unified", **opts, **kw)
    for r in res:
        assert r["grad_norms"] == pytest.approx(base["grad_norms"], rel=1e-5), (layout, r, base)


# ---------------------------------------------------------------- checkpoint resharding
def _reshard(rank, world, *, ep, save_dir=None, load_dir=None, strategy="unified"):
    from megatron.core import parallel_state as ps

    init_model_parallel(ep=ep)
    config = moe_config(False, moe_layer_freq=1)
    model = M.build_gpt(config, strategy)
    local = {}
    if load_dir is None:
        with torch.no_grad():  # distinct vectors per global expert
            offset = ps.get_expert_model_parallel_rank() * (EXPERTS // ep)
            for name, p in model.named_parameters():
                if hasattr(p, "scalevec_part"):
                    shift = offset if "local_experts" in name else 0
                    g = torch.Generator().manual_seed(M._seed_of(name) + shift)
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        M.save_model(model, save_dir)
        for name, p in model.named_parameters():
            if "local_experts" in name and "scale_in.gate.direction" in name:
                local[name] = p.detach().numpy().copy()  # tensors do not pickle by value
    else:
        M.load_model(model, load_dir)
    model.eval()
    with torch.no_grad():
        b = M.batches(1, 2, seed=11)[0]
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean()
    return float(loss), local, ps.get_expert_model_parallel_rank()


def _plain(rank, world, directory, key):
    return M.plain_tensors(directory)[key].numpy()


def test_checkpoint_ep2_loads_at_ep1_with_identical_outputs(tmp_path):
    saved = str(tmp_path / "ep2")
    at_ep2 = run_on_ranks(_reshard, 2, ep=2, save_dir=saved)
    at_ep1 = run_on_ranks(_reshard, 1, ep=1, load_dir=saved)[0]
    assert at_ep2[0][0] == at_ep2[1][0]
    assert at_ep1[0] == pytest.approx(at_ep2[0][0], abs=1e-6)
    # per-expert vectors are stored at their global expert id: [E, ...] tensors
    # layers are stacked on axis 0, global experts on axis 1: [layers, E, h]
    key = "decoder.layers.mlp.experts.experts.linear_fc1.scale_in.gate.direction"
    plain = run_on_ranks(_plain, 1, saved, key)[0]
    assert plain.shape == (2, EXPERTS, 32)
    for _, local, ep_rank in at_ep2:
        for name, value in local.items():
            if name.startswith("decoder.layers.0."):
                e = ep_rank * (EXPERTS // 2) + int(name.split("local_experts.")[1].split(".")[0])
                assert (plain[0, e] == value).all(), (name, e)


# ---------------------------------------------------------------- expert_vectors="shared"
# One set of expert-side vectors per MoE layer, used by every routed expert (layers/moe.py,
# ExpertSharedVectors): same checks as above, at the layouts that exercise its reduction.
def _check_shared_expert_vectors(model, ep):
    """Owned once per layer by the experts module, EP/expert-TP groups, expert allreduce."""
    from megatron.core import parallel_state as ps

    from megatron_scalevec.vectors import ScaleVector

    etp = ps.get_expert_tensor_parallel_group()
    groups = {ps.get_expert_tensor_and_model_parallel_group(), ps.get_expert_model_parallel_group()}
    assert not [n for n, p in model.named_parameters()
                if ".local_experts." in n and hasattr(p, "scalevec_part")]
    seen = 0
    for name, mod in model.named_modules():
        if isinstance(mod, ScaleVector) and ".experts.shared_vectors." in name:
            seen += 1
            assert mod.tp_group is etp, name
            assert mod.grad_group is None or mod.grad_group in groups, name
            for p in mod.parameters():
                assert not hasattr(p, "sequence_parallel"), name
                assert p.allreduce == (ep == 1), name
    assert seen > 0


def test_shared_expert_vectors_config():
    from megatron_scalevec.config import ScaleVecConfig

    assert ScaleVecConfig().expert_vectors == "per_expert"
    assert strategy_config("unified", "shared").expert_vectors == "shared"
    with pytest.raises(ValueError, match="expert_vectors"):
        ScaleVecConfig.from_string("unified", expert_vectors="per_layer")


def test_shared_expert_vectors_init_equals_megatron_moe_layer():
    strategies = [strategy_config("hg+dp+or", "shared"), strategy_config("hg+er", "shared")]
    res = run_on_ranks(_parity, 1, strategies, 40)[0]
    for strategy, (dloss, worst, n_common, n_vec, names) in res.items():
        assert abs(dloss) < 1e-5 and worst < 1e-5, (strategy, dloss, worst)
        assert n_common >= 20 and n_vec > 0
        assert not any(".local_experts." in n for n in names), names
        assert any("experts.shared_vectors.scale_in.gate" in n for n in names), names
        assert any(".shared_experts.linear_fc1.scale_in" in n for n in names)
    assert any("experts.shared_vectors.scale_out.up" in n for n in res[strategies[0]][4])


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "grouped"])
def test_shared_expert_vectors_are_owned_once_and_lent(grouped):
    """One ExpertSharedVectors per MoE layer owns the vectors (its keys only); each local
    expert and its fc1 build none and are lent exactly that owner; nothing is registered twice
    (layers/expert_vectors.py). Per expert: no owner, no lending."""
    from scalevec_testing.experts import vector_ownership

    for strategy in ("unified", "hg+dp+er"):
        shared = run_on_ranks(vector_ownership, 1, False, grouped, strategy, "shared")[0]
        assert shared["params_once"] and shared["modules_once"], shared
        assert (shared["owners"], shared["users"], shared["elsewhere"]) == (1, 2 * EXPERTS, 0)
        assert shared["in_owner"] and not shared["outside_owner"], shared
        own = run_on_ranks(vector_ownership, 1, False, grouped, strategy, "per_expert")[0]
        assert own["params_once"] and (own["owners"], own["users"]) == (0, 0), own
        assert len(own["outside_owner"]) == EXPERTS * len(shared["in_owner"]), own


SHARED_LAYOUTS = {**LAYOUTS, "ep2_edp2": dict(world=4, ep=2)}


@pytest.mark.parametrize("layout", ["ep2", "tp2_sp_ep2_etp1", "tp2_sp_etp2", "ep2_edp2"])
def test_shared_expert_vectors_match_across_layouts(references, tmp_path, layout):
    """tp2_sp_ep2_etp1: the EP group is the dense TP group (DP=1), so only the explicit
    reduction over EP (not DDP's dense one) gives the EP=1 gradient; ep2_edp2 adds DDP's
    expert-data-parallel sum and its 1/dp factor."""
    ref, ref_grads, ref_losses = references("unified", "shared")
    opts = dict(SHARED_LAYOUTS[layout])
    world = opts.pop("world")
    out = str(tmp_path / "grads")
    res = run_on_ranks(_case, world, "unified", expert_vectors="shared", load_dir=ref,
                       out_dir=out, **opts)
    assert abs(res[0]["losses"][0] - ref_losses[0]) < LOSS_TOL, (res, ref_losses)
    bad, keys = _compare(ref_grads, out)
    shared = [k for k in keys if ".experts.shared_vectors." in k]
    for part in ("scale_in.gate.", "scale_in.up.", "gate_norm.", "up_norm."):
        assert any(part in k for k in shared), (part, shared)
    assert not bad, f"{layout}:\n" + "\n".join(bad)


def test_shared_expert_vectors_checkpoint_ep2_loads_at_ep1(tmp_path):
    saved, strategy = str(tmp_path / "ep2"), strategy_config("unified", "shared")
    at_ep2 = run_on_ranks(_reshard, 2, ep=2, save_dir=saved, strategy=strategy)
    at_ep1 = run_on_ranks(_reshard, 1, ep=1, load_dir=saved, strategy=strategy)[0]
    assert at_ep2[0][0] == at_ep2[1][0]
    assert at_ep1[0] == pytest.approx(at_ep2[0][0], abs=1e-6)
    # saved once per layer: [layers, h], no expert axis, no per-expert copy
    key = "decoder.layers.mlp.experts.shared_vectors.scale_in.gate.direction"
    assert run_on_ranks(_plain, 1, saved, key)[0].shape == (2, 32)
    keys = run_on_ranks(_keys, 1, saved)[0]
    assert not [k for k in keys if "experts.experts." in k and ("scale_" in k or "_norm" in k)]


def _keys(rank, world, directory):
    return sorted(M.plain_tensors(directory))
