"""megatron_scalevec/layers/fold.py on its own, against the plain-torch formula (never itself).

Checked: ``fold`` is ``W_eff = diag(a) W diag(gamma)`` per slot (rows ``[G, S, r]``, an optional
expert axis), its scale written out here row by row; ``Fold``'s backward, ``fold_grads`` and
``map_in_place`` equal torch autograd through that formula; ``StepMap`` answers accumulate,
..., map against megatron-core's micro-batch calculator and refuses a step over or under its
count; the once-per-step folds (stacked and per weight) sum ``G`` over a step's micro-batches
in ``main_grad`` and map it once, equal to the sum of each micro-batch's autograd gradients;
``FoldedWeights`` frees a folded weight after the GEMM's forward and refolds the same values
before its backward (nothing held outside a grad-enabled forward).
"""

import contextlib

import pytest
import torch

from megatron_scalevec.layers import fold
from scalevec_testing.compare import rel as _rel

LAYOUT = (2, 3, 4)  # G groups, S slots, r rows per slot: a weight of 24 rows
OUT, IN = 24, 5
VECTORS = {"row": (True, False), "col": (False, True), "both": (True, True)}


def _rand(*shape, seed, around=0.0):
    g = torch.Generator().manual_seed(seed)
    return around + torch.randn(*shape, generator=g) * (0.3 if around else 1.0)


def _vectors(experts, which, seed=1):
    """(row [E, S, r] or None, col [E, S, in] or None), away from 1, as leaves."""
    has_row, has_col = VECTORS[which]
    _, s, r = LAYOUT
    row = _rand(experts, s, r, seed=seed, around=1.0).requires_grad_() if has_row else None
    col = _rand(experts, s, IN, seed=seed + 1, around=1.0).requires_grad_() if has_col else None
    return row, col


def _formula(w, row, col):
    """One weight [OUT, IN] times ``a[slot(o), o % r] * gamma[slot(o), i]`` at (o, i), with
    ``slot(o) = (o // r) % S``: the fold written out per row (row, col: one expert's)."""
    _, s, r = LAYOUT
    o = torch.arange(w.shape[0])
    slot, within = (o // r) % s, o % r
    scale = torch.ones_like(w)
    if row is not None:
        scale = scale * row[slot, within][:, None]
    if col is not None:
        scale = scale * col[slot]
    return w * scale


def _reference(weights, row, col):
    """[E, OUT, IN] by the formula, with autograd to the weights and vectors."""
    return torch.stack([_formula(w, None if row is None else row[e],
                                 None if col is None else col[e])
                        for e, w in enumerate(weights)])


def _weights(experts, seed=0):
    return [_rand(OUT, IN, seed=seed + 10 * e).requires_grad_() for e in range(experts)]


def _leaves(tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("experts", [1, 3])
@pytest.mark.parametrize("which", list(VECTORS))
def test_fold_is_diag_a_w_diag_gamma_per_slot(which, experts):
    weights = _weights(experts)
    row, col = _vectors(experts, which)
    want = _reference(weights, row, col).detach()
    out = torch.full((experts, OUT, IN), float("nan"))
    with torch.no_grad():  # outside autograd, as Fold and the GEMMs' backward call it
        assert _rel(fold.fold(weights, row, col, LAYOUT), want) < 1e-6
        assert fold.fold(weights, row, col, LAYOUT, out=out) is out and _rel(out, want) < 1e-6


@pytest.mark.parametrize("experts", [1, 3])
@pytest.mark.parametrize("which", list(VECTORS))
def test_fold_backward_matches_autograd_of_the_formula(which, experts):
    weights = _weights(experts)
    row, col = _vectors(experts, which)
    ref_w, (ref_row, ref_col) = _leaves(weights), _leaves((row, col))
    up = _rand(experts, OUT, IN, seed=7)
    got = fold.Fold.apply(row, col, LAYOUT, *weights)
    want = _reference(ref_w, ref_row, ref_col)
    assert _rel(got, want) < 1e-6
    (got * up).sum().backward()
    (want * up).sum().backward()
    for g, r in zip(weights + [row, col], ref_w + [ref_row, ref_col]):
        assert (g is None) == (r is None)
        if g is not None:
            assert _rel(g.grad, r.grad) < 1e-5


def test_fold_grads_computes_only_what_is_asked():
    weights = _weights(2)
    row, col = _vectors(2, "both")
    g = _rand(2, OUT, IN, seed=3)
    with torch.no_grad():
        dw, d_row, d_col = fold.fold_grads(g, weights, row, col, LAYOUT, (False, True, False))
    assert dw is None and d_col is None and d_row.shape == row.shape
    ref_w, (ref_row, ref_col) = _leaves(weights), _leaves((row, col))
    (_reference(ref_w, ref_row, ref_col) * g).sum().backward()
    assert _rel(d_row, ref_row.grad) < 1e-5


@pytest.mark.parametrize("which", list(VECTORS))
def test_map_in_place_turns_G_into_dW_and_gives_the_vector_grads(which):
    (w,) = _weights(1)
    row, col = _vectors(1, which)
    g = _rand(OUT, IN, seed=4)
    main_grad = g.clone()
    single = [None if v is None else v[0] for v in (row, col)]
    with torch.no_grad():  # as the GEMM's backward calls it
        d_row, d_col = fold.map_in_place(main_grad, w, *single, LAYOUT, (True, True))
    ref_w, (ref_row, ref_col) = _leaves([w]), _leaves(single)
    (_formula(ref_w[0], ref_row, ref_col) * g).sum().backward()
    assert _rel(main_grad, ref_w[0].grad) < 1e-6
    for got, ref in ((d_row, ref_row), (d_col, ref_col)):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert _rel(got, ref.grad) < 1e-5


# ---------------------------------------------------------------- the map, once per step

@contextlib.contextmanager
def _microbatches(n):
    """megatron-core's micro-batch calculator at ``n`` micro-batches per step (one DP rank)."""
    from megatron.core import num_microbatches_calculator as calc

    calc.unset_num_microbatches_calculator()
    calc.init_num_microbatches_calculator(0, None, n, 1, 1)
    try:
        yield
    finally:
        calc.unset_num_microbatches_calculator()


def _with_main_grad(weights):
    for w in weights:
        w.main_grad = torch.zeros_like(w)
    return weights


def test_step_map_modes_follow_the_calculator():
    step = fold.StepMap()
    (plain,) = _weights(1)
    (w,) = _with_main_grad(_weights(1))
    assert step.mode(w) is None  # no calculator: every micro-batch maps its own
    with _microbatches(3):
        assert step.mode(plain) is None  # no main_grad (no megatron-core DDP)
        with torch.no_grad():
            assert step.mode(w) is None  # not a training forward
        assert [step.mode(w) for _ in range(3)] == ["accumulate", "accumulate", "map"]
        with pytest.raises(RuntimeError, match="training forward 4"):
            step.mode(w)  # a fourth forward without zero_grad_buffer()
        w.grad_added_to_main_grad = False  # DDP's zero_grad_buffer(): a new step
        assert step.mode(w) == "accumulate"
        step.accumulated = True  # ... whose backward accumulated but never mapped
        w.grad_added_to_main_grad = False
        with pytest.raises(RuntimeError, match="never mapped"):
            step.mode(w)


def test_a_step_is_carried_by_our_own_flag():
    """steps.py opens and closes a step by its own flag; megatron-core's
    ``grad_added_to_main_grad`` only tells it that DDP's ``zero_grad_buffer()`` began a new
    iteration. A DDP flag someone else set (megatron-core's fused wgrad sets it) is no step."""
    from megatron_scalevec import steps

    (w,) = _with_main_grad(_weights(1))
    w.grad_added_to_main_grad = True  # not by steps.start: no step is open on w
    assert steps.new_step(w)
    steps.start([w])
    assert getattr(w, steps.OPEN) and w.grad_added_to_main_grad and not steps.new_step(w)
    w.grad_added_to_main_grad = False  # DDP's zero_grad_buffer()
    assert steps.new_step(w)
    steps.start([w])
    steps.close([w])  # the step's gradient mapped: .grad goes to DDP as usual again
    assert not getattr(w, steps.OPEN) and not w.grad_added_to_main_grad and steps.new_step(w)


def _gemm_per_step(entry, x, weights, row, col, step_map):
    """One micro-batch's per-expert GEMM ``x[e] @ W_eff[e]^T`` with the weights folded once per
    step through ``entry``, under FoldedWeights (the GEMM keeps its folded weight; released
    until its backward)."""
    step = (step_map.mode(*weights), step_map)
    with fold.FoldedWeights() as folded:
        if entry == "stacked":
            w_effs = folded.stacked_once_per_step(weights, row, col, LAYOUT, step).unbind(0)
        else:  # each W_eff carries its W's main_grad; G added there (no fused wgrad)
            w_effs = folded.once_per_step(weights, row, col, LAYOUT, (*step, False))
        y = torch.stack([x[e] @ w.t() for e, w in enumerate(w_effs)])
        y = folded.release_until_backward(y)
    assert w_effs[0].untyped_storage().nbytes() == 0  # released until the backward
    return y


@pytest.mark.parametrize("entry", ["stacked", "per_weight"])
def test_once_per_step_fold_sums_micro_batches_then_maps_once(entry, monkeypatch):
    micro, experts = 3, 2
    weights = _with_main_grad(_weights(experts))
    row, col = _vectors(experts, "both")
    ref_w, (ref_row, ref_col) = _leaves(weights), _leaves((row, col))
    maps = []
    real = fold.map_in_place
    monkeypatch.setattr(fold, "map_in_place", lambda *a: maps.append(1) or real(*a))
    step_map = fold.StepMap()
    with _microbatches(micro):
        for mb in range(micro):
            x = _rand(experts, 6, IN, seed=20 + mb).requires_grad_()
            ref_x = x.detach().clone().requires_grad_()
            up = _rand(experts, 6, OUT, seed=30 + mb)
            (_gemm_per_step(entry, x, weights, row, col, step_map) * up).sum().backward()
            w_ref = _reference(ref_w, ref_row, ref_col)
            (torch.einsum("eti,eoi->eto", ref_x, w_ref) * up).sum().backward()
            assert _rel(x.grad, ref_x.grad) < 1e-5  # every micro-batch's input gradient
    assert len(maps) == experts and step_map.mapped  # each weight mapped once, on the last
    for w, r in zip(weights, ref_w):
        assert _rel(w.main_grad, r.grad) < 1e-5  # the step's sum, mapped
    assert _rel(row.grad, ref_row.grad) < 1e-5 and _rel(col.grad, ref_col.grad) < 1e-5


# ---------------------------------------------------------------- release and refold

def test_folded_weights_release_until_backward_and_refold_the_same_values():
    weights = _weights(2)
    row, col = _vectors(2, "both")
    ref_w, (ref_row, ref_col) = _leaves(weights), _leaves((row, col))
    x = _rand(6, IN, seed=5).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    up = _rand(6, OUT, seed=6)
    with fold.FoldedWeights() as folded:
        w_eff = folded(weights, row, col, LAYOUT)
        y = x @ w_eff[0].t() + x @ w_eff[1].t()  # two GEMMs keep the one folded tensor
        y = folded.release_until_backward(y)
    assert w_eff.untyped_storage().nbytes() == 0  # released until the backward
    w_ref = _reference(ref_w, ref_row, ref_col)
    y_ref = ref_x @ w_ref[0].t() + ref_x @ w_ref[1].t()
    assert _rel(y, y_ref) < 1e-6
    (y * up).sum().backward()  # dx reads the refolded weights
    (y_ref * up).sum().backward()
    assert _rel(w_eff.detach(), w_ref.detach()) < 1e-6  # refolded in place, same values
    for g, r in zip([x, *weights, row, col], [ref_x, *ref_w, ref_row, ref_col]):
        assert _rel(g.grad, r.grad) < 1e-5


def test_folded_weights_hold_nothing_without_grad():
    weights = _weights(1)
    row, col = _vectors(1, "both")
    with torch.no_grad(), fold.FoldedWeights() as folded:
        w_eff = folded(weights, row, col, LAYOUT)
        y = folded.release_until_backward(_rand(3, IN, seed=8) @ w_eff[0].t())
    assert folded.held is None and w_eff.untyped_storage().nbytes() == w_eff.nbytes
    assert _rel(y, _rand(3, IN, seed=8) @ _reference(weights, row, col)[0].t()) < 1e-6
