"""The GPU cost ledger's measuring methods, device-free (benchmarks/ledger_report.py runs them).

Each answers one question a GPU pays for, measured on CPU where the answer does not depend on
the device:

* :func:`kept_bytes`: bytes still alive after a forward that the forward allocated (what the
  micro-batch keeps for its backward), found by weak references to every fresh storage an aten
  op returned, so tensors pinned on an autograd ``ctx`` (TE's ``ctx.weight = ...``) count as
  well as those saved through ``save_for_backward``;
* :class:`Traffic`: bytes every aten op reads and writes (its tensor inputs and outputs), the
  memory traffic of a bandwidth-bound kernel;
* :class:`Collectives`: ``torch.distributed`` calls by name (outermost only: a wrapper that
  calls another collective counts once);
* :class:`HostSyncs`: calls that block the host on a GPU (device-to-host reads, data-dependent
  output shapes, host data sent to a device);
* :func:`split`: a step's total at two micro-batch counts -> (per step, per micro-batch).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Collectives", "HostSyncs", "Traffic", "kept_bytes", "split"]

_aten = torch.ops.aten


def _tensors(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _alias_or_write(func) -> tuple[bool, set]:
    """(the op is a view: every return aliases an input it does not write, names of the
    arguments the op writes)."""
    schema = func._schema
    views = [r.alias_info is not None and not r.alias_info.is_write for r in schema.returns]
    written = {a.name for a in schema.arguments if a.alias_info is not None and
               a.alias_info.is_write}
    return bool(views) and all(views), written


class _FreshStorages(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returned that aliases no input
    (a fresh allocation)."""

    def __init__(self):
        super().__init__()
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases, written = _alias_or_write(func)
        if not aliases and not written:
            for t in _tensors(out):
                self.refs.append(weakref.ref(t.untyped_storage()))
        return out


def kept_bytes(forward, exclude=()) -> int:
    """Bytes of the storages ``forward()`` allocated that are still alive once it returned
    (deduplicated by address), less those of its result and of ``exclude``: what one
    micro-batch keeps for its backward. Run a forward before, so one-time caches (RoPE
    tables, workspaces) are not new any more."""
    mode = _FreshStorages()
    with mode:
        result = forward()
    skip = {t.untyped_storage().data_ptr() for t in _tensors((result, list(exclude)))}
    alive = {}
    for ref in mode.refs:
        s = ref()
        if s is not None and s.data_ptr() not in skip:
            alive[s.data_ptr()] = s.nbytes()
    del result
    return sum(alive.values())


# allocations and host reads move no device memory of their own
_FREE = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
         _aten.new_empty.default, _aten.new_empty_strided.default,
         _aten._local_scalar_dense.default}


_WRITE_ONLY = {_aten.copy_.default, _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}


class Traffic(TorchDispatchMode):
    """Bytes every aten op reads and writes: its tensor inputs plus its outputs (an argument
    written in place is read too, but not by ``copy_`` / ``fill_`` / ``zero_`` / ``out=``);
    views and bare allocations move nothing.
    ``by_op`` keeps the bytes per op name (what a difference between variants comes from)."""

    active: list = []  # the Traffic modes entered, innermost last

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.by_op: collections.Counter = collections.Counter()
        self.quiet = 0

    def __enter__(self):
        Traffic.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        Traffic.active.remove(self)
        return super().__exit__(*exc)

    @staticmethod
    def one_op(eager, name: str):
        """``eager`` counted as one fused kernel while a Traffic is entered (its tensor
        arguments read, its outputs written, none of its own intermediates): what a compiled
        kernel body pays. Outside, it runs as it is."""

        @functools.wraps(eager)
        def call(*args):
            if not Traffic.active:
                return eager(*args)
            self = Traffic.active[-1]
            self.quiet += 1
            try:
                out = eager(*args)
            finally:
                self.quiet -= 1
            n = sum(t.numel() * t.element_size() for t in _tensors(args) + _tensors(out))
            self.bytes += n
            self.by_op[f"fused:{name}"] += n
            return out
        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        aliases, written = _alias_or_write(func)
        if self.quiet or aliases or func in _FREE:
            return out
        # a written argument is read too (``add_``), unless the op only writes it
        unread = written if func in _WRITE_ONLY else {n for n in written if
                                                      n.startswith("out")}
        names = [a.name for a in func._schema.arguments]
        read = [v for n, v in zip(names, args) if n not in unread]
        read += [v for n, v in kwargs.items() if n not in unread]
        n = sum(t.numel() * t.element_size() for t in _tensors(read) + _tensors(out))
        self.bytes += n
        self.by_op[func.overloadpacket.__name__] += n
        return out


# --------------------------------------------------------------------- collectives
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
               "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
               "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object")
_PACKAGES = ("megatron", "transformer_engine", "torch.distributed")


class Collectives:
    """Counts ``torch.distributed`` calls by name while entered. Megatron-core binds some at
    import (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``): every module
    of megatron, TE and torch.distributed that holds one of them is patched too, and restored
    on exit. Only the outermost call counts (compat/cpu.py's all_gather calls another)."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self._depth = 0
        self._patched: list = []

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.calls[name] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def __enter__(self):
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        targets = dict.fromkeys([dist, c10d] + [m for n, m in list(sys.modules.items())
                                                if m is not None and n.startswith(_PACKAGES)])
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            wrapped = self._wrap(name, fn)
            for mod in targets:  # any module attribute bound to the original
                for attr, value in list(vars(mod).items()):
                    if value is fn:
                        self._patched.append((mod, attr, value))
                        setattr(mod, attr, wrapped)
        return self

    def __exit__(self, *exc):
        for mod, attr, value in reversed(self._patched):
            setattr(mod, attr, value)
        self._patched.clear()
        return False


# --------------------------------------------------------------------- host syncs
# device -> host: the host waits for the device's queue to drain
_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"}
# host data -> a device tensor (pageable: the host waits for the copy)
_FACTORIES = {"tensor", "as_tensor"}
# data-dependent output shapes: the host reads a count back before it can allocate
_SHAPES = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
           _aten.unique_dim.default, _aten.unique_consecutive.default,
           _aten.bincount.default}


class HostSyncs(contextlib.ExitStack):
    """Counts, by kind, the calls that block the host on a GPU: device-to-host reads (``item``,
    ``tolist``, ``cpu``, ``float(t)``...; aten ``_local_scalar_dense`` from C++ included),
    tensors made from host data with an explicit device, ``.cuda()`` / ``.to(cuda)`` without
    ``non_blocking``, data-dependent shapes (``nonzero``, boolean indexing, ``repeat_interleave``
    without ``output_size``, ``unique``...). On CPU every tensor is a host tensor, so the count
    is of calls, as a GPU run would make them."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.quiet = 0  # inside a counted Python-level call: its aten ops are part of it

    def __enter__(self):
        super().__enter__()
        self.enter_context(_SyncFunctions(self))
        self.enter_context(_SyncOps(self))
        return self

    def total(self) -> int:
        return sum(self.calls.values())


class _SyncFunctions(torch.overrides.TorchFunctionMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        kind = None
        if name in _READS:
            kind = f"d2h:{name}"
        elif name in _FACTORIES and "device" in kwargs and args and \
                not isinstance(args[0], torch.Tensor):
            kind = f"h2d:{name}"
        elif name in ("cuda", "to") and not kwargs.get("non_blocking") and \
                _to_cuda(name, args[1:], kwargs):
            kind = f"h2d:{name}"
        if kind is None:
            return func(*args, **kwargs)
        self.owner.calls[kind] += 1
        self.owner.quiet += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.owner.quiet -= 1


def _to_cuda(name, args, kwargs) -> bool:
    if name == "cuda":
        return True
    dev = kwargs.get("device", args[0] if args else None)
    return isinstance(dev, (str, torch.device, int)) and not isinstance(dev, bool) and \
        (isinstance(dev, int) or torch.device(dev).type == "cuda")


class _SyncOps(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.owner.quiet:
            name = func.overloadpacket.__name__
            if func is _aten._local_scalar_dense.default:
                self.owner.calls["d2h:scalar"] += 1
            elif func in _SHAPES:
                self.owner.calls[f"shape:{name}"] += 1
            elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self.owner.calls["shape:repeat_interleave"] += 1
            elif func in (_aten.index.Tensor, _aten.index_put_.default,
                          _aten.index_put.default) and any(
                    t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])):
                self.owner.calls[f"shape:{name}[bool]"] += 1
        return func(*args, **kwargs)


def split(total_1: float, total_m: float, m: int) -> tuple[float, float]:
    """(per step, per micro-batch) from a step's totals at 1 and ``m`` micro-batches
    (``total = per_step + micro_batches * per_micro_batch``)."""
    per_mb = (total_m - total_1) / (m - 1)
    return total_1 - per_mb, per_mb
