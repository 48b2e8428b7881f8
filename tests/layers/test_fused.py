"""Lean fused DNP and the recomputing fold (layers/fused.py, layers/glu.py, layers/linear.py):
equal to the autograd composites they replace (scalevec_testing/reference.py; output and every
gradient), and keeping no full-size tensor the stock layer does not keep."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from benchmarks.overhead import saved_activation_bytes
from megatron_scalevec import compile
from megatron_scalevec.layers import fused, glu
from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.reference import reference

TOL = 1e-5


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _both(fn, inputs, dy):
    """(output, grads) of fn through the fused path and through the reference."""
    res = []
    for ctx in (contextlib.nullcontext(), reference()):
        with ctx:
            y = fn()
        res.append((y, *torch.autograd.grad(y, inputs, dy)))
    return res


def _freqs(seq, rot, interleaved):
    f = torch.randn(seq, 1, 1, rot // 2)
    return torch.stack([f, f], -1).flatten(-2) if interleaved else torch.cat([f, f], -1)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 8, None])
def test_head_norm_rope_matches_reference(normalization, interleaved, rot):
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, 16, requires_grad=True)
    a = (1 + 0.3 * torch.randn(16)).requires_grad_()
    rope = None
    if rot:
        freqs = _freqs(5, rot, interleaved)
        rope = fused.rope_cos_sin(freqs, 1.3, x.dtype)
        # the reference is megatron-core's own unfused RoPE (mscale included)
        with reference():
            ours = fused.head_norm(x, a, 1e-5, normalization, rope, interleaved)
        with reference():
            plain = fused.head_norm(x, a, 1e-5, normalization)
        theirs = _apply_rotary_pos_emb_bshd(plain, freqs, rotary_interleaved=interleaved,
                                            mscale=1.3)
        assert _rel(ours, theirs) < 1e-6
    got, ref = _both(lambda: fused.head_norm(x, a, 1e-5, normalization, rope, interleaved),
                     (x, a), torch.randn(5, 2, 3, 16))
    for name, g, r in zip(("out", "dx", "da"), got, ref):
        assert _rel(g, r) < TOL, (name, _rel(g, r))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("qpg,rot,same", [(2, 16, True), (1, 8, False), (3, None, True)])
def test_qkv_norm_matches_three_head_norms(normalization, qpg, rot, same):
    """One function on megatron-core's mixed QKV equals the split + three head norms (q, k
    with their own RoPE), in outputs and every gradient."""
    torch.manual_seed(2)
    groups, hd = 2, 16
    mixed = torch.randn(5, 2, groups, (qpg + 2) * hd, requires_grad=True)
    vecs = tuple((1 + 0.3 * torch.randn(hd)).requires_grad_() for _ in range(3))
    rope_q = rope_k = None
    if rot:
        rope_q = fused.rope_cos_sin(_freqs(5, rot, False), 1.1, mixed.dtype)
        rope_k = rope_q if same else fused.rope_cos_sin(_freqs(5, rot, False), 1.1, mixed.dtype)

    def split_then_norm():
        q, k, v = torch.split(mixed, [qpg * hd, hd, hd], dim=3)
        q = q.reshape(5, 2, -1, hd)
        return (fused.head_norm(q, vecs[0], 1e-5, normalization, rope_q),
                fused.head_norm(k, vecs[1], 1e-5, normalization, rope_k),
                fused.head_norm(v, vecs[2], 1e-5, normalization))

    dys = (torch.randn(5, 2, groups * qpg, hd), torch.randn(5, 2, groups, hd),
           torch.randn(5, 2, groups, hd))
    with reference():
        ref = split_then_norm()
    got = fused.qkv_norm(mixed, vecs, 1e-5, normalization, qpg, rope_q, rope_k)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.is_contiguous()
        assert _rel(g, r) < TOL
    inputs = (mixed, *vecs)
    g_got = torch.autograd.grad(got, inputs, dys)
    g_ref = torch.autograd.grad(ref, inputs, dys)
    for name, g, r in zip(("dmixed", "da_q", "da_k", "da_v"), g_got, g_ref):
        assert _rel(g, r) < TOL, (name, _rel(g, r))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("act", [F.silu, F.gelu, F.relu, torch.tanh], ids=lambda f: f.__name__)
def test_glu_norm_matches_reference(normalization, gated, act):
    torch.manual_seed(1)
    z = torch.randn(7, 2, 24 if gated else 12, requires_grad=True)
    a_g = (1 + 0.3 * torch.randn(12)).requires_grad_()
    a_u = (1 + 0.3 * torch.randn(12)).requires_grad_()
    inputs = (z, a_g, a_u) if gated else (z, a_u)
    got, ref = _both(lambda: glu.glu_norm(z, a_g if gated else None, a_u, act, gated=gated,
                                            normalization=normalization, eps=1e-5),
                     inputs, torch.randn(7, 2, 12))
    for i, (g, r) in enumerate(zip(got, ref)):
        assert _rel(g, r) < TOL, (i, _rel(g, r))


# rows per expert: one block; blocks spanning two and three experts, an empty expert, a
# block-aligned boundary and a partial last block; no rows at all
EXPERT_COUNTS = [[3, 0, 2, 4], [20, 0, 13, 31, 7], [5, 3, 30, 10], [0, 0, 0]]


@pytest.mark.parametrize("counts", EXPERT_COUNTS, ids=str)
def test_expert_rows_count_every_row_once(counts):
    """The block sums and the spanning blocks' rows, added into the experts ``keys`` names,
    give each expert the sum over exactly its own rows."""
    rows = glu.expert_rows(counts)
    prod = torch.randn(sum(counts), 5, dtype=torch.float64)
    a = torch.ones(sum(counts), 5)  # per-row vectors: the expert path
    summands = glu._vector_grad(prod, a, rows.spans)
    onehot = (rows.keys[None, :] == torch.arange(len(counts))[:, None]).to(prod.dtype)
    want = torch.stack([p.sum(0) for p in prod.split(counts)])
    torch.testing.assert_close(onehot @ summands, want, rtol=1e-12, atol=1e-12)
    if rows.spans is not None:
        assert rows.spans.numel() == max(len(counts) - 1, 1) * glu.BLOCK  # one shape per E


@pytest.mark.parametrize("counts", EXPERT_COUNTS, ids=str)
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("gated", [True, False])
def test_glu_norm_per_expert_vectors_match_reference(normalization, gated, counts):
    """Grouped experts: each row uses its expert's vectors, and each expert's vector gradient
    sums its own rows only (an expert with no rows gets zero)."""
    torch.manual_seed(4)
    rows, n, e = glu.expert_rows(counts), sum(counts), len(counts)
    z = torch.randn(n, 24 if gated else 12, requires_grad=True)
    a_g = (1 + 0.3 * torch.randn(e, 12)).requires_grad_()
    a_u = (1 + 0.3 * torch.randn(e, 12)).requires_grad_()
    inputs = (z, a_g, a_u) if gated else (z, a_u)
    got, ref = _both(lambda: glu.glu_norm(z, a_g if gated else None, a_u, F.silu,
                                          gated=gated, normalization=normalization,
                                          eps=1e-5, experts=rows),
                     inputs, torch.randn(n, 12))
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and (g.numel() == 0 or _rel(g, r) < TOL), (i, g.shape)
    for expert, c in enumerate(counts):
        if c == 0:
            assert float(got[-1][expert].abs().max()) == 0.0


def test_fused_functions_keep_only_output_and_row_statistics():
    x = torch.randn(6, 2, 4, 16, requires_grad=True)
    a = torch.ones(16, requires_grad=True)
    cos, sin = fused.rope_cos_sin(_freqs(6, 16, False), 1.0, x.dtype)
    out = []
    nbytes = saved_activation_bytes(
        lambda: out.append(fused.head_norm(x, a, 1e-5, "RMSNorm", (cos, sin))))
    small = a.nbytes + cos.nbytes + sin.nbytes + 6 * 2 * 4 * 4  # vector, cos, sin, 1/rms
    assert nbytes == out[0].nbytes + small
    mixed = torch.randn(6, 2, 2, 4 * 16, requires_grad=True)  # 2 groups, 2 q heads each
    vecs = tuple(torch.ones(16, requires_grad=True) for _ in range(3))
    out = []
    nbytes = saved_activation_bytes(
        lambda: out.append(fused.qkv_norm(mixed, vecs, 1e-5, "RMSNorm", 2, (cos, sin),
                                          (cos, sin))))
    rows = 6 * 2 * 2 * 4 * 4  # 1/rms of each q, k, v head
    assert nbytes == sum(t.nbytes for t in out[0]) + 3 * a.nbytes + cos.nbytes + sin.nbytes \
        + rows
    z = torch.randn(6, 2, 32, requires_grad=True)
    a_u = a.detach().clone().requires_grad_()
    nbytes = saved_activation_bytes(lambda: glu.glu_norm(
        z, a, a_u, F.silu, gated=True, normalization="RMSNorm", eps=1e-5))
    assert nbytes == z.nbytes + 2 * a.nbytes + 6 * 2 * 2 * 4  # fc1 output, vectors, 1/rms


# ------------------------------------------------------------------ whole models, TP2 / SP

def _model_grads(rank, world, strategy, tp, sp, overrides):
    """Loss and every local gradient, fused and reference, of one micro-batch."""
    init_model_parallel(tp=tp)
    config = M.tiny_config(sequence_parallel=sp, **overrides)
    model = M.build_gpt(config, strategy)
    M.perturb_vectors(model)
    b = M.batches(1, 2)[0]
    out = {}
    for name, ctx in (("fused", contextlib.nullcontext()), ("ref", reference())):
        model.zero_grad()
        with ctx:
            loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
            loss.backward()
        out[name] = (float(loss), {n: p.grad.clone() for n, p in model.named_parameters()
                                   if p.grad is not None})
    return out


CASES = {
    "unified_tp2_sp": ("unified", 2, True, {}),
    "hg+dnp_tp2": ("hg+dnp", 2, False, {}),
    "hg+dnp+er_interleaved": ("hg+dnp+er", 1, False, {"rotary_interleaved": True}),
    "shared_qknorm_layernorm": ("shared", 1, False, {"qk_layernorm": True,
                                                     "normalization": "LayerNorm"}),
    "unified_moe_tp2_sp": ("unified", 2, True, {"num_moe_experts": 2, "moe_router_topk": 2,
                                                "moe_aux_loss_coeff": 0.0}),
    "hg+dp_tp2_sp": ("hg+dp", 2, True, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_model_matches_reference(case):
    strategy, tp, sp, overrides = CASES[case]
    for out in run_on_ranks(_model_grads, tp, strategy, tp, sp, overrides):
        (loss, grads), (ref_loss, ref_grads) = out["fused"], out["ref"]
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        assert set(grads) == set(ref_grads) and len(grads) >= 9
        for n, g in grads.items():
            # relative to the vector's scale: an OR magnitude / ER alpha gradient is a sum
            # with cancellation, near 0 against its direction's gradient
            owner = n.rsplit(".", 1)[0]
            scale = max(float(r.abs().max()) for k, r in ref_grads.items()
                        if k.rsplit(".", 1)[0] == owner)
            err = float((g - ref_grads[n]).abs().max())
            assert err <= 1e-4 * scale, (case, n, err, scale)


def _saved(rank, world, strategies):
    init_model_parallel()
    config = M.tiny_config()
    b = M.batches(1, 2)[0]
    res = {}
    for s in strategies:
        model = M.build_gpt(config, None if s == "stock" else s)
        res[s] = saved_activation_bytes(
            lambda m=model: m(b["tokens"], b["position_ids"], None, labels=b["labels"]))
        with reference():
            res[s + "@ref"] = saved_activation_bytes(
                lambda m=model: m(b["tokens"], b["position_ids"], None, labels=b["labels"]))
    return res


def test_fold_and_dnp_keep_no_weight_or_norm_input():
    """hg saves what shared saves (+ the vectors): the effective weight is rebuilt in backward;
    the DNP norms add at most the GQA key/value outputs (attention keeps repeated copies)."""
    res = run_on_ranks(_saved, 1, ["shared", "hg", "unified"])[0]
    layers, hidden = 2, 32  # M.tiny_config()
    vectors = 4 * (hidden * 5)  # fp32 input vectors of q, k, v, gate, up (+ their stacks)
    assert res["hg"] <= res["shared"] + layers * 2 * vectors
    assert res["hg@ref"] > res["hg"]  # the autograd fold keeps W_eff
    assert res["unified"] < res["unified@ref"]
    assert res["unified"] <= 1.02 * res["shared"], res


def test_kernel_benchmark_prints_every_kernel_and_ratio(capsys):
    """benchmarks/kernels.py (eager here: compiling its shapes costs more than the test)."""
    import importlib.util as iu  # noqa: PLC0415
    import os  # noqa: PLC0415

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "kernels.py")
    spec = iu.spec_from_file_location("bench_kernels", path)
    tool = iu.module_from_spec(spec)
    spec.loader.exec_module(tool)
    saved = compile.mode()
    try:
        tool.main(["--rounds", "2", "--calls", "1", "--compile", "off"])
    finally:
        compile.set_mode(saved)
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "median" not in line]
    names = [r[0].strip() for r in rows]
    assert names == ["glu stock", "glu dnp", "qkv stock", "qkv dnp", "experts stock",
                     "experts dnp", "experts by row", "experts blocks",
                     *(f"{k} E={e}" for e in (4, 16) for k in ("stack", "fold", "refold"))], names
    ratios = [float(r[3]) for r in rows if r[3].strip()]
    # a ratio of timings of one call: any positive finite value (CI runs another suite beside
    # this one, and a preempted call can take 100x its neighbour's time)
    assert len(ratios) == 9 and all(0 < q < math.inf for q in ratios), rows


def test_glu_norm_keeps_widths_static_for_compile():
    """The GLU norm marks its widths static, forward and backward (dynamo would make every size
    symbolic once the experts' row count changes, a slower kernel); the rows stay free."""
    z = torch.randn(6, 24, requires_grad=True)
    a_g, a_u = torch.ones(12, requires_grad=True), torch.ones(12, requires_grad=True)
    h = glu.glu_norm(z, a_g, a_u, F.silu, gated=True, normalization="RMSNorm", eps=1e-5)
    for t in (z, a_g, a_u):
        assert getattr(t, "_dynamo_static_indices", set()) == {t.dim() - 1}, t.shape
    dh = torch.randn(6, 12)
    h.backward(dh)
    assert getattr(dh, "_dynamo_static_indices", set()) == {1}


def test_reference_swaps_the_package_entry_points_and_restores_them():
    """reference() replaces what the package's call sites read (fused.head_norm,
    fused.qkv_norm, glu.glu_norm, the local linear's weight-mode GEMM) and puts the originals
    back; no module binds the fused functions under its own name (reference() would miss it)."""
    import sys  # noqa: PLC0415

    import megatron_scalevec.layers.grouped  # noqa: F401, PLC0415
    import megatron_scalevec.layers.te_grouped  # noqa: F401, PLC0415
    from megatron_scalevec.layers import linear  # noqa: PLC0415
    from scalevec_testing import reference as R  # noqa: PLC0415

    points = [(fused, "head_norm", R.head_norm), (fused, "qkv_norm", R.qkv_norm),
              (glu, "glu_norm", R.glu_norm),
              (linear.ScaleVecColumnParallelLinear, "_forward_impl", R.linear_forward_impl)]
    originals = [vars(owner)[name] for owner, name, _ in points]
    with reference():
        assert [vars(owner)[name] for owner, name, _ in points] == [r for *_, r in points]
    assert [vars(owner)[name] for owner, name, _ in points] == originals
    fused_functions = {id(f) for f in originals[:3]}
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("megatron_scalevec.") and mod not in (fused, glu):
            bound = [k for k, v in vars(mod).items() if id(v) in fused_functions]
            assert not bound, (mod_name, bound)
