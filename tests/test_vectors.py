"""One scale vector: parameterizations, roles, split statistics equal to unsplit."""

import math

import pytest
import torch

from megatron_scalevec.vectors import ScaleVector, stacked
from scalevec_testing import run_on_ranks


@pytest.mark.parametrize("kind,parts", [("plain", {"weight"}), ("or", {"magnitude", "direction"}),
                                        ("er", {"alpha", "logit"})])
def test_identity_at_init_and_parts(kind, parts):
    vec = ScaleVector(8, kind, role="output")
    assert torch.equal(vec(), torch.ones(8))
    names = {n for n, _ in vec.named_parameters()}
    assert names == parts
    assert all(p.scalevec_role == "output" for p in vec.parameters())


def test_or_is_magnitude_times_direction():
    vec = ScaleVector(4, "or")
    with torch.no_grad():
        vec.direction.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        vec.magnitude.fill_(0.5)
    u = vec.direction
    expect = 0.5 * math.sqrt(4) * u / u.norm()
    assert torch.allclose(vec(), expect)
    with torch.no_grad():
        vec.direction.mul_(7.0)  # direction is scale-invariant
    assert torch.allclose(vec(), expect)


def test_er_is_exp_of_centered_logits():
    vec = ScaleVector(3, "er")
    with torch.no_grad():
        vec.logit.copy_(torch.tensor([0.1, -0.2, 0.4]))
        vec.alpha.fill_(0.3)
    v = vec.logit
    assert torch.allclose(vec(), torch.exp(0.3 + v - v.mean()))


@pytest.mark.parametrize("kind", ["plain", "or", "er"])
def test_set_from_gamma_round_trips(kind):
    vec = ScaleVector(5, kind)
    gamma = torch.tensor([0.5, 1.5, 2.0, 0.25, 1.0])
    vec.set_from_gamma(gamma)
    assert torch.allclose(vec(), gamma, atol=1e-6)


def test_er_refuses_non_positive_gamma():
    with pytest.raises(ValueError, match="gamma > 0"):
        ScaleVector(2, "er").set_from_gamma(torch.tensor([1.0, -1.0]))


def test_bad_role():
    with pytest.raises(ValueError, match="role"):
        ScaleVector(2, "plain", role="middle")


def _split_vs_full(rank, world, kind):
    from megatron.core import parallel_state

    from scalevec_testing import init_model_parallel

    init_model_parallel(tp=2)
    tp = parallel_state.get_tensor_model_parallel_group()
    full_gamma = torch.linspace(0.3, 2.0, 8)
    full = ScaleVector(8, kind)
    full.set_from_gamma(full_gamma)
    part = ScaleVector(4, kind, tp_group=tp, split=True)
    part.set_from_gamma(full_gamma[rank * 4:(rank + 1) * 4])
    # The same loss on both: sum(gamma * w) with w known everywhere.
    w = torch.arange(8.0)
    loss_full = (full() * w).sum()
    loss_full.backward()
    g = part()
    loss_part = (g * w[rank * 4:(rank + 1) * 4]).sum()
    loss_part.backward()
    scalar = {"or": "magnitude", "er": "alpha"}.get(kind)
    out = {"gamma_err": float((g - full()[rank * 4:(rank + 1) * 4]).abs().max())}
    if scalar:
        out["scalar_grad_err"] = float((getattr(part, scalar).grad
                                         - getattr(full, scalar).grad).abs().max())
    return out


@pytest.mark.parametrize("kind", ["or", "er"])
def test_split_vector_equals_unsplit(kind):
    """|u| and mean(v) run over the whole logical vector; the shared scalar gets the whole
    gradient on every rank."""
    for res in run_on_ranks(_split_vs_full, 2, kind):
        assert res["gamma_err"] < 1e-6
        assert res["scalar_grad_err"] < 1e-5


@pytest.mark.parametrize("kind", ["plain", "or", "er"])
def test_computed_once_returns_one_gamma(kind):
    # a plain fp32 gamma is the Parameter itself: computed_once must not register it
    v = ScaleVector(6, kind)
    with v.computed_once():
        first = v()
        assert v() is first and "_once" not in dict(v.named_parameters())
    assert torch.equal(v(), first.detach())


def _vectors(kinds_sizes):
    vecs = [ScaleVector(m, kind) for kind, m in kinds_sizes]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (p for v in vecs for p in v.parameters()):
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return vecs


def test_stacked_equals_one_by_one():
    """Alike vectors stacked (vectors.stacked: grouped experts' per-expert vectors): the same
    stacked and parameter gradients as each vector's own call."""
    for kind in ("plain", "or", "er"):
        vecs = _vectors([(kind, 6)] * 3)
        w = [torch.randn(6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        grads = []
        for batched in (True, False):
            for p in (p for v in vecs for p in v.parameters()):
                p.grad = None
            out = list(stacked(vecs).unbind(0)) if batched else [v() for v in vecs]
            sum((g * wi).sum() for g, wi in zip(out, w)).backward()
            grads.append(([g.detach() for g in out],
                          [p.grad.clone() for v in vecs for p in v.parameters()]))
        (got, got_grad), (want, want_grad) = grads
        for a, b in zip(got + got_grad, want + want_grad):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7 * float(b.abs().max())), (a, b)


def test_values_are_read_through_the_module_call():
    """gamma (``v()``, a norm's ``norm()``) goes through ``__call__``, and ``stacked`` runs the
    vectors' hooks itself before it reads their parameters: megatron-core's DDP hooks wait
    there for an overlapped parameter all-gather (tests/parity/test_overlap.py)."""
    from types import SimpleNamespace

    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.norms import ScaleVecNorm

    v = ScaleVector(6, "or")
    config = SimpleNamespace(params_dtype=torch.float32, normalization="RMSNorm")
    norm = ScaleVecNorm(config, 6, scalevec=ScaleVecConfig.from_string("or"), kind="branch")
    calls = []
    for m in (v, norm):
        m.register_forward_pre_hook(lambda mod, args: calls.append(mod))
    v(), stacked([v, v]), norm()
    assert calls == [v, v, v, norm], calls
