"""``torch.compile`` for the fused kernel bodies (layers/fused.py, glu.py, fold.py), in one place.

Each body is a plain tensor function; its module calls ``kernel(body)(*args)`` (or
``rows_kernel`` for a body over a varying number of rows) and gets it compiled or eager:

* ``auto`` (default) compiles: ``unified``'s CPU step is 1.31x ``shared``'s with the bodies
  eager, 1.02x compiled (docs/benchmarks.md); what compiling saves is passes over the
  activations, not host work. Where inductor cannot compile (no C++ compiler), ``auto`` runs
  every body eagerly from then on, after one warning.
* ``on`` compiles and raises what compiling raises; ``off`` runs eagerly (the tests: compiling
  every shape of every test costs more than the tests).

The mode comes from ``MEGATRON_SCALEVEC_FUSED_COMPILE`` or :func:`set_mode` (the trainer's
``--fused-compile``). One compiled function per body and ``dynamic``: ``dynamic=False`` for
bodies whose shapes are the weights' (a few per model, never a token count).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

ENV = "MEGATRON_SCALEVEC_FUSED_COMPILE"
MODES = ("auto", "on", "off")
_mode = os.environ.get(ENV, "auto")
_eager = False  # auto found no working compiler: eager for good


def set_mode(mode: str) -> None:
    """``auto`` (compiled; eager once compiling has failed), ``on`` or ``off``."""
    global _mode
    _check(mode, "fused compile mode")
    _mode = mode


def mode() -> str:
    return _mode


def _check(value: str, what: str) -> None:
    if value not in MODES:
        raise ValueError(f"{what} must be auto, on or off, got {value!r}")


def run_bodies_inside(context) -> None:
    """Run every compiled body inside ``context()`` from now on: how a compatibility layer
    steps out of state that dynamo guards on but no body reads (compat/cpu.py's device mode,
    on in forward and off on autograd's backward thread, would compile each body twice).
    Only ``enable_cpu_compat`` calls it: until then a compiled call enters no context."""
    global _run
    plain = _run_plain

    def _run(body, args):
        with context():  # first: a torch function mode also sees each requires_grad read
            return plain(body, args)


def kernel(fn, dynamic: Optional[bool] = None):
    """``fn`` through ``torch.compile`` as the mode says, else ``fn`` itself."""
    _check(_mode, f"{ENV} / fused compile mode")
    if _mode == "off" or (_mode == "auto" and _eager):
        return fn
    return compiled(fn, dynamic)


def rows_kernel(fn, z: torch.Tensor, *tensors):
    """:func:`kernel` for a body over ``z``'s rows, whose count varies (MoE experts: a new
    count each micro-batch). Eager below two rows: dynamo specializes sizes 0 and 1, which a
    sequential expert meets often (a recompile each, up to dynamo's limit). The last dim of
    ``z`` and ``tensors`` is marked static: once two row counts differ, dynamo's automatic
    dynamic shapes would make every size symbolic (a dense GLU kernel ran 1.4x slower so).
    ``torch._dynamo.mark_static`` is private (no public equivalent in torch 2.13.0, where it is
    checked)."""
    for t in (z, *tensors):
        if t is not None and t.dim():
            torch._dynamo.mark_static(t, t.dim() - 1)
    return fn if z.shape[0] < 2 else kernel(fn)


@functools.cache
def compiled(fn, dynamic: Optional[bool] = None):
    """``torch.compile(fn, dynamic=dynamic)``, once per pair; under ``auto`` a compile error
    switches every body to eager for good, with one warning."""
    body = torch.compile(fn, dynamic=dynamic)

    @functools.wraps(fn)
    def call(*args):
        global _eager
        if _eager and _mode == "auto":
            return fn(*args)
        try:
            return _run(body, args)
        except Exception as err:  # inductor raises many types (no compiler, unsupported op)
            if _mode != "auto" or not _compile_error(err):
                raise
            _eager = True
            warnings.warn(f"torch.compile of the fused DNP kernels failed ({type(err).__name__});"
                          f" running them eagerly (set {ENV}=off to skip compiling)",
                          stacklevel=2)
            return fn(*args)

    return call


def _run_plain(body, args):
    """``body(*args)`` so that its compiled code is found again, not compiled once more: dynamo
    guards on each tensor's ``requires_grad``, which no body reads (plain tensor math, called
    inside autograd Functions, grad off): under no grad its tensors go in detached."""
    if not torch.is_grad_enabled():
        args = tuple(map(_detached, args))
    return body(*args)


_run = _run_plain  # what a compiled call runs; run_bodies_inside() wraps it


def _detached(a):
    if isinstance(a, torch.Tensor):
        return a.detach() if a.requires_grad else a
    return tuple(map(_detached, a)) if type(a) is tuple else a


def _compile_error(err: Exception) -> bool:
    """An error raised by torch.compile's own machinery, told by its module: torch's private
    ``torch._dynamo`` / ``torch._inductor`` packages (names checked on torch 2.13.0; there is no
    public base class for compile errors)."""
    mod = type(err).__module__ or ""
    return mod.startswith("torch._dynamo") or mod.startswith("torch._inductor")
