"""megatron_scalevec/layers/glu.py on its own, against plain torch (never against itself).

The reference, written here: ``act(a_g * N(gate)) * (a_u * N(up))`` (``act(a_u * N(z))`` when
not gated), ``N`` = ``F.rms_norm`` / ``F.layer_norm`` without weight over the whole FFN width,
in float32. Checked: ``glu_norm``'s output and the gradients of fc1's output and of ``a_g``,
``a_u`` against torch autograd of that reference (silu, gelu, relu and an activation without a
closed-form derivative); per-expert vectors over rows sorted by ``expert_rows`` against each
expert's rows sliced out here; the width split over two gloo ranks (megatron's TP group)
against the whole-width reference, each rank's columns; ``check_config``'s refusals.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_scalevec.layers import glu
from scalevec_testing import init_model_parallel, oracles, run_on_ranks
from scalevec_testing.compare import rel as _rel

EPS = 1e-5
FFN = 12
REL = 1e-5


def _rand(*shape, seed, around=0.0):
    g = torch.Generator().manual_seed(seed)
    return around + torch.randn(*shape, generator=g) * (0.3 if around else 1.5)


def _n(t, normalization):
    """N over the last dim, no weight: torch's own norms."""
    return oracles.normalize(t.float(), normalization, EPS)


def _reference(z, a_g, a_u, act, gated, normalization):
    if not gated:
        return act(a_u * _n(z, normalization))
    gate, up = z.chunk(2, dim=-1)
    return act(a_g * _n(gate, normalization)) * (a_u * _n(up, normalization))


def _inputs(rows, gated, experts=None, seed=0):
    """fc1's output [*rows, (2 if gated) * FFN] and the vectors ([FFN], or [E, FFN])."""
    z = _rand(*rows, (2 if gated else 1) * FFN, seed=seed) + 0.4
    shape = (FFN,) if experts is None else (experts, FFN)
    a_g = _rand(*shape, seed=seed + 1, around=1.0) if gated else None
    return z, a_g, _rand(*shape, seed=seed + 2, around=1.0)


def _compare(got_fn, ref_fn, tensors, seed):
    """(errors of output and every gradient) of ``got_fn`` vs ``ref_fn`` on leaf copies."""
    ours = [None if t is None else t.clone().requires_grad_() for t in tensors]
    refs = [None if t is None else t.clone().requires_grad_() for t in tensors]
    y, ref = got_fn(*ours), ref_fn(*refs)
    assert y.dtype == tensors[0].dtype and y.shape == ref.shape
    up = _rand(*ref.shape, seed=seed)
    (y * up).sum().backward()
    (ref * up).sum().backward()
    errs = {"out": _rel(y, ref)}
    for name, o, r in zip(("dz", "da_g", "da_u"), ours, refs):
        if r is not None:
            errs[name] = _rel(o.grad, r.grad)
    return errs


ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh}
CASES = [("RMSNorm", "silu", True), ("LayerNorm", "gelu", True), ("RMSNorm", "relu", True),
         ("LayerNorm", "tanh", True), ("RMSNorm", "silu", False), ("LayerNorm", "gelu", False)]


@pytest.mark.parametrize("normalization,act,gated", CASES)
def test_glu_norm_matches_plain_torch(normalization, act, gated):
    """tanh: any other activation, its derivative through autograd (``_act_eager``)."""
    z, a_g, a_u = _inputs((5, 2), gated)
    errs = _compare(
        lambda z, a_g, a_u: glu.glu_norm(z, a_g, a_u, ACTS[act], gated=gated,
                                         normalization=normalization, eps=EPS),
        lambda z, a_g, a_u: _reference(z, a_g, a_u, ACTS[act], gated, normalization),
        (z, a_g, a_u), seed=9)
    assert len(errs) == (4 if gated else 3) and max(errs.values()) < REL, errs


def test_norm_runs_over_the_whole_ffn_width_of_each_half():
    """Scaling a row's gate (or up) half leaves the output unchanged; scaling a few of its
    columns does not (N is over all FFN columns of that half, not a group or the row)."""
    z, a_g, a_u = _inputs((4,), True)

    def h(t):
        return glu.glu_norm(t, a_g, a_u, F.silu, gated=True, normalization="RMSNorm", eps=0.0)

    scale = torch.ones(2 * FFN)
    scale[:FFN] = 3.0  # the whole gate half
    assert _rel(h(z * scale), h(z)) < 1e-6
    scale[:FFN // 2] = 1.0  # half of the gate half only
    assert _rel(h(z * scale), h(z)) > 1e-2


# rows per expert: an empty expert, blocks (glu.BLOCK rows) spanning two and three experts
COUNTS = [[20, 0, 13, 31, 7], [3, 5]]


@pytest.mark.parametrize("counts", COUNTS, ids=str)
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_per_expert_vectors_match_each_experts_rows(normalization, counts):
    """Rows sorted by expert: each expert's rows use (and give gradient to) its own vectors."""
    experts = len(counts)
    z, a_g, a_u = _inputs((sum(counts),), True, experts=experts, seed=3)
    rows = glu.expert_rows(counts)
    assert rows.ids.tolist() == [e for e, c in enumerate(counts) for _ in range(c)]

    def reference(z, a_g, a_u):
        parts = z.split(counts)
        return torch.cat([_reference(p, a_g[e], a_u[e], F.silu, True, normalization)
                          for e, p in enumerate(parts)])

    errs = _compare(
        lambda z, a_g, a_u: glu.glu_norm(z, a_g, a_u, F.silu, gated=True,
                                         normalization=normalization, eps=EPS,
                                         experts=rows),
        reference, (z, a_g, a_u), seed=11)
    assert max(errs.values()) < REL, errs


# (normalization, gated, rows per expert or None): the FFN width split over two ranks
SPLIT_CASES = [("RMSNorm", True, None), ("LayerNorm", True, None), ("LayerNorm", False, None),
               ("RMSNorm", True, (9, 0, 20))]


def _split_width(rank, world, normalization, gated, counts):
    """glu_norm on this rank's columns of gate and up (the FFN width split over TP) against
    the whole-width reference: the loss is the sum of both ranks', so each rank's gradients
    are the whole loss's on its columns."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    experts = None if counts is None else len(counts)
    z, a_g, a_u = _inputs((sum(counts),) if counts else (5, 2), gated, experts, seed=5)
    cols = slice(rank * FFN // world, (rank + 1) * FFN // world)

    def local(t):  # this rank's columns of each FFN-wide half
        return torch.cat([h[..., cols] for h in t.chunk(2 if gated else 1, -1)], -1)

    ours = [local(z).requires_grad_()] + [None if a is None else a[..., cols].requires_grad_()
                                          for a in (a_g, a_u)]
    refs = [None if t is None else t.clone().requires_grad_() for t in (z, a_g, a_u)]
    rows = None if counts is None else glu.expert_rows(counts)
    y = glu.glu_norm(*ours, F.silu, gated=gated, normalization=normalization, eps=EPS,
                     group=tp, experts=rows)
    if counts is None:
        ref = _reference(*refs, F.silu, gated, normalization)
    else:
        ref = torch.cat([_reference(p, refs[1][e], refs[2][e], F.silu, gated, normalization)
                         for e, p in enumerate(refs[0].split(counts))])
    up = _rand(*ref.shape, seed=13)  # the same on both ranks: each takes its columns
    (y * up[..., cols]).sum().backward()
    (ref * up).sum().backward()
    errs = {"out": _rel(y, ref[..., cols]), "dz": _rel(ours[0].grad, local(refs[0].grad))}
    for name, o, r in (("da_g", ours[1], refs[1]), ("da_u", ours[2], refs[2])):
        if r is not None:
            errs[name] = _rel(o.grad, r.grad[..., cols])
    return errs


def _two_ranks(rank, world):
    init_model_parallel(tp=world)
    return {case: _split_width(rank, world, *case) for case in SPLIT_CASES}


def test_width_split_over_two_ranks_equals_the_whole_width():
    for results in run_on_ranks(_two_ranks, 2):
        for case, errs in results.items():
            assert len(errs) >= 3 and max(errs.values()) < REL, (case, errs)


def test_check_config_refuses_what_the_fused_norm_does_not_apply():
    from types import SimpleNamespace

    glu.check_config(SimpleNamespace(activation_func_clamp_value=None, glu_linear_offset=0.0))
    for name in ("activation_func_clamp_value", "glu_linear_offset"):
        with pytest.raises(NotImplementedError, match=f"config.{name}"):
            glu.check_config(SimpleNamespace(**{name: 1.5}))
