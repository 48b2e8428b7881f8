"""FP8 emulation (evidence/fp8.py) against hand-computed cases, and the placements' algebra."""

import pytest
import torch

from evidence import fp8, fp8_run

E4 = fp8.Scaling("e4m3")
E5 = fp8.Scaling("e5m2")


def test_e4m3_rounding_of_known_values():
    # amax 448 -> scale 1: the values are rounded to E4M3 as they are (3 mantissa bits,
    # round to nearest even, subnormals down to 2^-9).
    x = torch.tensor([448.0, 1.0625, 1.1875, 0.3, 2.0 ** -10, 1.5 * 2.0 ** -10, -17.0, 20.0])
    want = torch.tensor([448.0, 1.0, 1.25, 0.3125, 0.0, 2.0 ** -9, -16.0, 20.0])
    assert torch.equal(fp8.fake_quant(x, E4), want)


def test_e5m2_rounding_of_known_values():
    x = torch.tensor([57344.0, 1.125, 1.375, 3.0, -0.3])
    want = torch.tensor([57344.0, 1.0, 1.5, 3.0, -0.3125])
    assert torch.equal(fp8.fake_quant(x, E5), want)


def test_current_scale_is_max_over_amax():
    x = torch.tensor([3.0, 0.1, 0.0])
    q, inv = fp8.quantize(x, E4)
    assert float(1 / inv) == pytest.approx(448.0 / 3.0, rel=1e-7)
    # 0.1 * 448/3 = 14.93 -> 15 (step 1 in [8, 16)); 3 -> 448
    assert q.float().tolist() == [448.0, 15.0, 0.0]
    assert fp8.fake_quant(x, E4)[1].item() == pytest.approx(15 * 3.0 / 448.0, rel=1e-6)
    # power-of-two scale: 448/3 -> 128; 0.1 * 128 = 12.8 -> 13, dequantized 13/128 exactly
    got = fp8.fake_quant(x, fp8.Scaling("e4m3", pow2=True))
    assert got.tolist() == [3.0, 13 / 128, 0.0]
    # all zeros: scale 1, nothing divided by zero
    assert torch.equal(fp8.fake_quant(torch.zeros(4), E4), torch.zeros(4))
    # a shared amax smaller than the tensor's own: values saturate at the format's max
    q, inv = fp8.quantize(torch.tensor([1.0, 4.0]), E4, amax=torch.tensor(2.0))
    assert q.float().tolist() == [224.0, 448.0]
    # E5M2 has infinities: without saturation 4 * 57344/2 would become inf
    q, _ = fp8.quantize(torch.tensor([1.0, -4.0]), E5, amax=torch.tensor(2.0))
    assert q.float().tolist() == [28672.0, -57344.0]


def test_blockwise_1x128_scales_per_block():
    x = torch.full((2, 256), 0.5)
    x[0, :128] = 1.0
    x[0, 128:] = 4.0
    x[0, 200] = -4.0
    _, inv = fp8.quantize(x, fp8.Scaling("e4m3", (1, 128), pow2=True))
    # 448/1 -> 256, 448/4 = 112 -> 64, 448/0.5 = 896 -> 512
    assert torch.equal(inv[0, :128], torch.full((128,), 1 / 256))
    assert torch.equal(inv[0, 128:], torch.full((128,), 1 / 64))
    assert torch.equal(inv[1], torch.full((256,), 1 / 512))
    # a partial edge block has its own amax
    y = torch.ones(1, 130)
    y[0, 129] = 8.0
    _, inv = fp8.quantize(y, fp8.Scaling("e4m3", (1, 128)))
    assert inv[0, 0].item() == pytest.approx(1 / 448) and inv[0, 128].item() == \
        pytest.approx(8 / 448)


def test_blockwise_128x128_and_columnwise():
    w = torch.ones(256, 256)
    w[130, 5] = 16.0  # block (1, 0)
    _, inv = fp8.quantize(w, fp8.Scaling("e4m3", (128, 128), pow2=True))
    assert torch.equal(inv[128:, :128], torch.full((128, 128), 1 / 16))  # 448/16 = 28 -> 16
    assert torch.equal(inv[:128], torch.full((128, 256), 1 / 256))
    assert torch.equal(inv[128:, 128:], torch.full((128, 128), 1 / 256))
    _, inv = fp8.quantize(w, fp8.Scaling("e4m3", (128, 1), pow2=True))  # wgrad: along tokens
    assert inv[0, 5].item() == 1 / 256 and inv[200, 5].item() == 1 / 16
    assert inv[200, 6].item() == 1 / 256


def _scaled_mm_or_skip(*args, **kwargs):
    try:
        return torch._scaled_mm(*args, **kwargs)
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"torch._scaled_mm unavailable here: {e}")


def test_emulated_gemm_equals_scaled_mm_tensorwise_and_rowwise():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g), torch.randn(24, 64, generator=g) * 0.02
    for sa_, sb_ in ((E4, E4), (fp8.Scaling("e4m3", (1, 64)), fp8.Scaling("e4m3", (1, 64)))):
        qa, ia = fp8.quantize(a, sa_)
        qb, ib = fp8.quantize(b, sb_)
        rowwise = sa_.block is not None
        scale_a = ia[:, :1].contiguous() if rowwise else ia.reshape(())
        scale_b = ib[:, :1].t().contiguous() if rowwise else ib.reshape(())
        got = _scaled_mm_or_skip(qa, qb.t(), scale_a=scale_a, scale_b=scale_b,
                                 out_dtype=torch.float32)
        ref = fp8.fake_quant(a, sa_) @ fp8.fake_quant(b, sb_).t()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _fused(seed=0, shared=False):
    g = torch.Generator().manual_seed(seed)
    groups, rows, inn = 2, 8, 128
    slots = ["q", "q", "k", "v"]
    w = torch.randn(groups * len(slots) * rows, inn, generator=g) * 0.02
    if shared:
        gin = (1 + 0.3 * torch.randn(inn, generator=g)).expand(4, inn).clone()
        gout = torch.ones(4, rows)
    else:
        per = {b: 1 + 0.3 * torch.randn(inn, generator=g) for b in "qkv"}
        gin = torch.stack([per[b] for b in slots])
        outs = {b: 1 + 0.2 * torch.randn(rows, generator=g) for b in "qkv"}
        gout = torch.stack([outs[b] for b in slots])
    fb = fp8.FusedBranches(w, slots, groups, rows, gin, gout)
    n = torch.randn(64, inn, generator=g)
    dy = torch.randn(64, w.shape[0], generator=g)
    return fb, n, dy


def test_every_placement_is_the_same_function_in_fp32():
    fb, n, dy = _fused()
    ref = fp8.run_placement(fb, n, dy, "stock", None)
    # against the plain formula: y = a * (W_b (gamma_b * n)), dW by autograd
    w = fb.weight.clone().requires_grad_(True)
    y = (n[:, None, :] * fb.expand_in()[None] * w[None]).sum(-1) * fb.expand_out()[:, 0]
    y.backward(dy)
    torch.testing.assert_close(ref["y"], y.detach(), rtol=1e-5, atol=1e-6)
    assert fp8.rel_err(ref["dw"], w.grad) < 1e-6
    for p in fp8.PLACEMENTS:
        got = fp8.run_placement(fb, n, dy, p, None)
        for k in ("y", "dn", "dw"):
            assert fp8.rel_err(got[k], ref[k]) < 1e-5, (p, k)


def test_split_common_gamma_hand_case():
    common, ratios = fp8.split_common_gamma(torch.tensor([[1.0, 2.0, 1.0], [3.0, 2.0, -1.0]]))
    assert common.tolist() == [2.0, 2.0, 1.0]  # a zero mean falls back to 1
    assert ratios.tolist() == [[0.5, 1.0, 1.0], [1.5, 1.0, -1.0]]
    _, ones = fp8.split_common_gamma(torch.tensor([[0.7, 1.3]] * 3))
    assert torch.equal(ones, torch.ones(3, 2))
    with pytest.raises(ValueError, match="branches, width"):
        fp8.split_common_gamma(torch.ones(3))


def test_mean_kept_is_exactly_stock_for_one_vector():
    fb, n, dy = _fused(shared=True)
    rec = fp8.recipe("tensorwise")
    a = fp8.run_placement(fb, n, dy, "stock", rec)
    b = fp8.run_placement(fb, n, dy, "mean_kept", rec)
    assert torch.equal(a["y"], b["y"])  # same quantized operands, same GEMM
    # the backward GEMMs differ only in how rows are batched (summation order)
    assert fp8.rel_err(b["dw"], a["dw"]) < 1e-6 and fp8.rel_err(b["dn"], a["dn"]) < 1e-6


def test_stock_shares_one_activation_scale_branch_does_not():
    fb, n, dy = _fused()
    fb.gin = torch.stack([torch.full((128,), v) for v in (1.0, 1.0, 0.37, 0.5)])  # q, q, k, v
    fb.gout = torch.ones_like(fb.gout)
    rec = fp8.recipe("tensorwise")
    stock = fp8.run_placement(fb, n, dy, "stock", rec)["y"]
    branch = fp8.run_placement(fb, n, dy, "branch", rec)["y"]
    q, k = fb.rows_of("q"), fb.rows_of("k")
    qw = fp8.fake_quant(fb.weight, E4)
    # stock: k's activation 0.37 * n is quantized with the module's scale (amax of q's n)
    want_k = fp8.fake_quant(0.37 * n, E4, amax=n.abs().amax()) @ qw[k].t()
    assert torch.equal(stock[:, k], want_k)
    assert torch.equal(branch[:, k], fp8.fake_quant(0.37 * n, E4) @ qw[k].t())
    assert torch.equal(stock[:, q], branch[:, q]) and not torch.equal(stock[:, k], branch[:, k])


def test_fp8_errors_are_fp8_sized():
    fb, n, dy = _fused()
    rows = fp8.measure(fb, n, dy, [fp8.recipe("tensorwise"), fp8.recipe("blockwise")])
    assert len(rows) == 2 * len(fp8.PLACEMENTS) * 3
    for r in rows:
        assert 0.005 < r["fwd"] < 0.1 and 0.01 < r["dgrad"] < 0.2 and 0.01 < r["wgrad"] < 0.2


def test_fake_quant_linear_forward_and_backward():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, generator=g, requires_grad=True)
    w = (torch.randn(16, 32, generator=g) * 0.1).requires_grad_(True)
    rec = fp8.recipe("tensorwise")
    y = fp8.fake_quant_linear(x, w, rec)
    x2 = x.detach().reshape(-1, 32)
    torch.testing.assert_close(y.reshape(-1, 16), fp8.fake_quant(x2, E4) @ fp8.fake_quant(
        w.detach(), E4).t())
    dy = torch.randn(4, 3, 16, generator=g)
    y.backward(dy)
    g2 = dy.reshape(-1, 16)
    torch.testing.assert_close(x.grad.reshape(-1, 32),
                               fp8.fake_quant(g2, E5) @ fp8.fake_quant(w.detach(), E4))
    torch.testing.assert_close(w.grad, fp8.fake_quant(g2, E5).t() @ fp8.fake_quant(x2, E4))


def test_perturb_keeps_one_vector_one_vector():
    fb, _, _ = _fused(shared=True)
    p = fp8_run.perturb(fb, 1.0, 0)
    assert torch.equal(p.gin, p.gin[0].expand_as(p.gin)) and not torch.equal(p.gin, fb.gin)
    fb2, _, _ = _fused()
    p2 = fp8_run.perturb(fb2, 1.0, 0)
    assert torch.equal(p2.gin[0], p2.gin[1])  # the two q slots stay one branch
    assert fp8_run.perturb(fb2, 0.0, 0) is fb2


def test_bad_recipe_and_placement_fail_clearly():
    with pytest.raises(ValueError, match="tensorwise"):
        fp8.recipe("delayed")
    fb, n, dy = _fused()
    with pytest.raises(ValueError, match="placement"):
        fp8.run_placement(fb, n, dy, "sideways", None)


def test_report_flags_folding_above_1_5x_and_loss_gap():
    from evidence import fp8_report

    def rows(folded):
        out = []
        for p, e in (("stock", 0.02), ("branch", 0.02), ("folded", folded), ("mean_kept", 0.02)):
            out.append(dict(variant="hg", sigma=0.0, layer=0, module="decoder.layers.0.x",
                            branch="q", recipe="tensorwise", placement=p, fwd=e, dgrad=e,
                            wgrad=e))
        return out

    assert fp8_run.loss_gap([1.0, 1.1, 1.5, 1.6], [1.0, 1.0, 1.0, 1.0], 2) == \
        pytest.approx((0.05, 0.55))
    md, flag = fp8_report.report(rows(0.025), {"hg": dict(std=0.1, min=0.5, max=1.5)}, {}, None)
    assert not flag and "| hg | tensorwise | q | 0.0200" in md
    _, flag = fp8_report.report(rows(0.031), {}, {}, None)
    assert flag
    growing = {"unified": dict(fp32=[5.0] * 40, fp8=[5.0] * 20 + [5.1] * 20, seconds=1.0)}
    _, flag = fp8_report.report(rows(0.02), {}, growing, None)
    assert flag
