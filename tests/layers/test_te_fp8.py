"""FP8 through Transformer Engine's own Python on CPU: TE's quantizers, ``Float8Tensor``, weight
workspaces, ``fp8_autocast`` and delayed scaling's amax history run over
scalevec_testing/te_fp8.py's torch stand-ins of its per-tensor FP8 kernels, inside the forked ranks
only. Checked: the kernels against plain torch float8 casts and matmuls (and TE's own Python scale
update); every strategy's FP8 forward and backward against its bf16 one, dense and on TE grouped
experts, for delayed and current scaling; the FP8 weight TE caches for a step is quantized from the
folded weight once a step, through megatron-core's schedule and ``set_is_first_microbatch``; an FP8
checkpoint (TE's scaling state included) resumes exactly."""

import os

import pytest
import torch

from scalevec_testing import init_model_parallel, run_on_ranks, te_stub
from scalevec_testing import models as M
from scalevec_testing.markers import needs_te

pytestmark = needs_te

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """Plain torch's saturating FP8 cast of ``x * scale``, as uint8 bits."""
    top = torch.finfo(fmt).max
    return (x.float() * scale).clamp(-top, top).to(fmt).view(torch.uint8)


def _values(q, fmt=E4M3) -> torch.Tensor:
    return q._data.view(fmt).float() * q._scale_inv.float()


# ---------------------------------------------------------------- the kernels
def _kernels(rank, world):
    te_stub.activate()
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import DelayedScaling
    from transformer_engine.pytorch.cpp_extensions import general_gemm
    from transformer_engine.pytorch.tensor.float8_tensor import (
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
    )

    out = {}
    torch.manual_seed(0)
    x, w = torch.randn(24, 32), torch.randn(16, 32) * 3
    with te_stub.cuda_claimed():
        # current scaling: the tensor's own amax; data, transpose and scale_inv
        cur = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")
        qx = cur(x)
        s = 448.0 / float(x.abs().max())
        out["current_bits"] = torch.equal(qx._data, _bits(x, s, E4M3))
        out["current_transpose"] = torch.equal(qx._transpose, _bits(x, s, E4M3).t())
        out["dequantize"] = float((qx.dequantize() - _values(qx)).abs().max())
        # delayed scaling: the given scale; the cast records its amax
        dq = Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), tex.DType.kFloat8E4M3)
        qw = dq(w)
        out["delayed_bits"] = torch.equal(qw._data, _bits(w, 2.0, E4M3))
        out["delayed_amax"] = float(dq.amax) == float(w.abs().max())
        # e5m2 saturates (torch's CPU cast alone overflows to inf)
        big = Float8Quantizer(torch.tensor([1.0]), torch.zeros(1), tex.DType.kFloat8E5M2)
        sat = big(torch.tensor([[1e6, -1e6, 3.0, 0.5]]))
        out["e5m2_saturates"] = sat._data.view(E5M2).float().tolist()
        # an FP8 GEMM through TE's general_gemm: the dequantized operands' matmul
        y = general_gemm(qw, qx, out_dtype=torch.float32, layout="TN")[0]
        ref = _values(qx) @ _values(qw).t()
        out["gemm"] = float((y - ref).abs().max() / ref.abs().max())
    # current scaling's fused norm writes y in bf16, then takes its amax and casts it
    xb = (torch.randn(16, 32) * 3).bfloat16()
    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")
    with te_stub.cuda_claimed():
        z = tex.rmsnorm_fwd(xb, torch.ones(32, dtype=torch.bfloat16), 1e-5, None, q,
                            tex.DType.kBFloat16, 0, False)[0]
    y = xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    y = y.bfloat16().float()
    out["norm_current"] = torch.equal(z._data, _bits(y, 448.0 / float(y.abs().max()), E4M3))
    # TE's delayed-scaling update calls the kernel's stand-in (not its Python fallback)
    calls = []
    real = tex.fused_amax_and_scale_update_after_reduction
    tex.fused_amax_and_scale_update_after_reduction = lambda *a: calls.append(a) or real(*a)
    with te_stub.cuda_claimed():
        from transformer_engine.pytorch import Linear
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager, autocast

        lin = Linear(32, 16, params_dtype=torch.float32, device="cpu")
        with autocast(recipe=DelayedScaling(amax_history_len=4, amax_compute_algo="max")):
            lin(torch.randn(16, 32)).sum().backward()
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
    out["kernel_update_called"] = len(calls)
    return out


def test_fp8_kernels_match_torch():
    r = run_on_ranks(_kernels, 1)[0]
    assert r["current_bits"] and r["current_transpose"] and r["dequantize"] == 0.0, r
    assert r["delayed_bits"] and r["delayed_amax"], r
    assert r["e5m2_saturates"] == [[57344.0, -57344.0, 3.0, 0.5]], r
    assert r["gemm"] < 1e-6, r
    assert r["norm_current"] and r["kernel_update_called"] >= 1, r


# ---------------------------------------------------------------- the GEMMs' FP8 copies
def _zeroed_transposes(rank, world, recipe):
    """Gradients of one FP8 step, as is and with every cached FP8 weight's transposed copy
    zeroed after the forward."""
    te_stub.activate()
    init_model_parallel()
    out = []
    for zero in (False, True):
        config = M.tiny_config(**FP8_FP32, fp8_recipe=recipe)
        with te_stub.cuda_claimed():
            model = M.build_gpt(config, "unified")
            M.perturb_vectors(model)
            b = M.batches(1, 2)[0]
            loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
            cached = [q for m in model.modules()
                      for q in getattr(m, "_fp8_workspaces", {}).values()]
            for q in cached if zero else ():
                q._transpose.zero_()
            loss.backward()
        out.append((float(loss), len(cached), {n: p.grad.clone() for n, p in
                                               model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_backward_reads_the_weights_transposed_copy(recipe):
    """On Hopper (what the stand-in claims) TE's dgrad GEMM reads each FP8 weight's column-wise
    copy: zeroing the transposes of the cached FP8 weights after the forward leaves the loss and
    changes the gradients below the last layer (the embedding's among them)."""
    (l0, n0, g0), (l1, n1, g1) = run_on_ranks(_zeroed_transposes, 1, recipe)[0]
    assert l0 == l1 and n0 == n1 > 0
    changed = [n for n in g0 if not torch.equal(g0[n], g1[n])]
    assert "embedding.word_embeddings.weight" in changed and len(changed) > len(g0) // 2, changed


# ---------------------------------------------------------------- FP8 against bf16
def _one(strategy, recipe, experts, grouped):
    kw = dict(transformer_impl="transformer_engine", hidden_size=64, ffn_hidden_size=128,
              params_dtype=torch.bfloat16, bf16=True, pipeline_dtype=torch.bfloat16)
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=32,
                  moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped)
    if recipe:
        kw.update(fp8="hybrid", fp8_recipe=recipe)
    with te_stub.cuda_claimed():
        model = M.build_gpt(M.tiny_config(**kw), strategy)
    M.perturb_vectors(model)
    b = M.batches(1, 2)[0]
    from scalevec_testing import te_ops

    te_ops.CALLS.clear()
    with te_stub.cuda_claimed():
        loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean()
        loss.backward()
    grads = {n: None if p.grad is None else p.grad.float()
             for n, p in model.named_parameters() if p.requires_grad}
    return float(loss), grads, dict(te_ops.CALLS)


def _cos(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _fp8_vs_bf16(rank, world, strategies, experts, grouped):
    te_stub.activate()
    init_model_parallel()
    out = {}
    for strategy in strategies:
        l16, g16, _ = _one(strategy, None, experts, grouped)
        for recipe in ("delayed", "tensorwise"):
            l8, g8, calls = _one(strategy, recipe, experts, grouped)
            vectors = [n for n in g8 if ".scale_" in n or "norm" in n]
            multi = [n for n in g16 if g16[n] is not None and g16[n].numel() > 1]
            out[(strategy, recipe)] = dict(
                dloss=abs(l8 - l16) / l16, quantized=calls.get("quantize", 0),
                missing=sorted(n for n, g in g8.items() if g is None or not g.isfinite().all()),
                zero_vectors=sorted(n for n in vectors if not g8[n].abs().sum()),
                total=_cos(torch.cat([g8[n].flatten() for n in multi]),
                           torch.cat([g16[n].flatten() for n in multi])),
                worst=min((_cos(g8[n], g16[n]), n) for n in multi))
    return out


STRATEGIES = ["shared", "hg", "hg+dp", "hg+or", "hg+er", "hg+dnp", "unified"]


@pytest.mark.parametrize("experts,grouped,strategies", [
    (0, False, STRATEGIES), (4, True, ["shared", "hg+dp", "unified"])], ids=["dense", "te_grouped"])
def test_fp8_forward_backward_match_bf16(experts, grouped, strategies):
    """Each strategy in FP8 (TE's delayed and current scaling) against the same model in bf16:
    the loss within 0.5 %, every gradient present and finite, no vector's gradient zero, and the
    gradients aligned (cosine > 0.93 over all, > 0.7 per tensor: FP8's e4m3 / e5m2 rounding on a
    64-wide model). Without TE's FP8 path (no quantize call) the test fails."""
    r = run_on_ranks(_fp8_vs_bf16, 1, strategies, experts, grouped)[0]
    assert len(r) == 2 * len(strategies)
    for case, m in r.items():
        assert m["quantized"] > 0, (case, m)
        assert not m["missing"] and not m["zero_vectors"], (case, m)
        assert m["dloss"] < 5e-3 and m["total"] > 0.93 and m["worst"][0] > 0.7, (case, m)


# ---------------------------------------------------------------- the step's FP8 weight
FP8_FP32 = dict(transformer_impl="transformer_engine", fp8="hybrid", fp8_amax_history_len=4,
                fp8_amax_compute_algo="max", hidden_size=64, ffn_hidden_size=128)


def _moe_kw(grouped):
    return dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                moe_aux_loss_coeff=0.0, moe_grouped_gemm=True) if grouped else {}


def _watch(model):
    """Per folded TE module and forward: the folded weights ``_get_weight_tensors()`` gave TE
    and the FP8 weights TE then held in its step cache (bits and scale_inv)."""
    seen = {}
    for name, m in model.named_modules():
        if not getattr(m, "has_scale_vectors", False) or not hasattr(m, "_fp8_workspaces"):
            continue
        log, fold = seen.setdefault(name, []), m._get_weight_tensors

        def get(fold=fold, log=log):
            weights = fold()
            log.append({"w": [w.detach().float().clone() for w in weights]})
            return weights

        def after(mod, args, output, log=log):
            ws = [mod._fp8_workspaces[k] for k in sorted(mod._fp8_workspaces)]
            log[-1]["bits"] = [q._data.clone() for q in ws]
            log[-1]["scale_inv"] = [float(q._scale_inv) for q in ws]

        m._get_weight_tensors = get
        m.register_forward_hook(after)
    return seen


def _quantized_from(entry) -> float:
    """How far the cached FP8 weights are from a plain torch cast of the folded weights, in
    units of FP8 rounding (<= 1: quantized from them)."""
    worst = 0.0
    for w, bits, inv in zip(entry["w"], entry["bits"], entry["scale_inv"]):
        value = bits.view(E4M3).float() * inv
        bound = 2.0 ** -4 * w.abs() + 2.0 ** -10 * inv  # half a step, normal and subnormal
        worst = max(worst, float(((value - w).abs() / bound).max()))
    return worst


def _weight_cache(rank, world, recipe, grouped, rearm):
    te_stub.activate()
    init_model_parallel()
    from megatron.core.transformer.module import MegatronModule

    from scalevec_testing import te_ops

    if not rearm:  # what a loop without megatron-core's schedule does
        MegatronModule.set_is_first_microbatch = lambda self: None
    def run(fp8, hooks=None):
        kw = {k: v for k, v in FP8_FP32.items() if fp8 or not k.startswith("fp8")}
        config = M.tiny_config(**kw, **({"fp8_recipe": recipe} if fp8 else {}),
                               **_moe_kw(grouped))
        with te_stub.cuda_claimed():
            model = M.build_gpt(config, "unified")
        M.perturb_vectors(model)
        M.te_fused_wgrad_accumulation(model)
        if hooks:
            hooks(model)
        ddp = M.wrap_ddp(model, config)
        opt = M.make_optimizer(ddp, lr=0.1, optimizer="sgd")
        return model, M.train_steps(ddp, config, M.batches(3, 2), 2, opt,
                                    forward_context=te_stub.cuda_claimed)

    counts, seen = [], {}

    def hooks(model):
        seen.update(_watch(model))
        model.register_forward_pre_hook(lambda *a: counts.append(te_ops.CALLS["quantize"]))

    model, losses = run(True, hooks)
    counts.append(te_ops.CALLS["quantize"])
    per_mb = [b - a for a, b in zip(counts, counts[1:])]  # forward + backward each
    workspaces = sum(len(m._fp8_workspaces) for m in model.modules()  # every TE linear's
                     if hasattr(m, "_fp8_workspaces"))
    out = dict(per_mb=per_mb, workspaces=workspaces, modules=len(seen), fresh=[], kept=[],
               dloss=max(abs(a - b) / b for a, b in zip(losses, run(False)[1])))
    for log in seen.values():
        assert len(log) == 6, len(log)  # 2 steps x 3 micro-batches
        for step in (0, 3):
            out["fresh"].append(_quantized_from(log[step]))
            out["kept"].append(all(torch.equal(a, b) for mb in (1, 2)
                                   for a, b in zip(log[step]["bits"], log[step + mb]["bits"])))
        out.setdefault("stale", []).append(all(torch.equal(a, b) for a, b in
                                               zip(log[0]["bits"], log[3]["bits"])))
    return out


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "te_grouped"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_weight_quantized_from_the_fold_once_per_step(recipe, grouped):
    """Through megatron-core's schedule (3 micro-batches, 2 SGD steps, TE's fused wgrad
    accumulation): every folded TE module's cached FP8 weight is a cast of the weight our fold
    gave TE in the step's first micro-batch, is kept unchanged for the step's other micro-batches
    (no weight is quantized there: exactly one quantization per weight per step) and is made
    anew in the next step. Without ``set_is_first_microbatch`` the cache goes stale (the check
    fails: shown by the second run). Both steps' losses are within 0.5 % of the same run's
    without FP8 (a cache of anything but the fold would not be)."""
    r = run_on_ranks(_weight_cache, 1, recipe, grouped, True)[0]
    assert r["dloss"] < 5e-3, r
    assert r["modules"] == 4 and r["workspaces"] > r["modules"], r
    assert max(r["fresh"]) <= 1.0 and all(r["kept"]) and not any(r["stale"]), r
    first, later = r["per_mb"][0::3], r["per_mb"][1::3] + r["per_mb"][2::3]
    assert len(set(later)) == 1 and all(f - later[0] == r["workspaces"] for f in first), r
    stale = run_on_ranks(_weight_cache, 1, recipe, grouped, False)[0]
    assert all(stale["stale"]) and max(stale["fresh"]) > 1.0, stale


# ---------------------------------------------------------------- FP8 checkpoints
def _resume(rank, world, tmp, grouped):
    # TE >= 2.17 loads delayed scaling's pickled _extra_state only when allowed (this test's own
    # checkpoint); 2.11 loads it unasked
    os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = "1"
    te_stub.activate()
    init_model_parallel()
    from megatron.core import dist_checkpointing

    config = M.tiny_config(fp8_recipe="delayed", **FP8_FP32, **_moe_kw(grouped))
    data = M.batches(2, 2)

    def build(seed):
        with te_stub.cuda_claimed():
            model = M.build_gpt(config, "unified", seed=seed)
        M.te_fused_wgrad_accumulation(model)
        return model

    def train(model):
        ddp = M.wrap_ddp(model, config)
        opt = M.make_optimizer(ddp, lr=0.1, optimizer="sgd")
        return lambda: M.train_steps(ddp, config, data, 1, opt,
                                     forward_context=te_stub.cuda_claimed)[0]

    a = build(7)
    M.perturb_vectors(a)
    step = train(a)
    step()
    M.save_model(a, os.path.join(tmp, "ckpt"))
    want = step()
    params = {n: p.detach().clone() for n, p in a.named_parameters()}
    b = build(11)
    M.load_model(b, os.path.join(tmp, "ckpt"))
    got = train(b)()
    same = all(torch.equal(params[n], p) for n, p in b.named_parameters())
    c = build(11)  # the same checkpoint without TE's FP8 state (amax history and scales)
    state = dist_checkpointing.load(c.sharded_state_dict(), os.path.join(tmp, "ckpt"))
    c.load_state_dict({k: v for k, v in state.items() if not k.endswith("_extra_state")},
                      strict=False)
    return dict(want=want, got=got, same=same, without_state=train(c)())


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "te_grouped"])
def test_fp8_checkpoint_resumes_exactly(tmp_path, grouped):
    """An FP8 (delayed scaling) run saved after a step and loaded into a differently seeded model
    continues with the same loss and the same parameters, bit for bit; dropping TE's FP8 state
    from the checkpoint changes the step (so the state is what resumes)."""
    r = run_on_ranks(_resume, 1, str(tmp_path), grouped)[0]
    assert r["got"] == r["want"] and r["same"], r
    assert r["without_state"] != r["want"], r
