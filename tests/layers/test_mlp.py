"""megatron_scalevec/layers/mlp.py on its own: one ScaleVecMLP, built directly under
megatron's parallel state in forked gloo ranks, against an MLP written here in plain torch.

The reference: ``[gate | up] = x W_1^T``, ``h = act(a_g * N(gate)) * (a_u * N(up))``
(``act(a_u * N(up))`` when not gated) with ``N`` = ``F.rms_norm`` / ``F.layer_norm`` without
weight over the whole FFN width, each ``a`` from its parameters by SPEC.md's formula over the
whole vector, ``h`` times a per-token scale where given, ``y = h W_2^T``; without DNP no norm
(megatron-core's MLP). Checked: output and the gradients of the input, both weights and every
vector parameter; at TP=2 (each rank a slice of gate and up; the norm's statistics and OR's
``|u|`` over the whole width) against the whole reference; the refusals.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers import ScaleVecColumnParallelLinear, ScaleVecMLP
from scalevec_testing import gather_full_tensor, init_model_parallel, oracles, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.compare import rand as _rand
from scalevec_testing.compare import rel as _rel

HIDDEN, FFN = 32, 64  # M.tiny_config()
TOKENS = 10
EPS = 1e-5
REL = 1e-5


def _build(strategy, **overrides):
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = M.tiny_config(layernorm_epsilon=EPS, **overrides)
    scalevec = ScaleVecConfig.from_string(strategy)
    fc1 = ModuleSpec(module=ScaleVecColumnParallelLinear,
                     params={"scalevec": scalevec, "branches": "fc1"})
    mlp = ScaleVecMLP(cfg, MLPSubmodules(linear_fc1=fc1, linear_fc2=RowParallelLinear),
                      scalevec=scalevec)
    rank = dist.get_rank()
    with torch.no_grad():  # the norm vectors away from 1; a split one by its global entries
        for i, (name, p) in enumerate(sorted(mlp.named_parameters())):
            if "_norm." in name:
                whole = _rand(p.numel() * dist.get_world_size(), seed=60 + i)
                local = whole.view(-1, p.numel())[rank] if p.numel() > 1 else whole[:1]
                p.add_(0.3 * local)
    return mlp


def _n(t, normalization):
    return oracles.normalize(t, normalization, EPS)


def _gamma(leaves, prefix):
    """SPEC.md's gamma of one norm's vector from leaf copies of its (whole) parameters."""
    return oracles.gamma({n[len(prefix):]: t for n, t in leaves.items() if n.startswith(prefix)})


def _reference(x, leaves, act, gated, dnp, normalization, per_token_scale):
    """The MLP in plain torch from the whole weights (``fc1`` rows: gate then up)."""
    z = x @ leaves["fc1"].t()
    gate, up = z.chunk(2, -1) if gated else (None, z)
    if dnp:
        up = _n(up, normalization) * _gamma(leaves, "up_norm.")
        if gated:
            gate = _n(gate, normalization) * _gamma(leaves, "gate_norm.")
    h = act(gate) * up if gated else act(up)
    if per_token_scale is not None:
        h = h * per_token_scale[:, None]
    return h @ leaves["fc2"].t()


def _whole(mlp, tp, gated):
    """Leaf copies of the whole parameters: fc1 as [gate; up] over every rank's slice (each
    rank's local rows are its gate then its up columns), fc2's columns, split vectors
    gathered; with each parameter's way back to this rank's slice."""
    params = dict(mlp.named_parameters())
    world, rank = dist.get_world_size(tp), dist.get_rank(tp)
    halves = [gather_full_tensor(h, 0, tp).view(world, -1, HIDDEN)
              for h in params["linear_fc1.weight"].chunk(2 if gated else 1, 0)]
    leaves = {"fc1": torch.cat([h.flatten(0, 1) for h in halves]),
              "fc2": gather_full_tensor(params["linear_fc2.weight"], 1, tp)}
    back = {"linear_fc1.weight": lambda g: torch.cat(
                [h.view(world, -1, HIDDEN)[rank] for h in g["fc1"].chunk(len(halves), 0)]),
            "linear_fc2.weight": lambda g: g["fc2"].chunk(world, 1)[rank]}
    for name, p in params.items():
        if "_norm." not in name:
            continue
        split = p.numel() > 1 and world > 1
        leaves[name] = gather_full_tensor(p, 0, tp) if split else p.detach().clone()
        back[name] = (lambda g, n=name: g[n].chunk(world, 0)[rank]) if split else \
            (lambda g, n=name: g[n])
    return {n: t.requires_grad_() for n, t in leaves.items()}, back


def _run(rank, world, strategy, normalization, gated, scaled):
    from megatron.core import parallel_state

    init_model_parallel(tp=world)
    tp = parallel_state.get_tensor_model_parallel_group()
    act = F.silu if gated else F.gelu
    mlp = _build(strategy, normalization=normalization, gated_linear_unit=gated,
                 activation_func=act)
    leaves, back = _whole(mlp, tp, gated)
    x = _rand(TOKENS, HIDDEN, seed=1).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    per_token = 0.5 + _rand(TOKENS, seed=2).abs() if scaled else None
    y, bias = mlp(x, per_token_scale=per_token)
    ref = _reference(ref_x, leaves, act, gated, mlp.up_norm is not None, normalization,
                     per_token)
    assert bias is None
    up = _rand(*ref.shape, seed=3)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    grads = {n: t.grad for n, t in leaves.items()}
    errs = {"out": _rel(y, ref), "dx": _rel(x.grad, ref_x.grad)}
    for name, p in mlp.named_parameters():
        errs[name] = _rel(p.grad, back[name](grads))
    norms = [n for n in ("gate_norm", "up_norm") if getattr(mlp, n) is not None]
    return norms, errs


CASES = {  # name: (strategy, normalization, gated, per-token scale, norms built)
    "dnp_swiglu": ("dnp", "RMSNorm", True, False, ["gate_norm", "up_norm"]),
    "dnp+er_layernorm": ("dnp+er", "LayerNorm", True, False, ["gate_norm", "up_norm"]),
    "dnp_not_gated": ("dnp", "RMSNorm", False, False, ["up_norm"]),
    "dnp_per_token_scale": ("dnp", "RMSNorm", True, True, ["gate_norm", "up_norm"]),
    "shared_is_megatrons_mlp": ("shared", "RMSNorm", True, True, []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mlp_matches_plain_torch_mlp(case):
    strategy, normalization, gated, scaled, norms = CASES[case]
    (built, errs), = run_on_ranks(_run, 1, strategy, normalization, gated, scaled)
    assert built == norms
    assert max(errs.values()) < REL, errs


def _two_ranks(rank, world):
    results = {case: _run(rank, world, *args) for case, args in (
        ("dnp+or_swiglu", ("dnp+or", "RMSNorm", True, False)),
        ("dnp_layernorm_not_gated", ("dnp", "LayerNorm", False, False)))}
    with pytest.raises(ValueError, match="does not split over 2 tensor-parallel ranks"):
        _build("dnp", ffn_hidden_size=FFN + 1)
    return results


def test_tensor_parallel_two_ranks_match_the_whole_mlp():
    """The FFN width split over TP: the norms' statistics (and OR's |u|) all-reduced, so each
    rank's slice of the output, input and every gradient equals the one-process reference."""
    for results in run_on_ranks(_two_ranks, 2):
        for case, (norms, errs) in results.items():
            assert norms and max(errs.values()) < REL, (case, errs)


def test_glu_options_the_dnp_norm_does_not_apply_are_refused():
    def build(rank, world):
        init_model_parallel()
        with pytest.raises(NotImplementedError, match="activation_func_clamp_value"):
            _build("dnp", activation_func_clamp_value=5.0)
        _build("shared", activation_func_clamp_value=5.0)  # no DNP norm: megatron's own GLU
        return True

    assert run_on_ranks(build, 1) == [True]
