"""The test-only torch stand-ins of Transformer Engine's kernels (scalevec_testing/te_ops.py),
driven through TE's real modules (Linear, LayerNormLinear, GroupedLinear, RMSNorm / LayerNorm) and
checked against plain ``torch.nn.functional``: bias and its gradient, RMSNorm and LayerNorm with and
without zero-centred gamma, bf16, fused wgrad accumulation into ``main_grad``, grouped GEMMs with
uneven (and empty) splits. The stand-in refuses what TE's kernels refuse: mismatched dtypes, a
wrongly shaped ``out``, arguments TE's binding does not take."""


import pytest
import torch
import torch.nn.functional as F

from scalevec_testing import run_on_ranks, te_ops, te_stub
from scalevec_testing.markers import needs_te

pytestmark = needs_te


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _linear(rank, world, dtype, bias):
    te = te_stub.activate()
    torch.manual_seed(0)
    with te_stub.cuda_claimed():
        lin = te.Linear(16, 8, bias=bias, device="cpu", params_dtype=dtype)
        if bias:
            with torch.no_grad():  # TE starts it at zero, where a dropped bias would not show
                lin.bias.normal_()
        x = torch.randn(2, 6, 16, dtype=dtype, requires_grad=True)
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, w = _leaf(x), _leaf(lin.weight)
    b = _leaf(lin.bias) if bias else None
    yr = F.linear(xr.float(), w.float(), None if b is None else b.float()).to(dtype)
    yr.backward(dy)
    pairs = {"y": (y, yr), "dx": (x.grad, xr.grad), "dw": (lin.weight.grad, w.grad)}
    if bias:
        pairs["db"] = (lin.bias.grad, b.grad)
    return {k: _rel(a, r) for k, (a, r) in pairs.items()}, y.dtype


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_matches_torch(dtype, tol, bias):
    rel, out_dtype = run_on_ranks(_linear, 1, dtype, bias)[0]
    assert out_dtype == dtype
    assert set(rel) == ({"y", "dx", "dw", "db"} if bias else {"y", "dx", "dw"})
    assert max(rel.values()) < tol, rel


def _norm_linear(rank, world, normalization, zero_centered):
    te = te_stub.activate()
    torch.manual_seed(1)
    with te_stub.cuda_claimed():
        m = te.LayerNormLinear(16, 8, bias=True, normalization=normalization,
                               zero_centered_gamma=zero_centered, device="cpu",
                               params_dtype=torch.float32)
        with torch.no_grad():  # away from the init, so a dropped +1 or bias shows
            m.layer_norm_weight.normal_(0.1 if zero_centered else 1.0, 0.3)
            m.bias.normal_()
            if normalization == "LayerNorm":
                m.layer_norm_bias.normal_(0.0, 0.3)
        x = torch.randn(6, 16, requires_grad=True)
        y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, g, w, b = (_leaf(t) for t in (x, m.layer_norm_weight, m.weight, m.bias))
    gamma = g + 1.0 if zero_centered else g
    if normalization == "RMSNorm":
        h = F.rms_norm(xr, (16,), gamma, eps=m.eps)
        pairs = {}
    else:
        beta = _leaf(m.layer_norm_bias)
        h = F.layer_norm(xr, (16,), gamma, beta, eps=m.eps)
        pairs = {"d_norm_bias": None}
    yr = F.linear(h, w, b)
    yr.backward(dy)
    if pairs:
        pairs["d_norm_bias"] = (m.layer_norm_bias.grad, beta.grad)
    pairs.update(y=(y, yr), dx=(x.grad, xr.grad), d_gamma=(m.layer_norm_weight.grad, g.grad),
                 dw=(m.weight.grad, w.grad), db=(m.bias.grad, b.grad))
    return {k: _rel(a, r) for k, (a, r) in pairs.items()}


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_layernorm_linear_matches_torch(normalization, zero_centered):
    rel = run_on_ranks(_norm_linear, 1, normalization, zero_centered)[0]
    assert max(rel.values()) < 1e-5, rel


def _fused_wgrad(rank, world):
    te = te_stub.activate()
    torch.manual_seed(2)
    with te_stub.cuda_claimed():
        lin = te.Linear(16, 8, bias=False, device="cpu", params_dtype=torch.float32,
                        fuse_wgrad_accumulation=True)
        lin.weight.main_grad = torch.randn(8, 16)  # what megatron-core's DDP provides
        lin.weight.grad_added_to_main_grad = False
        before = lin.weight.main_grad.clone()
        x = torch.randn(6, 16)
        y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    return _rel(lin.weight.main_grad, before + dy.t() @ x), lin.weight.grad_added_to_main_grad


def test_fused_wgrad_accumulation_adds_into_main_grad():
    rel, flagged = run_on_ranks(_fused_wgrad, 1)[0]
    assert rel < 1e-6 and flagged, (rel, flagged)


def _grouped(rank, world, splits, bias=False):
    te = te_stub.activate()
    torch.manual_seed(3)
    with te_stub.cuda_claimed():
        m = te.GroupedLinear(len(splits), 16, 8, bias=bias, device="cpu",
                             params_dtype=torch.float32)
        if bias:
            with torch.no_grad():
                for i in range(len(splits)):
                    getattr(m, f"bias{i}").normal_()
        x = torch.randn(sum(splits), 16, requires_grad=True)
        y = m(x, list(splits))
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = _leaf(x)
    ws = [_leaf(getattr(m, f"weight{i}")) for i in range(len(splits))]
    bs = [_leaf(getattr(m, f"bias{i}")) if bias else None for i in range(len(splits))]
    yr = torch.cat([F.linear(part, w, b) for part, w, b in zip(xr.split(list(splits)), ws, bs)])
    yr.backward(dy)
    rel = {"y": _rel(y, yr), "dx": _rel(x.grad, xr.grad)}
    for i, w in enumerate(ws):
        got = getattr(m, f"weight{i}").grad
        rel[f"dw{i}"] = 0.0 if splits[i] == 0 and not got.abs().max() else _rel(got, w.grad)
        if bias and splits[i]:
            rel[f"db{i}"] = _rel(getattr(m, f"bias{i}").grad, bs[i].grad)
    return rel


@pytest.mark.parametrize("splits", [(3, 5, 2), (4, 0, 3)], ids=["uneven", "empty_group"])
def test_grouped_linear_matches_torch(splits):
    rel = run_on_ranks(_grouped, 1, splits)[0]
    assert max(rel.values()) < 1e-5, rel


def _norm(rank, world, normalization, zero_centered):
    te = te_stub.activate()
    torch.manual_seed(4)
    with te_stub.cuda_claimed():
        cls = te.RMSNorm if normalization == "RMSNorm" else te.LayerNorm
        m = cls(16, eps=1e-5, zero_centered_gamma=zero_centered, device="cpu")
        with torch.no_grad():
            m.weight.normal_(0.1 if zero_centered else 1.0, 0.3)
        x = torch.randn(5, 16, requires_grad=True)
        y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr, g = _leaf(x), _leaf(m.weight)
    gamma = g + 1.0 if zero_centered else g
    if normalization == "RMSNorm":
        yr = F.rms_norm(xr, (16,), gamma, eps=1e-5)
    else:
        yr = F.layer_norm(xr, (16,), gamma, _leaf(m.bias), eps=1e-5)
    yr.backward(dy)
    return {"y": _rel(y, yr), "dx": _rel(x.grad, xr.grad), "dg": _rel(m.weight.grad, g.grad)}


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_norm_modules_match_torch(normalization, zero_centered):
    rel = run_on_ranks(_norm, 1, normalization, zero_centered)[0]
    assert max(rel.values()) < 1e-5, rel


def _gemm(A, B, out=None, **kw):
    """te_ops.generic_gemm as TE's gemm.py calls it (TN: out = B @ A^T)."""
    args = dict(out=out, quantizer=None, out_dtype=None, bias=None, bias_type=None, gelu=False,
                gelu_in=None, grad=False, workspace=None, workspace_size=0, accumulate=False,
                use_split_accumulator=False)
    args.update(kw)
    return te_ops.generic_gemm(A, True, B, False, **args)


def test_stand_in_refuses_what_te_refuses():
    w, x = torch.randn(8, 16), torch.randn(6, 16)
    assert torch.allclose(_gemm(w, x)[0], x @ w.t())
    with pytest.raises(TypeError, match="bf16 and fp32|dtype"):
        _gemm(w, x.bfloat16())
    with pytest.raises(ValueError, match="out"):
        _gemm(w, x, out=torch.empty(8, 6))  # the same size, the wrong shape
    with pytest.raises(TypeError):
        _gemm(w, x, not_an_argument=True)
    with pytest.raises(NotImplementedError, match="gelu"):
        _gemm(w, x, gelu=True)


def test_grouped_linear_with_bias_matches_torch():
    rel = run_on_ranks(_grouped, 1, (3, 5, 2), True)[0]
    assert max(rel.values()) < 1e-5 and "db1" in rel, rel


def _fused_softmax(rank, world, masked):
    te_stub.activate()
    from transformer_engine.pytorch.attention.dot_product_attention.softmax import (
        FusedScaleMaskSoftmax,
    )

    torch.manual_seed(0)
    b, heads, sq, sk, scale = 2, 2, 32, 32, 0.3
    mask = torch.rand(b, 1, sq, sk) < 0.3 if masked else None
    softmax = FusedScaleMaskSoftmax(lambda x, m: x.masked_fill(m, -10000.0))
    x = torch.randn(b, heads, sq, sk, dtype=torch.bfloat16, requires_grad=True)
    te_ops.CALLS.clear()
    with te_stub.cuda_claimed():
        y = softmax(x, mask, "padding" if masked else "no_mask", scale)
    dy = torch.randn_like(y)
    y.backward(dy)
    xr = _leaf(x.float())
    scores = xr * scale
    if masked:
        scores = scores.masked_fill(mask, -10000.0)
    ref = F.softmax(scores, -1)
    ref.backward(dy.float())
    return dict(te_ops.CALLS), _rel(y, ref), _rel(x.grad, xr.grad)


@pytest.mark.parametrize("masked", [True, False], ids=["masked", "no_mask"])
def test_fused_softmax_matches_torch(masked):
    """TE's fused scale-mask-softmax (what its unfused attention calls for bf16 scores) against
    torch's softmax in fp32, forward and backward, through TE's own module."""
    calls, fwd, bwd = run_on_ranks(_fused_softmax, 1, masked)[0]
    kind = "scaled_masked_softmax" if masked else "scaled_softmax"
    assert calls.get(f"{kind}_forward") == 1 and calls.get(f"{kind}_backward") == 1, calls
    assert fwd < 1e-2 and bwd < 2e-2, (fwd, bwd)
