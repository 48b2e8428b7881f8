"""The compiled fused DNP kernels (what the trainer and the benchmark run by default) equal the
reference, and ``auto`` falls back to eager, once and with one warning, where compiling fails."""

import contextlib
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_scalevec.layers import fused, glu


@contextlib.contextmanager
def _mode(mode):
    saved = fused.compile_mode()
    fused.set_compile(mode)
    try:
        yield
    finally:
        fused.set_compile(saved)


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


def test_compiled_kernels_match_reference():
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
    fused._COMPILED.clear()
    with _mode("on"):
        got = _grads(lambda: _head_and_glu(x, a, rope, z, a_g, a_u), inputs, dy)
    assert fused._COMPILED, "nothing was compiled"
    with fused.reference():
        ref = _grads(lambda: _head_and_glu(x, a, rope, z, a_g, a_u), inputs, dy)
    for name, g, r in zip(("out", "dx", "da", "dz", "da_g", "da_u"), got, ref):
        assert _rel(g, r) < 1e-5, (name, _rel(g, r))


def test_kernels_compile_without_graph_breaks():
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
    fused._COMPILED.clear()
    with _mode("on"):
        for interleaved in (False, True):
            rope = fused.rope_cos_sin(torch.cat([f, f], -1), 1.0, x.dtype)
            h = fused.head_norm(x, a, 1e-5, "RMSNorm", rope, interleaved)
            mixed = x.flatten(-2).unsqueeze(-2)
            qkv = fused.qkv_norm(mixed, (a, a, a), 1e-5, "LayerNorm", 2, rope, rope, interleaved)
            g = glu.glu_norm(z, a_g, a_u, F.silu, gated=True, normalization="RMSNorm", eps=1e-5)
            torch.autograd.backward([h.sum(), *(t.sum() for t in qkv), g.sum()])
    assert len(fused._COMPILED) >= 5
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_per_expert_glu_matches_reference():
    """The grouped experts' GLU norm (vectors gathered by expert id inside the kernel, block
    sums of the vector gradients) at two row counts: the second compiles with dynamic rows,
    as grouped experts see a different count each micro-batch."""
    fused._COMPILED.clear()
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
        assert fused._COMPILED, "nothing was compiled"
        with fused.reference():
            ref = _grads(run, (z, a_g, a_u), dy)
        for name, g, r in zip(("out", "dz", "da_g", "da_u"), got, ref):
            assert _rel(g, r) < 1e-5, (counts, name, _rel(g, r))


def test_auto_falls_back_to_eager_once(monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed  # noqa: PLC0415

    calls = []

    def broken(fn, **kw):
        def run(*args):
            calls.append(fn.__name__)
            raise BackendCompilerFailed(lambda *a: None, RuntimeError("no C++ compiler"), None)
        return run

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setitem(fused._STATE, "broken", False)
    x = torch.randn(3, 2, 8, requires_grad=True)
    a = torch.ones(8, requires_grad=True)
    with _mode("on"), pytest.raises(BackendCompilerFailed):
        fused.head_norm(x, a, 1e-5, "RMSNorm")
    with _mode("auto"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = fused.head_norm(x, a, 1e-5, "RMSNorm")
        y2 = fused.head_norm(x, a, 1e-5, "RMSNorm")
    with fused.reference():
        ref = fused.head_norm(x, a, 1e-5, "RMSNorm")
    assert _rel(y, ref) < 1e-6 and _rel(y2, ref) < 1e-6
    assert sum("running them eagerly" in str(w.message) for w in seen) == 1
    assert len(calls) == 2  # once under "on", once before the fallback; never again


def test_bad_mode_is_one_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="auto, on, off or dynamo"):
        fused.set_compile("yes")
    monkeypatch.setitem(fused._STATE, "compile", "fast")  # as from the environment
    with pytest.raises(ValueError, match="MEGATRON_SCALEVEC_FUSED_COMPILE"):
        fused.head_norm(torch.randn(2, 4), None, 1e-5, "RMSNorm")


def test_compiled_fold_maps_match_eager():
    """The weight folds' maps back (a linear's, the grouped experts' batched one) and the
    batched fold, compiled with static shapes, equal their eager bodies at two layouts each
    (a model has a few weight shapes), in one graph each."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    from megatron_scalevec.layers import grouped, linear  # noqa: PLC0415

    torch._dynamo.reset()
    counters.clear()
    fused._COMPILED.clear()
    for seed, (experts, rows, width) in enumerate(((3, 24, 16), (2, 8, 32))):
        torch.manual_seed(seed)
        ws = tuple(torch.randn(2 * rows, width) for _ in range(experts))
        col, row = torch.rand(experts, 2, width) + 0.5, torch.rand(experts, 2, rows) + 0.5
        g = torch.randn(experts, 2 * rows, width)
        layout = (2, 3, rows // 2)  # linear: 2 groups of 3 slots
        lw, lg = torch.randn(2, 6 * (rows // 2), width).unbind(0)
        lrow, lcol = torch.rand(3, rows // 2) + 0.5, torch.rand(3, width) + 0.5
        fc1 = types.SimpleNamespace(groups=1, slots=["gate", "up"], rows=rows)  # the layout
        cases = [  # (compiled, eager, arguments)
            (grouped.stacked_fold_backward, grouped._stacked_fold_backward,
             (g, ws, col, row, 1, (True, True))),
            (linear.fold_backward, linear._fold_backward,
             (lg, lw, lrow, lcol, layout, (True,) * 3)),
            (lambda *a: (grouped.stacked_fold_ops(a[2], a[0]).fold(*a[:2]),),
             lambda *a: (grouped.stacked_fold(a[0], *a[1], 1),), (ws, (col, row), fc1))]
        for compiled, eager, args in cases:
            with _mode("on"):
                got = compiled(*args)
            ref = eager(*args)
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                assert _rel(a, b) < 1e-5, (seed, _rel(a, b))
    assert len(fused._COMPILED) == 3, list(fused._COMPILED)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_static_kernels_compile_ahead_per_layout_and_fall_back():
    """A fixed-shape kernel runs compiled ahead for each input layout (shapes, strides and
    constants) without dynamo, equal to its body; dynamo (the fallback) takes the calls
    beyond its layout limit, the calls with an input requiring grad, every call once new
    layouts keep coming, and every call of a function that does not trace (a branch on
    values), after one warning."""
    from megatron_scalevec.layers.precompiled import StaticKernel  # noqa: PLC0415

    def fn(x, scale, flag, none):  # a nested result with a None in it
        return (x * scale + flag, None), x.square().sum(-1)

    seen = []
    k = StaticKernel(fn, lambda *a: seen.append(a[0].shape) or fn(*a), layouts=2)
    x = torch.randn(4, 8)
    for scale in (2.0, 2.0, 3.0):  # a constant is part of the layout
        (y, none), s = k(x, scale, True, None)
        (ry, _), rs = fn(x, scale, True, None)
        assert none is None and _rel(y, ry) < 1e-6 and _rel(s, rs) < 1e-6, scale
    assert len(k.compiled) == 2 and not seen
    k(torch.randn(8, 4).t(), 2.0, True, None)  # a third layout (strides only): past the limit
    with torch.enable_grad():
        k(x.requires_grad_(), 2.0, True, None)  # autograd needs the traced path
    assert len(k.compiled) == 2 and seen == [(4, 8), (4, 8)], seen
    for rows in range(9, 17):  # ever new shapes, beyond the limit: it stops looking up
        assert not k.failed
        k(torch.randn(rows, 8), 2.0, True, None)
    assert k.failed and len(seen) == 10

    def branchy(x):
        return x * 2 if bool(x.sum() > 0) else x

    calls = []
    k = StaticKernel(branchy, lambda x: calls.append(1) or branchy(x))
    with pytest.warns(UserWarning, match="precompiling branchy failed"):
        assert k(torch.ones(3)).equal(torch.full((3,), 2.0))
    assert k.failed and len(calls) == 1 and k(-torch.ones(3)).equal(-torch.ones(3))


def test_static_kernel_lookup_reads_layouts_past_torch_function_modes():
    """A warm call's layout lookup reads its tensors' metadata with torch-function dispatch
    off: a mode in the caller's context (the CPU layer's device mode, here a counter) sees
    none of it (under the CPU layer each read cost ~3 us). An argument of another kind than
    tensors, plain tuples and lists and plain constants (a NamedTuple here) goes to the
    fallback rather than into the key, where its tensors would hash by identity."""
    from typing import NamedTuple  # noqa: PLC0415

    from torch.overrides import TorchFunctionMode  # noqa: PLC0415

    from megatron_scalevec.layers.precompiled import StaticKernel  # noqa: PLC0415

    class Counter(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    def fn(x, pair, scale):
        return x * scale + pair[0] * pair[1]

    served = []
    k = StaticKernel(fn, lambda *a: served.append(a) or fn(*a))
    x, y = torch.randn(4, 8), torch.randn(8)
    k(x, (y, y), 2.0)  # compiles this layout
    counter = Counter()
    with torch.no_grad(), counter:  # as the kernels' autograd Functions and the folds run
        out = k(x, (y, y), 2.0)
    assert not counter.calls, counter.calls
    assert _rel(out, fn(x, (y, y), 2.0)) < 1e-6 and not served

    class Pair(NamedTuple):
        a: torch.Tensor
        b: torch.Tensor

    for scale in (2.0, 3.0):
        assert _rel(k(x, Pair(y, y + scale), scale), fn(x, (y, y + scale), scale)) < 1e-6
    assert len(served) == 2 and len(k.compiled) == 1 and not k.failed


def test_static_kernels_compile_without_size_asserts(monkeypatch):
    """A static kernel compiles with inductor's input size asserts off (its lookup has
    matched every input's layout already), and only its own compile: the setting is back on
    afterwards."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415

    from megatron_scalevec.layers.precompiled import StaticKernel  # noqa: PLC0415

    seen, compile_ = [], torch._inductor.standalone_compile

    def recording(*args, **kwargs):
        seen.append(inductor_config.size_asserts)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(torch._inductor, "standalone_compile", recording)
    k = StaticKernel(lambda x: x * 2 + 1, None)
    x = torch.randn(3, 5)
    assert _rel(k(x), x * 2 + 1) < 1e-6 and len(k.compiled) == 1
    assert seen == [False] and inductor_config.size_asserts


def test_dynamo_mode_compiles_without_the_static_kernels():
    """``dynamo`` (the benchmark's ``@dynamo``) compiles through torch.compile alone; ``on``
    puts the fixed-shape kernels on the ahead-compiled path."""
    from megatron_scalevec.bench import parse_variant  # noqa: PLC0415
    from megatron_scalevec.layers.precompiled import StaticKernel  # noqa: PLC0415

    assert parse_variant("unified@dynamo")[1] == "dynamo"
    kinds = {}
    for mode in ("on", "dynamo"):
        fused._COMPILED.clear()
        with _mode(mode):
            kinds[mode] = (type(fused._kernel(torch.sin, None, dynamic=False)),
                           type(fused._kernel(torch.cos, None, ahead=fused.AHEAD)))
    assert kinds["on"] == (StaticKernel, StaticKernel), kinds
    assert StaticKernel not in kinds["dynamo"], kinds
    fused._COMPILED.clear()


def test_glu_kernels_varying_rows_retire_only_their_own_site(monkeypatch):
    """A sequential expert's GLU (a new row count every call) goes to dynamo without touching
    the kernels compiled ahead, and grouped experts whose row counts vary (expert
    parallelism) retire only their own: a dense GLU in the same model keeps its compiled
    layout. (With one shared kernel, a MoE benchmark's sequential `unified` retired the
    grouped experts' and they paid dynamo's dynamic-shape kernels: 1.2 ms a GLU.)"""
    from megatron_scalevec.layers import precompiled  # noqa: PLC0415

    monkeypatch.setattr(glu, "AHEAD", 1)
    monkeypatch.setattr(precompiled, "RETIRE", 0)  # retired at the first miss
    f = 12
    a = (1 + 0.3 * torch.randn(f)).requires_grad_()
    a_e = (1 + 0.3 * torch.randn(3, f)).requires_grad_()

    def call(rows, experts=None, rows_vary=False):
        z = torch.randn(rows, 2 * f, requires_grad=True)
        vec = a if experts is None else a_e
        h = glu.glu_norm(z, vec, vec, F.silu, gated=True, normalization="RMSNorm", eps=1e-5,
                         experts=experts, rows_vary=rows_vary)
        h.sum().backward()

    def static(site):
        return [k for (fn, _, ahead, s), k in fused._COMPILED.items()
                if s == site and ahead and fn in (glu._glu_local_fwd, glu._glu_local_bwd)]

    fused._COMPILED.clear()
    with _mode("on"):
        call(16)  # dense: compiled ahead for its one layout
        for rows in (5, 9, 14):  # sequential experts
            call(rows, rows_vary=True)
        for counts in ([4, 0, 6], [3, 8, 2]):  # grouped experts, counts varying
            call(sum(counts), experts=glu.expert_rows(counts))
        call(16)
    dense, grouped = static(""), static("experts")
    assert len(dense) == 2 and all(len(k.compiled) == 1 and not k.failed for k in dense)
    assert len(grouped) == 2 and all(k.failed for k in grouped)
