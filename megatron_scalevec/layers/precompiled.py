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
devices and every non-tensor argument) and runs the compiled code. The lookup is a loop of
our own with torch-function dispatch off: through ``pytree`` and a torch-function mode (the CPU
layer's) it cost about 280 us a call inside a step, more than dynamo's own guards.

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

import types
import warnings

import torch
from torch.utils import _pytree as pytree

MAX_LAYOUTS = 8  # per function; beyond it dynamo's own caching (and dynamic shapes) serve
RETIRE = 4  # misses per layout, once all are taken, after which a function stops looking
# Non-tensor arguments a layout may hold: hashable by value, holding no tensor.
_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device, types.FunctionType,
              types.BuiltinFunctionType)


def _flatten(args, tensors: list):
    """The layout key of ``args`` (tensors appended to ``tensors`` in order): each tensor's
    shape, strides, offset, dtype and device; plain tuples and lists recursed; the constants
    as they are. None when an argument is of another kind (then dynamo serves the call). A
    loop of our own, not ``pytree``: this runs on every call."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            tensors.append(a)
            key.append((a.shape, a.stride(), a.storage_offset(), a.dtype, a.device))
        elif type(a) in (tuple, list):
            inner = _flatten(a, tensors)
            if inner is None:
                return None
            key.append((type(a), inner))
        elif isinstance(a, _CONSTANTS):
            key.append((type(a), a))
        else:
            return None
    return tuple(key)


def _substitute(obj, tensors):
    """``obj`` with its tensors (in :func:`_flatten`'s order) taken from the iterator."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if type(obj) in (tuple, list):
        return type(obj)(_substitute(o, tensors) for o in obj)
    return obj


def _fill(template, out):
    """The result's structure (tuples, lists, None; ints index the flat outputs) filled."""
    if type(template) is int:
        return out[template]
    if template is None:
        return None
    return type(template)(_fill(t, out) for t in template)


def _template(spec):
    """:func:`_fill`'s template of a pytree spec, or None for other containers."""
    template = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)

    def plain(t):
        return type(t) is int or t is None or (type(t) in (tuple, list) and all(map(plain, t)))

    return template if plain(template) else None


class StaticKernel:
    """``fn`` compiled ahead per input layout (module doc); ``fallback(*args)`` otherwise."""

    def __init__(self, fn, fallback, layouts: int = MAX_LAYOUTS):
        self.fn, self.fallback, self.layouts = fn, fallback, layouts
        self.compiled: dict = {}
        self.failed, self.misses = False, 0

    def __call__(self, *args):
        if self.failed:
            return self.fallback(*args)
        tensors: list = []
        # The key is metadata only: read it past any torch-function mode or subclass of the
        # caller's (a device context, a FLOP counter, the CPU layer's device mode), which would
        # otherwise take every attribute read (about 3 us each through a mode, measured on CPU).
        grad = torch.is_grad_enabled()
        with torch._C.DisableTorchFunction():
            key = _flatten(args, tensors)
            traced = key is not None and not (grad and any(t.requires_grad for t in tensors))
        if not traced:
            return self.fallback(*args)
        entry = self.compiled.get(key)
        if entry is None:
            if len(self.compiled) >= self.layouts:
                self.misses += 1  # shapes that vary (an expert's token count): stop looking
                self.failed = self.misses > RETIRE * self.layouts
                return self.fallback(*args)
            entry = self._compile(args, tensors)
            if entry is None:
                return self.fallback(*args)
            self.compiled[key] = entry
        artifact, template = entry
        if grad:  # the fold maps and the kernels' autograd Functions already run without grad
            with torch.no_grad():
                out = artifact(*tensors)
        else:
            out = artifact(*tensors)
        return _fill(template, out)

    def _compile(self, args, tensors):
        """(compiled artifact, result template), or None (and ``failed``) when ``fn`` does
        not trace or compile, or returns other than tensors in tuples and lists: then
        dynamo's own compile (or its eager fallback) takes over."""
        from torch._inductor import config as inductor_config  # noqa: PLC0415
        from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

        out_spec = []

        def flat(*ts):
            out, s = pytree.tree_flatten(self.fn(*_substitute(args, iter(ts))))
            out_spec.append(s)
            return out

        try:
            with torch.no_grad():
                gm = make_fx(flat, tracing_mode="fake")(*tensors)
                template = _template(out_spec[-1])
                if template is None:
                    raise TypeError("a result other than tensors in tuples and lists")
                # The lookup has matched every input's shape, strides and offset: the
                # generated code need not assert them again on every call (472 a dense step).
                with inductor_config.patch(size_asserts=False):
                    artifact = torch._inductor.standalone_compile(
                        gm, list(tensors), dynamic_shapes="from_example_inputs")
        except Exception as err:  # tracing or inductor: any failure means "not this way"
            self.failed = True
            warnings.warn(f"precompiling {getattr(self.fn, '__name__', self.fn)} failed "
                          f"({type(err).__name__}: {err}); using torch.compile for it",
                          stacklevel=3)
            return None
        return artifact, template
