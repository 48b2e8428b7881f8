"""megatron_scalevec/norms.py on its own, against plain torch (never against itself).

Checked: ``normalize`` with ``group=None`` against ``F.rms_norm`` / ``F.layer_norm``;
``ScaleVecNorm`` (one process, no model parallelism; once built by megatron-core's parallel
state at size 1 in a forked gloo rank): its output gamma * N(x) against
``F.rms_norm(x, (h,), gamma)`` / ``F.layer_norm(x, (h,), gamma)``, the gradients of x and of
the vector's parameters against torch autograd of that reference, with gamma written out here
for each parameterization of SPEC.md (plain ``w``, OR ``beta * sqrt(m) * u / |u|``, ER
``exp(alpha + v - mean(v))``); no vector (``hg`` Pre-Norm, ``none``) gives N(x) alone.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.norms import ScaleVecNorm, normalize
from scalevec_testing import init_model_parallel, oracles, run_on_ranks

EPS = 1e-5
H = 16


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 1.5 + 0.25


def _reference(x, gamma, normalization):
    if normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), gamma, eps=EPS)
    return F.layer_norm(x, (x.shape[-1],), gamma, eps=EPS)


def _norm(parameterization="plain", normalization="RMSNorm", kind="branch", **variant):
    config = SimpleNamespace(params_dtype=torch.float32, normalization=normalization)
    scalevec = ScaleVecConfig(parameterization=parameterization, **variant)
    return ScaleVecNorm(config, H, EPS, scalevec=scalevec, kind=kind)


def _formula(parameterization, p):
    """gamma from leaf copies ``p`` of the parameters, as SPEC.md writes it."""
    assert {"plain": "weight", "or": "direction", "er": "logit"}[parameterization] in p
    return oracles.gamma(p)


def _randomize(norm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=g))


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_normalize_without_group_matches_torch(normalization):
    x = _x(3, 4, H).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    up = _x(3, 4, H, seed=1)
    y = normalize(x, normalization, EPS)
    ref = _reference(ref_x, None, normalization)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("parameterization", ["plain", "or", "er"])
def test_scaled_norm_value_and_grads(parameterization, normalization):
    norm = _norm(parameterization, normalization)
    _randomize(norm, seed=2)
    leaves = {n: p.detach().clone().requires_grad_() for n, p in norm.named_parameters()}
    gamma = _formula(parameterization, leaves)
    # the vector's value is the formula
    torch.testing.assert_close(norm(), gamma.detach(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(gamma, torch.ones(H))  # a real test: gamma is not the init 1
    x = _x(2, 5, H, seed=3).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    up = _x(2, 5, H, seed=4)
    y = norm(x)
    ref = _reference(ref_x, gamma, normalization)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)
    for name, p in norm.named_parameters():
        torch.testing.assert_close(p.grad, leaves[name].grad, rtol=1e-4, atol=1e-5)


def test_bf16_input_bf16_output():
    norm = _norm("or")
    _randomize(norm, seed=5)
    x = _x(4, H, seed=6).to(torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    ref = _reference(x.float(), norm().detach(), "RMSNorm").to(torch.bfloat16)
    torch.testing.assert_close(y, ref, rtol=0, atol=0.02)


@pytest.mark.parametrize("kind,variant", [("pre", {"hg": True}), ("final", {"vectors": False}),
                                          ("branch", {"vectors": False})])
def test_no_vector_is_plain_normalization(kind, variant):
    norm = _norm(kind=kind, **variant)
    assert norm() is None and not list(norm.parameters())
    x = _x(3, H, seed=7)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (H,), eps=EPS), rtol=1e-5, atol=1e-5)


def test_bad_kind_and_normalization():
    with pytest.raises(ValueError, match="kind"):
        _norm(kind="middle")
    with pytest.raises(ValueError, match="RMSNorm or LayerNorm"):
        _norm(normalization="BatchNorm")


def _pre_norm_in_rank(rank, world):
    init_model_parallel()
    norm = _norm("er", kind="pre")
    _randomize(norm, seed=8)
    leaves = {n: p.detach().clone().requires_grad_() for n, p in norm.named_parameters()}
    x = _x(6, H, seed=9).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    y, ref = norm(x), _reference(ref_x, _formula("er", leaves), "RMSNorm")
    y.sum().backward()
    ref.sum().backward()
    errs = [(y - ref).abs().max(), (x.grad - ref_x.grad).abs().max()]
    errs += [(p.grad - leaves[n].grad).abs().max() for n, p in norm.named_parameters()]
    return [float(e) for e in errs], norm.split_group is None and norm.grad_group is None


def test_pre_norm_under_megatron_parallel_state_size_1():
    """kind='pre' placed through sharding.placement with megatron's (size 1) TP group."""
    (errs, unsplit), = run_on_ranks(_pre_norm_in_rank, 1)
    assert unsplit
    assert max(errs) < 1e-4, errs


@pytest.mark.parametrize("kind,parameterization", [("pre", "plain"), ("final", "or"),
                                                   ("qk", "er")])
def test_layernorm_bias_of_the_norms_stock_has(kind, parameterization):
    """LayerNorm's bias on the norms megatron-core has (Pre-Norm, final, QK-norm):
    ``gamma * N(x) + beta``, against ``F.layer_norm(x, (h,), gamma, beta)``, with the bias's
    gradient; RMSNorm, DNP's branch norms and ``layernorm_bias='none'`` have none."""
    norm = _norm(parameterization, "LayerNorm", kind=kind)
    assert norm.bias is not None and not hasattr(norm.bias, "scalevec_role")
    _randomize(norm, seed=8)
    leaves = {n: p.detach().clone().requires_grad_() for n, p in norm.named_parameters()}
    gamma = _formula(parameterization, leaves)
    x = _x(3, 2, H, seed=9).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    up = _x(3, 2, H, seed=10)
    y = norm(x)
    ref = F.layer_norm(ref_x, (H,), gamma, leaves["bias"], eps=EPS)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)
    for name, p in norm.named_parameters():
        torch.testing.assert_close(p.grad, leaves[name].grad, rtol=1e-4, atol=1e-5)
    assert _norm(parameterization, "RMSNorm", kind=kind).bias is None
    assert _norm(parameterization, "LayerNorm", kind="branch").bias is None
    assert _norm(parameterization, "LayerNorm", kind=kind, layernorm_bias="none").bias is None
    hg = _norm("plain", "LayerNorm", kind="pre", hg=True)  # HG: N(x) + beta, no vector
    assert hg() is None and [n for n, _ in hg.named_parameters()] == ["bias"]
