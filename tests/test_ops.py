"""megatron_scalevec/ops.py on its own, against plain torch (never against itself).

Checked: ``normalize`` (RMSNorm, LayerNorm) against ``F.rms_norm`` / ``F.layer_norm`` without a
weight, values and the gradient torch autograd gives; ``row_stats`` against the mean and
1/sqrt(var + eps) written out, per part; ``scale_free_grad`` against autograd's dL/dx; a width
split in two (two shards simulated in one process: each shard's ``reduce`` adds the other
half's row sums) equal to the unsplit result, values and gradients; float32 statistics and
output for bfloat16 input; ``is_layer_norm``'s answers and its one error.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_scalevec import ops

EPS = 1e-5
NORMS = ["RMSNorm", "LayerNorm"]


def _x(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2 + 0.5).to(dtype)


def _torch_norm(x, normalization):
    """The plain-torch reference: N(x) over the last dim, no weight."""
    h = x.shape[-1]
    if normalization == "RMSNorm":
        return F.rms_norm(x, (h,), eps=EPS)
    return F.layer_norm(x, (h,), eps=EPS)


def test_is_layer_norm():
    assert ops.is_layer_norm("LayerNorm") is True
    assert ops.is_layer_norm("RMSNorm") is False
    with pytest.raises(ValueError, match="RMSNorm or LayerNorm"):
        ops.is_layer_norm("BatchNorm")


@pytest.mark.parametrize("normalization", NORMS)
def test_normalize_value_and_grad_match_torch(normalization):
    x = _x(3, 5, 16).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    upstream = _x(3, 5, 16, seed=1)
    y = ops.normalize(x, normalization, EPS)
    ref = _torch_norm(ref_x, normalization)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)


def test_row_stats_per_part_written_out():
    """Two parts (a GLU's gate and up) get one column of statistics each."""
    a, b = _x(4, 8, seed=2), _x(4, 8, seed=3)
    mean, rstd = ops.row_stats([a, b], layer=True, eps=EPS, n=8)
    assert mean.shape == rstd.shape == (4, 2)
    for i, p in enumerate((a, b)):
        torch.testing.assert_close(mean[:, i], p.mean(-1))
        torch.testing.assert_close(rstd[:, i], 1 / torch.sqrt(p.var(-1, unbiased=False) + EPS))
        torch.testing.assert_close(ops.scale_free(p, mean, rstd, i), F.layer_norm(p, (8,), eps=EPS),
                                   rtol=1e-5, atol=1e-5)
    none, rstd = ops.row_stats([a], layer=False, eps=EPS, n=8)
    assert none is None
    torch.testing.assert_close(rstd[:, 0], 1 / torch.sqrt(a.pow(2).mean(-1) + EPS))


@pytest.mark.parametrize("normalization", NORMS)
def test_scale_free_grad_matches_autograd(normalization):
    x = _x(6, 12, seed=4).requires_grad_()
    g = _x(6, 12, seed=5)
    (_torch_norm(x, normalization) * g).sum().backward()
    layer = normalization == "LayerNorm"
    mean, rstd = ops.row_stats([x.detach()], layer, EPS, 12)
    xhat = ops.scale_free(x.detach(), mean, rstd)
    dot = (g * xhat).mean(-1, keepdim=True)
    mean_g = g.mean(-1, keepdim=True) if layer else None
    dx = ops.scale_free_grad(g, xhat, rstd, dot, mean_g)
    torch.testing.assert_close(dx, x.grad, rtol=1e-4, atol=1e-5)


class _OtherHalf:
    """``reduce`` for one shard of a width split in two: adds the other shard's partial row
    sums, as an all-reduce over two ranks would. The first call of a LayerNorm carries the
    row sums (the mean then follows); the next the squares about that mean."""

    def __init__(self, other, n, layer):
        self.other, self.n, self.layer, self.mean = other, n, layer, None

    def __call__(self, t):
        o = self.other.float()
        if self.layer and self.mean is None:
            total = t + o.sum(-1, keepdim=True)
            self.mean = total / self.n
            return total
        if self.mean is not None:
            o = o - self.mean
        return t + o.pow(2).sum(-1, keepdim=True)


@pytest.mark.parametrize("normalization", NORMS)
def test_split_width_equals_unsplit(normalization):
    x = _x(5, 16, seed=6).requires_grad_()
    upstream = _x(5, 16, seed=7)
    layer = normalization == "LayerNorm"
    left, right = x[..., :8], x[..., 8:]
    shards = [ops.normalize(left, normalization, EPS, 16, _OtherHalf(right, 16, layer)),
              ops.normalize(right, normalization, EPS, 16, _OtherHalf(left, 16, layer))]
    y = torch.cat(shards, -1)
    ref_x = x.detach().clone().requires_grad_()
    ref = _torch_norm(ref_x, normalization)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # without the other half's sums, a shard's statistics are its own: not the unsplit ones
    alone = ops.normalize(left.detach(), normalization, EPS, 16)
    assert (alone - ref[..., :8].detach()).abs().max() > 1e-2
    (y * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("normalization", NORMS)
def test_bf16_input_gets_fp32_statistics(normalization):
    """bf16 in, float32 statistics and N(x) out: equal to float32 math on the same values
    (bf16-representable), where statistics kept in bf16 would be off by ~1e-3."""
    x = _x(4, 1024, seed=8, dtype=torch.bfloat16) + 3
    layer = normalization == "LayerNorm"
    mean, rstd = ops.row_stats([x], layer, EPS, 1024)
    assert rstd.dtype == torch.float32 and (mean is None or mean.dtype == torch.float32)
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True) if layer else xf
    want = 1 / torch.sqrt(centred.pow(2).mean(-1) + EPS)
    assert float(((rstd[:, 0] - want) / want).abs().max()) < 1e-6
    xc = x - x.mean(-1, keepdim=True) if layer else x  # the same statistics in bf16
    in_bf16 = torch.rsqrt(xc.pow(2).mean(-1) + EPS).float()
    assert float(((in_bf16 - want) / want).abs().max()) > 1e-4
    y = ops.normalize(x, normalization, EPS)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, _torch_norm(xf, normalization), rtol=1e-5, atol=1e-5)
