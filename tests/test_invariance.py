"""Under unified (DNP + OR + IWD) the magnitude of every input-side vector feeding a projection
that DNP normalizes is invisible to the model: it gets no gradient (with the norm's epsilon
negligible), while IWD decays it (megatron_scalevec/invariance.py)."""

import math

import pytest

from megatron_scalevec import ScaleVecConfig
from megatron_scalevec.invariance import invariant_magnitudes, steps_until_epsilon, summary_line
from megatron_scalevec.parameterizations import part_decays
from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
           moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2)


def _grads(rank, world, overrides, strategy, sv):
    init_model_parallel()
    config = M.tiny_config(layernorm_epsilon=1e-12, **overrides)  # epsilon out of the way
    model = M.build_gpt(config, ScaleVecConfig.from_string(strategy, **sv))
    M.perturb_vectors(model)
    b = M.batches(1, 2)[0]
    model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean().backward()
    named = dict(model.named_parameters())
    return (invariant_magnitudes(model),
            {n: float(p.grad.abs().max()) for n, p in named.items() if p.grad is not None},
            {n: (p.scalevec_role, p.scalevec_part, part_decays(p)) for n, p in named.items()
             if hasattr(p, "scalevec_part")})


@pytest.mark.parametrize("kind,strategy,sv", [
    ("dense", "unified", {}), ("dense", "hg+dnp+er+iwd", {}),
    ("moe", "unified", {}), ("moe", "unified", dict(expert_vectors="shared")),
    ("moe_grouped", "unified", {}),
])
def test_dnp_input_magnitudes_get_no_gradient_and_decay(kind, strategy, sv):
    overrides = {"dense": {}, "moe": MOE, "moe_grouped": dict(MOE, moe_grouped_gemm=True)}[kind]
    names, grads, parts = run_on_ranks(_grads, 1, overrides, strategy, sv)[0]
    magnitudes = [n for n, (_, part, _) in parts.items() if part in ("magnitude", "alpha")]
    others = [n for n in magnitudes if n not in names]
    assert names and others, (names, magnitudes)
    typical = max(grads[n] for n in others)  # q_norm's, the router's, ...: a real gradient
    for n in names:
        assert grads.get(n, 0.0) <= 1e-6 * typical, (n, grads.get(n), typical)
        role, part, decays = parts[n]
        assert role == "input" and decays, (n, role, part)  # IWD decays it
    assert any(grads[n] > 1e-4 * typical for n in others if "scale_in" in n or "norm" in n)
    assert any(".linear_qkv.scale_in." in n for n in names)
    assert any(".linear_fc1.scale_in." in n or "shared_vectors.scale_in." in n for n in names)


def test_summary_line_says_when_epsilon_matters():
    """lr 3e-3, wd 0.1, eps 1e-5: sqrt(eps) ~ 3.2e-3 after ~19k steps (the issue's figure)."""
    assert steps_until_epsilon(3e-3, 0.1, 1e-5) == pytest.approx(19188, rel=1e-3)
    line = summary_line(["a.magnitude", "b.magnitude"], 3e-3, 0.1, 1e-5, 150)
    assert "2 " in line and "19,188 steps" in line and f"{math.exp(-3e-4 * 150):.3g}" in line
    assert summary_line([], 3e-3, 0.1, 1e-5, 150) == ""
    assert "never" in summary_line(["a.alpha"], 3e-3, 0.0, 1e-5, 150)


def test_without_dnp_nothing_is_invariant():
    names, _, _ = run_on_ranks(_grads, 1, {}, "hg+dp+or+iwd", {})[0]
    assert names == []
