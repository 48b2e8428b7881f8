"""Static-shape kernels compiled once per input layout and called without dynamo.

A ``torch.compile``'d function pays dynamo's frame hooks, guard checks and AOTAutograd's
runtime wrappers on every call: about 25 us with warm caches and 50 to 120 us inside a
training step, whose tensors have evicted that Python from the CPU caches (measured on the
GLU norm at 16 tokens, where the kernel itself is a few us). A dense layer calls four fused
kernels per micro-batch and the weight folds a few per step, so on the CPU benchmark this was
the largest single part of the strategy's host work. For kernels whose shapes are fixed (the
caller passes ``dynamic=False`` or ``ahead`` to ``fused._kernel``), :class:`StaticKernel` traces the
function with ``make_fx`` for each layout it meets and compiles it with inductor's
``standalone_compile``; a call then looks up the layout (shapes, strides, offsets, dtypes,
devices and every non-tensor argument) and runs the compiled code.

Nothing is guarded except that layout, so the fast path is taken only where it is exact: the
trace runs on fake tensors (a branch on a tensor's values fails it rather than being baked
in), and the compiled code runs under ``no_grad`` or with no argument requiring grad (the
fused kernels run inside autograd Functions, the folds without grad), for the first
``layouts`` layouts a function meets, and for functions that trace and compile. Anything
else goes to ``fallback`` (the dynamo-compiled function), as does every later call of a
function that failed once or keeps meeting new layouts (a sequential expert's token count
changes every call: the lookup would only add to dynamo's cost).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils import _pytree as pytree

MAX_LAYOUTS = 8  # per function; beyond it dynamo's own caching (and dynamic shapes) serve
RETIRE = 4  # misses per layout, once all are taken, after which a function stops looking


def _layout(leaf):
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.stride(), leaf.storage_offset(), leaf.dtype,
                leaf.device)
    return (type(leaf), leaf)


class StaticKernel:
    """``fn`` compiled ahead per input layout (module doc); ``fallback(*args)`` otherwise."""

    def __init__(self, fn, fallback, layouts: int = MAX_LAYOUTS):
        self.fn, self.fallback, self.layouts = fn, fallback, layouts
        self.compiled: dict = {}
        self.failed, self.misses = False, 0

    def __call__(self, *args):
        if self.failed:
            return self.fallback(*args)
        leaves, spec = pytree.tree_flatten(args)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return self.fallback(*args)
        key = (spec, tuple(_layout(leaf) for leaf in leaves))
        entry = self.compiled.get(key)
        if entry is None:
            if len(self.compiled) >= self.layouts:
                self.misses += 1  # shapes that vary (an expert's token count): stop looking
                self.failed = self.misses > RETIRE * self.layouts
                return self.fallback(*args)
            entry = self._compile(leaves, spec, tensors)
            if entry is None:
                return self.fallback(*args)
            self.compiled[key] = entry
        artifact, out_spec = entry
        with torch.no_grad():
            return pytree.tree_unflatten(list(artifact(*tensors)), out_spec)

    def _compile(self, leaves, spec, tensors):
        """(compiled artifact, output pytree spec), or None (and ``failed``) when ``fn`` does
        not trace or compile: then dynamo's own compile (or its eager fallback) takes over."""
        from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        out_spec = []

        def flat(*ts):
            full = list(leaves)
            for i, t in zip(slots, ts):
                full[i] = t
            out, s = pytree.tree_flatten(self.fn(*pytree.tree_unflatten(full, spec)))
            out_spec.append(s)
            return out

        try:
            with torch.no_grad():
                gm = make_fx(flat, tracing_mode="fake")(*tensors)
                artifact = torch._inductor.standalone_compile(
                    gm, list(tensors), dynamic_shapes="from_example_inputs")
        except Exception as err:  # tracing or inductor: any failure means "not this way"
            self.failed = True
            warnings.warn(f"precompiling {getattr(self.fn, '__name__', self.fn)} failed "
                          f"({type(err).__name__}: {err}); using torch.compile for it",
                          stacklevel=3)
            return None
        return artifact, out_spec[-1]
