"""The compiled fused DNP kernels (what the trainer and the benchmark run by default) equal the
reference (scalevec_testing/reference.py), and ``auto`` falls back to eager, once and with one
warning, where compiling fails (compile.py)."""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_scalevec import compile
from megatron_scalevec.layers import fused, glu
from scalevec_testing.reference import reference


@contextlib.contextmanager
def _mode(mode):
    saved = compile.mode()
    compile.set_mode(mode)
    try:
        yield
    finally:
        compile.set_mode(saved)


@pytest.fixture
def compiles(monkeypatch):
    """The (body, dynamic) pairs handed to torch.compile during the test, from a fresh cache
    (compile.py compiles each pair once)."""
    seen = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append((fn, kw.get("dynamic")))
        return real(fn, **kw)

    compile.compiled.cache_clear()
    monkeypatch.setattr(torch, "compile", spy)
    yield seen
    compile.compiled.cache_clear()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _grads(fn, inputs, dy):
    y = fn()
    return (y, *torch.autograd.grad(y, inputs, dy))


def _head_and_glu(x, a, rope, z, a_g, a_u):
    h = fused.head_norm(x, a, 1e-5, "RMSNorm", rope)
    g = glu.glu_norm(z, a_g, a_u, F.silu, gated=True, normalization="RMSNorm", eps=1e-5)
    mixed = x.flatten(-2).unsqueeze(-2)  # one group of 2 query heads, k, v
    qkv = fused.qkv_norm(mixed, (a, a, a), 1e-5, "RMSNorm", 2, rope, rope)
    return torch.cat([h.flatten(), g.flatten(), *(t.flatten() for t in qkv)])


def test_compiled_kernels_match_reference(compiles):
    torch.manual_seed(3)
    x = torch.randn(6, 2, 4, 16, requires_grad=True)  # 4 heads
    a = (1 + 0.3 * torch.randn(16)).requires_grad_()
    f = torch.randn(6, 1, 1, 8)
    rope = fused.rope_cos_sin(torch.cat([f, f], -1), 1.0, x.dtype)
    z = torch.randn(6, 2, 24, requires_grad=True)
    a_g = (1 + 0.3 * torch.randn(12)).requires_grad_()
    a_u = (1 + 0.3 * torch.randn(12)).requires_grad_()
    inputs = (x, a, z, a_g, a_u)
    dy = torch.randn(2 * 6 * 2 * 4 * 16 + 6 * 2 * 12)
    with _mode("on"):
        got = _grads(lambda: _head_and_glu(x, a, rope, z, a_g, a_u), inputs, dy)
    assert compiles, "nothing was compiled"
    with reference():
        ref = _grads(lambda: _head_and_glu(x, a, rope, z, a_g, a_u), inputs, dy)
    for name, g, r in zip(("out", "dx", "da", "dz", "da_g", "da_u"), got, ref):
        assert _rel(g, r) < 1e-5, (name, _rel(g, r))


def test_kernels_compile_without_graph_breaks(compiles):
    """Each kernel is one graph under the CPU layer's torch-function mode too (the benchmark
    runs there): a break splits a kernel into several graphs with eager code between them
    (Tensor.unflatten did, once)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    torch.manual_seed(3)
    x = torch.randn(6, 2, 4, 16, requires_grad=True)
    a = (1 + 0.3 * torch.randn(16)).requires_grad_()
    f = torch.randn(6, 1, 1, 8)
    z = torch.randn(6, 2, 24, requires_grad=True)
    a_g, a_u = torch.ones(12, requires_grad=True), torch.ones(12, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    with _mode("on"):
        for interleaved in (False, True):
            rope = fused.rope_cos_sin(torch.cat([f, f], -1), 1.0, x.dtype)
            h = fused.head_norm(x, a, 1e-5, "RMSNorm", rope, interleaved)
            mixed = x.flatten(-2).unsqueeze(-2)
            qkv = fused.qkv_norm(mixed, (a, a, a), 1e-5, "LayerNorm", 2, rope, rope, interleaved)
            g = glu.glu_norm(z, a_g, a_u, F.silu, gated=True, normalization="RMSNorm", eps=1e-5)
            torch.autograd.backward([h.sum(), *(t.sum() for t in qkv), g.sum()])
    assert len(compiles) >= 5
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_per_expert_glu_matches_reference(compiles):
    """The grouped experts' GLU norm (vectors gathered by expert id inside the kernel, block
    sums of the vector gradients) at two row counts: the second compiles with dynamic rows,
    as grouped experts see a different count each micro-batch."""
    for seed, counts in enumerate(([20, 0, 13, 31, 7], [9, 30, 2, 0, 40])):
        torch.manual_seed(5 + seed)
        rows, n = glu.expert_rows(counts), sum(counts)
        z = torch.randn(n, 24, requires_grad=True)
        a_g = (1 + 0.3 * torch.randn(len(counts), 12)).requires_grad_()
        a_u = (1 + 0.3 * torch.randn(len(counts), 12)).requires_grad_()
        dy = torch.randn(n, 12)

        def run(z=z, a_g=a_g, a_u=a_u, rows=rows):
            return glu.glu_norm(z, a_g, a_u, F.silu, gated=True, normalization="RMSNorm",
                                eps=1e-5, experts=rows)

        with _mode("on"):
            got = _grads(run, (z, a_g, a_u), dy)
        assert compiles, "nothing was compiled"
        with reference():
            ref = _grads(run, (z, a_g, a_u), dy)
        for name, g, r in zip(("out", "dz", "da_g", "da_u"), got, ref):
            assert _rel(g, r) < 1e-5, (counts, name, _rel(g, r))


def test_auto_falls_back_to_eager_once(monkeypatch, compiles):
    from torch._dynamo.exc import BackendCompilerFailed  # noqa: PLC0415

    calls = []

    def broken(fn, **kw):
        def run(*args):
            calls.append(fn.__name__)
            raise BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)
        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(compile, "_eager", False)
    x = torch.randn(3, 2, 8, requires_grad=True)
    a = torch.ones(8, requires_grad=True)
    with _mode("on"), pytest.raises(BackendCompilerFailed):
        fused.head_norm(x, a, 1e-5, "RMSNorm")
    with _mode("auto"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = fused.head_norm(x, a, 1e-5, "RMSNorm")
        y2 = fused.head_norm(x, a, 1e-5, "RMSNorm")
    with reference():
        ref = fused.head_norm(x, a, 1e-5, "RMSNorm")
    assert _rel(y, ref) < 1e-6 and _rel(y2, ref) < 1e-6
    assert sum("running them eagerly" in str(w.message) for w in seen) == 1
    assert len(calls) == 2  # once under "on", once before the fallback; never again


def test_bad_mode_is_one_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="auto, on or off"):
        compile.set_mode("yes")
    monkeypatch.setattr(compile, "_mode", "fast")  # as from the environment
    with pytest.raises(ValueError, match="MEGATRON_SCALEVEC_FUSED_COMPILE"):
        fused.head_norm(torch.randn(2, 4), None, 1e-5, "RMSNorm")


def test_compiled_fold_maps_match_eager(compiles):
    """The weight folds' maps back (a linear's, the grouped experts' batched one), compiled
    with static shapes, equal their eager bodies at two layouts each
    (a model has a few weight shapes), in one graph each."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    from megatron_scalevec.layers import fold  # noqa: PLC0415

    torch._dynamo.reset()
    counters.clear()
    for seed, (experts, rows, width) in enumerate(((3, 24, 16), (2, 8, 32))):
        torch.manual_seed(seed)
        ws = tuple(torch.randn(2 * rows, width) for _ in range(experts))
        col, row = torch.rand(experts, 2, width) + 0.5, torch.rand(experts, 2, rows) + 0.5
        g = torch.randn(experts, 2 * rows, width)
        layout = (2, 3, rows // 2)  # linear: 2 groups of 3 slots
        lw, lg = torch.randn(2, 6 * (rows // 2), width).unbind(0)
        lrow, lcol = torch.rand(3, rows // 2) + 0.5, torch.rand(3, width) + 0.5
        cases = [  # (compiled, eager, arguments): grouped experts, one linear
            (fold.fold_grads, fold._fold_grads,
             (g, ws, row, col, (1, 2, rows), (True,) * 3)),
            (fold.fold_grads, fold._fold_grads,
             (lg[None], (lw,), lrow[None], lcol[None], layout, (True,) * 3))]
        for compiled, eager, args in cases:
            with _mode("on"):
                got = compiled(*args)
            ref = eager(*args)
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                for x, y in zip(*((t,) if torch.is_tensor(t) else t for t in (a, b))):
                    assert _rel(x, y) < 1e-5, (seed, _rel(x, y))
    assert len(compiles) == 1, compiles
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_glu_kernels_run_eager_below_two_rows():
    """A sequential expert's GLU meets 0 or 1 rows often; dynamo specializes those sizes, so
    compiling them recompiled per call until dynamo's limit (a TP2+SP MoE run printed it)."""
    with _mode("on"):
        for rows in (0, 1):
            assert compile.rows_kernel(glu._glu_fwd, torch.zeros(rows, 8)) is glu._glu_fwd
        assert compile.rows_kernel(glu._glu_fwd, torch.zeros(2, 8)) is not glu._glu_fwd


@pytest.mark.parametrize("mode", ["off", "on"])
def test_step_map_in_place_matches_plain_torch(mode, compiles):
    # fold.map_in_place on a view into a flat buffer (DDP's main_grad), eager and compiled,
    # against the map written out: dW = G * a[r] * gamma[in], d a = sum G*W*gamma, d gamma =
    # sum G*W*a, over the groups (layout: 2 groups, 2 slots, 3 rows)
    from megatron_scalevec.layers import fold

    torch.manual_seed(5)
    groups, slots, rows, width = 2, 2, 3, 8
    w = torch.randn(groups * slots * rows, width)
    g = torch.randn_like(w)
    row, col = 1 + 0.3 * torch.randn(slots, rows), 1 + 0.3 * torch.randn(slots, width)
    buffer = torch.zeros(w.numel() + 5)
    main_grad = buffer[5:].view_as(w)
    main_grad.copy_(g)
    with _mode(mode):
        d_row, d_col = fold.map_in_place(main_grad, w, row, col, (groups, slots, rows),
                                         (True, True))
    assert mode == "off" or (fold._map, False) in compiles
    g4, w4 = g.view(groups, slots, rows, width), w.view(groups, slots, rows, width)
    want_dw = g4 * row[None, :, :, None] * col[None, :, None, :]
    want_row = torch.einsum("gsri,gsri,si->sr", g4, w4, col)
    want_col = torch.einsum("gsri,gsri,sr->si", g4, w4, row)
    assert _rel(main_grad, want_dw.view_as(w)) < 1e-6
    assert _rel(d_row, want_row) < 1e-5 and _rel(d_col, want_col) < 1e-5
    assert buffer[:5].abs().max() == 0  # nothing written outside the view
    with _mode(mode):  # and the fold itself: W_eff = W * a[r] * gamma[in] per slot
        w_eff = fold.fold([w], row[None], col[None], (groups, slots, rows))
    want = w4 * row[None, :, :, None] * col[None, :, None, :]
    assert _rel(w_eff[0], want.view_as(w)) < 1e-6


@pytest.mark.parametrize("into", [False, True], ids=["fresh", "refold"])
@pytest.mark.parametrize("vectors", ["both", "row", "col"])
def test_fold_of_several_experts_matches_plain_torch(compiles, into, vectors):
    """The compiled fold of 3 experts' weights, fresh and refolded into a released tensor's
    storage (grouped experts), against W[e] * a[e, r] * gamma[e, in] per slot: each expert's
    slice holds its own product, nothing of another's or of the old values."""
    from megatron_scalevec.layers import fold  # noqa: PLC0415

    torch.manual_seed(6)
    ws = [torch.randn(12, 8) for _ in range(3)]  # layout: 1 group, 2 slots, 6 rows
    row = torch.rand(3, 2, 6) + 0.5 if vectors != "col" else None
    col = torch.rand(3, 2, 8) + 0.5 if vectors != "row" else None
    one = torch.ones(3, 2, 6, 8)
    scale = (one if row is None else row[..., None]) * (1 if col is None else col[:, :, None])
    want = torch.stack(ws).view(3, 2, 6, 8) * scale
    with _mode("on"), torch.no_grad():
        out = torch.full((3, 12, 8), float("nan")) if into else None
        got = fold.fold(ws, row, col, (1, 2, 6), out=out)
    assert got.shape == (3, 12, 8) and (out is None or got is out)
    assert _rel(got.view_as(want), want) < 1e-6
    assert (fold._fold_into, False) in compiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("side", ["row", "col"])
def test_a_one_sided_fold_of_one_weight_is_one_multiply(compiles, side, dtype):
    """HG alone (``unified``'s every dense fold) or DP alone on one weight: one broadcast
    multiply, already one pass, with no compiled call (its host cost was most of a small
    model's fold), fresh and into a released tensor's storage, against plain torch (the
    vector cast to the weight's dtype first, as the compiled body does)."""
    from megatron_scalevec.layers import fold  # noqa: PLC0415

    torch.manual_seed(7)
    groups, slots, rows, width = 2, 3, 4, 8
    w = torch.randn(groups * slots * rows, width).to(dtype)
    row = torch.rand(1, slots, rows) + 0.5 if side == "row" else None
    col = torch.rand(1, slots, width) + 0.5 if side == "col" else None
    w4 = w.view(groups, slots, rows, width)
    want = w4 * (row[0, :, :, None] if col is None else col[0, :, None, :]).to(dtype)
    with _mode("on"), torch.no_grad():
        fresh = fold.fold([w], row, col, (groups, slots, rows))
        out = torch.full((1, *w.shape), float("nan"), dtype=dtype)
        into = fold.fold([w], row, col, (groups, slots, rows), out=out)
    assert into is out and fresh.dtype == dtype
    for got in (fresh, into):
        assert torch.equal(got[0], want.view_as(w))
    assert compiles == []


def test_a_kernel_compiles_once_per_shape(compiles):
    """Inputs that require grad or not (inside autograd Functions, grad off) and the CPU
    layer's device mode (on in forward, off on autograd's backward thread) do not compile a
    body again: dynamo guards on both, so a model's fold compiled up to four times per shape
    and hit dynamo's recompile limit (then ran eagerly) in a benchmark of several variants."""
    import threading  # noqa: PLC0415

    from torch._dynamo.utils import counters  # noqa: PLC0415
    from torch.overrides import _get_current_function_mode_stack  # noqa: PLC0415

    from megatron_scalevec.compat.cpu import _CudaAsCpuMode  # noqa: PLC0415
    from megatron_scalevec.layers import fold  # noqa: PLC0415

    assert any(isinstance(m, _CudaAsCpuMode) for m in _get_current_function_mode_stack())
    torch._dynamo.reset()
    counters.clear()
    w = torch.randn(12, 8, requires_grad=True)
    row, col = torch.rand(1, 3, 4) + 0.5, torch.rand(1, 3, 8) + 0.5
    want = w.detach().view(3, 4, 8) * row[0, :, :, None] * col[0, :, None, :]

    def call(needs_grad):
        with torch.no_grad():
            c = col.clone().requires_grad_(needs_grad)
            return fold.fold([w], row, c, (1, 3, 4))[0]

    outs = []
    with _mode("on"):
        outs += [call(True), call(False)]
        thread = threading.Thread(target=lambda: outs.append(call(True)))  # no device mode
        thread.start()
        thread.join()
    assert len(outs) == 3 and all(_rel(o.view_as(want), want) < 1e-6 for o in outs)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_compiled_norm_matches_the_composite(compiles, normalization):
    """A Pre-Norm / final norm (norms.py), one compiled body each way, against N(x) * gamma
    written as torch's own norm (with and without a vector)."""
    from megatron_scalevec import norms  # noqa: PLC0415

    torch.manual_seed(4)
    layer = normalization == "LayerNorm"
    x = torch.randn(6, 2, 16, dtype=torch.float64).float().requires_grad_()
    gamma = (1 + 0.3 * torch.randn(16)).requires_grad_()
    dy = torch.randn(6, 2, 16)
    torch_norm = F.layer_norm if layer else F.rms_norm
    for g in (gamma, None):
        inputs = (x, g) if g is not None else (x,)
        with _mode("on"):
            got = _grads(lambda g=g: norms._ScaledNorm.apply(x, g, None, layer, 1e-5, None, 16),
                         inputs, dy)
        ref = _grads(lambda g=g: torch_norm(x, (16,), g, eps=1e-5), inputs, dy)
        for name, a, b in zip(("out", "dx", "dgamma"), got, ref):
            assert _rel(a, b) < 1e-5, (name, g is None, _rel(a, b))
    assert {fn.__name__ for fn, _ in compiles} >= {"_norm_fwd", "_norm_bwd"}, compiles
