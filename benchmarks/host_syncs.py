"""Host <-> device transfers and syncs of one call (tests/layers/test_host_syncs.py; on a GPU
through tools/gpu_check.sh): what stalls the CPU's run-ahead on a GPU.

:func:`count_host_syncs` runs ``fn`` under a ``TorchDispatchMode`` plus a few patched
``torch.Tensor`` methods and counts, per kind:

* ``upload``: a blocking host -> device copy (``t.to(device)`` / ``copy_`` / ``torch.tensor(data,
  device=...)`` of host data, or a host tensor consumed by a device op, as an index);
* ``upload_async``: ``non_blocking=True`` from pinned memory (no stall; on a CPU run, where
  nothing can be pinned, any ``non_blocking=True`` upload);
* ``download``: device -> host (``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")``);
  ``download_async`` when non-blocking;
* ``sync``: a device value read on the host (``.item()``, ``int()``, ``bool()``) or an op whose
  output shape depends on device values (``nonzero``, boolean masks, ``repeat_interleave``
  without ``output_size``, ``unique``), ``torch.cuda.synchronize``.

On CUDA a tensor's place is its device. On a CPU run (``simulate``) everything is on the CPU,
so what *would* live on the host is followed by provenance: the tensors given as ``host``,
tensors built from Python data, factory tensors built without an explicit ``device=`` and what
is computed from host tensors only; every other tensor (parameters, inputs, tensors built with
``device=x.device``) counts as on the device. Heuristic where CPU code cannot tell intent: a
``.to(torch.device)`` of a device tensor is a no-op, ``.to("cpu")`` / ``.cpu()`` a download.

:func:`no_cuda_syncs` is the CUDA check itself: ``torch.cuda.set_sync_debug_mode("error")``
around ``fn`` (a synchronizing call raises).
"""

from __future__ import annotations

import collections
import contextlib
import warnings

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["KINDS", "SyncCounter", "count_host_syncs", "cuda_syncs", "experts_report",
           "experts_step", "no_cuda_syncs", "stalls"]

KINDS = ("upload", "upload_async", "download", "download_async", "sync")
aten = torch.ops.aten

# ops whose output shape is read from device values (a device -> host sync on a GPU)
_DATA_SHAPED = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                "unique_consecutive", "equal", "is_nonzero", "masked_scatter"}
_FACTORIES = {getattr(torch, n) for n in (
    "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "linspace",
    "logspace", "eye", "empty_strided", "randperm", "scalar_tensor", "zeros_like", "ones_like",
    "full_like", "empty_like", "rand_like", "randn_like", "randint_like")}


def stalls(counts: dict) -> int:
    """The events that stall the CPU: blocking copies and syncs (not ``*_async``)."""
    return sum(counts.get(k, 0) for k in KINDS if not k.endswith("_async"))


class SyncCounter(TorchDispatchMode):
    """The counting mode (:func:`count_host_syncs`); ``counts`` per kind, ``where`` the op or
    call of each event in order."""

    def __init__(self, simulate: bool, host=()):
        super().__init__()
        self.simulate = simulate
        self.counts = collections.Counter({k: 0 for k in KINDS})
        self.where = []
        self._host = WeakIdKeyDictionary()
        self._quiet = 0  # inside a patched call that counted itself
        for t in host:
            self._host[t] = True

    # ------------------------------------------------------------ places
    def is_host(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return False
        return (t in self._host) if self.simulate else True

    def mark(self, t, host: bool):
        if self.simulate and isinstance(t, torch.Tensor):
            if host:
                self._host[t] = True
            else:
                self._host.pop(t, None)
        return t

    def event(self, kind: str, what: str) -> None:
        if not self._quiet:
            self.counts[kind] += 1
            self.where.append((kind, what))

    # ------------------------------------------------------------ aten ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        big = [t for t in ins if t.dim() > 0]  # 0-dim ones (wrapped scalars) take no side
        dev = [t for t in (big or ins) if not self.is_host(t)]
        if name in ("_to_copy", "copy_"):
            self._copy(name, str(func), args, kwargs)
        elif dev:
            if self._data_shaped(func, name, args, kwargs):
                self.event("sync", str(func))
            for t in big:
                if self.is_host(t):
                    self.event("upload", f"{func} (a host tensor as operand)")
        out = func(*args, **kwargs)
        if self.simulate:
            if name in ("_to_copy", "copy_"):  # a cast or a copy into: the place of args[0]
                on_host = self.is_host(args[0])
            else:  # computed from host tensors only; a factory: _Factories decides
                on_host = bool(ins) and not dev
            for t in pytree.tree_leaves(out):
                self.mark(t, on_host)
        return out

    def _data_shaped(self, func, name, args, kwargs) -> bool:
        if name in _DATA_SHAPED or name == "_local_scalar_dense" or self._bool_index(name,
                                                                                     args):
            return True
        return (name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
                and kwargs.get("output_size") is None)

    @staticmethod
    def _bool_index(name, args) -> bool:
        if name not in ("index", "index_put", "index_put_", "_index_put_impl_"):
            return False
        idx = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in idx or ())

    def _copy(self, name, what, args, kwargs):
        """A cross-place copy: ``_to_copy`` on CUDA (on a CPU run the patched Tensor.to counts
        it), ``copy_`` everywhere."""
        src = args[0] if name == "_to_copy" else args[1]
        non_blocking = bool(kwargs.get("non_blocking", len(args) > 2 and args[2]))
        if name == "copy_":
            dst_host = self.is_host(args[0])
        elif self.simulate or kwargs.get("device") is None:
            return
        else:
            dst_host = torch.device(kwargs["device"]).type == "cpu"
        src_host = self.is_host(src)
        if src_host and not dst_host:
            pinned = self.simulate or src.is_pinned()
            self.event("upload_async" if non_blocking and pinned else "upload", what)
        elif dst_host and not src_host:
            self.event("download_async" if non_blocking else "download", what)

    # ------------------------------------------------------------ Python-level reads/copies
    @contextlib.contextmanager
    def quiet(self):
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1


class _Factories(TorchFunctionMode):
    """Factories (``torch.arange``, ``zeros``, ``*_like``, ...) as called: built without
    ``device=`` (or with ``"cpu"``) on the host, with ``device=x.device`` on the device (aten
    always sees an explicit device)."""

    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.counter.simulate and func in _FACTORIES:
            device = kwargs.get("device")
            if device is not None:
                self.counter.mark(out, device == "cpu")
            elif not func.__name__.endswith("_like"):
                self.counter.mark(out, True)
        return out


def _parse_to(args, kwargs):
    if args and isinstance(args[0], torch.Tensor):
        other = args[0]
        return other.device, bool(kwargs.get("non_blocking", args[1] if len(args) > 1
                                             else False)), False
    device, _dtype, non_blocking, *_ = torch._C._nn._parse_to(*args, **kwargs)
    to_cpu_str = any(a == "cpu" for a in (*args, kwargs.get("device")) if isinstance(a, str))
    return device, non_blocking, to_cpu_str


def _patches(counter: SyncCounter) -> dict:
    """Replacements of torch.Tensor methods and torch functions (restored on exit)."""
    orig = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy", "cpu", "to")}
    orig_tensor, orig_as_tensor = torch.tensor, torch.as_tensor

    def read(n):
        def f(self, *a, **k):
            if not counter.is_host(self):
                counter.event("download", f"Tensor.{n}")
            with counter.quiet():
                out = orig[n](self, *a, **k)
                if out is self:  # .cpu() of a CPU tensor: a host alias (simulated)
                    out = self.view_as(self)
            return counter.mark(out, True)
        return f

    def to(self, *a, **k):
        device, non_blocking, to_cpu_str = _parse_to(a, k)
        with counter.quiet():
            out = orig["to"](self, *a, **k)
        if device is None:
            return out
        host_src = counter.is_host(self)
        if counter.simulate:
            if host_src and not to_cpu_str:
                counter.event("upload_async" if non_blocking else "upload", "Tensor.to")
                if out is self:
                    with counter.quiet():
                        out = self.view_as(self)
                return counter.mark(out, False)
            if not host_src and to_cpu_str:
                counter.event("download_async" if non_blocking else "download", "Tensor.to")
                if out is self:
                    with counter.quiet():
                        out = self.view_as(self)
                return counter.mark(out, True)
            return out
        if host_src and device.type != "cpu":
            pinned = self.is_pinned()
            counter.event("upload_async" if non_blocking and pinned else "upload", "Tensor.to")
        elif not host_src and device.type == "cpu":
            counter.event("download_async" if non_blocking else "download", "Tensor.to")
        return out

    def creator(fn, fname):
        def f(data, *a, **k):
            device = k.get("device")
            if isinstance(data, torch.Tensor):
                return counter.mark(to(data, device), counter.is_host(data)) \
                    if device is not None else fn(data, *a, **k)
            with counter.quiet():
                out = fn(data, *a, **k)
            uploaded = device is not None and (
                device != "cpu" if counter.simulate else torch.device(device).type != "cpu")
            if uploaded:
                counter.event("upload", f"torch.{fname}(host data, device=...)")
            return counter.mark(out, not uploaded)
        return f

    def synchronize(*a, **k):
        counter.event("sync", "torch.cuda.synchronize")
        return orig_sync(*a, **k)

    orig_sync = torch.cuda.synchronize
    return {(torch.Tensor, "tolist"): read("tolist"), (torch.Tensor, "numpy"): read("numpy"),
            (torch.Tensor, "cpu"): read("cpu"), (torch.Tensor, "to"): to,
            (torch, "tensor"): creator(orig_tensor, "tensor"),
            (torch, "as_tensor"): creator(orig_as_tensor, "as_tensor"),
            (torch.cuda, "synchronize"): synchronize}


def count_host_syncs(fn, *, host=(), simulate=None) -> dict:
    """``{'counts': {kind: n}, 'where': [(kind, op)], 'result': fn()}`` for one call of
    ``fn`` (forward and backward inside it, as the caller writes). ``host``: tensors that live
    on the host (e.g. a dispatcher's host ``tokens_per_expert``); ``simulate``: follow places
    by provenance (default: when CUDA is not in use)."""
    if simulate is None:
        simulate = not torch.cuda.is_initialized()
    counter = SyncCounter(simulate, host)
    patches = _patches(counter)
    saved = {key: getattr(*key) for key in patches}
    for (owner, attr), f in patches.items():
        setattr(owner, attr, f)
    try:
        with _Factories(counter), counter:
            result = fn()
    finally:
        for (owner, attr), f in saved.items():
            setattr(owner, attr, f)
    return {"counts": dict(counter.counts), "where": counter.where, "result": result}


@contextlib.contextmanager
def cuda_sync_errors():
    """``torch.cuda.set_sync_debug_mode("error")`` inside: a synchronizing CUDA call raises."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def cuda_syncs(fn) -> int:
    """Synchronizing CUDA calls while ``fn()`` runs: CUDA's sync debug mode at ``warn`` (one
    warning per call), counted."""
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchronizing" in str(w.message) for w in caught)


def no_cuda_syncs(fn):
    """``fn()`` with CUDA's sync debug mode at ``error`` (after one synchronize, outside): for
    tools/gpu_check.sh, around one forward and backward of the grouped experts given a host or
    device ``tokens_per_expert``. Returns ``fn()``; raises RuntimeError at the first sync."""
    torch.cuda.synchronize()
    with cuda_sync_errors():
        return fn()


def experts_step(experts, counts, hidden: int, device="cpu", host: bool = True,
                 dtype=torch.float32):
    """``(step, host_tensors)``: one forward + backward of an MoE layer's ``experts`` module
    over ``sum(counts)`` rows, with ``tokens_per_expert`` on the host (the allgather / alltoall
    dispatchers) or on ``device`` (flex, drop-and-pad); inputs built outside the step."""
    g = torch.Generator().manual_seed(0)
    rows = sum(counts)
    x = torch.randn(rows, hidden, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(rows, generator=g).to(device)
    dy = torch.randn(rows, hidden, generator=g).to(device, dtype)
    tokens_per_expert = torch.tensor(counts)
    if not host:
        tokens_per_expert = tokens_per_expert.to(device)

    def step():
        out, _ = experts(x, tokens_per_expert, probs)
        out.backward(dy)

    return step, ((tokens_per_expert,) if host else ())


def experts_report(experts, counts, hidden: int, device="cpu", dtype=torch.float32) -> dict:
    """``{host: counts}`` of :func:`count_host_syncs` for one step of ``experts`` with host and
    device ``tokens_per_expert`` (``simulate`` on a CPU device). On CUDA (tools/gpu_check.sh)
    the device-counts step runs first under :func:`no_cuda_syncs` (a warm-up outside it), which
    raises at the first synchronizing call of ours or megatron-core's."""
    out = {}
    cuda = torch.device(device).type == "cuda"
    for host in (True, False):
        step, host_tensors = experts_step(experts, counts, hidden, device, host, dtype)
        if cuda:
            step()  # warm-up: allocator, kernels, lazy init
            if not host:
                no_cuda_syncs(step)
        r = count_host_syncs(step, host=host_tensors, simulate=not cuda)
        out[host] = {**r["counts"], "where": r["where"]}
    return out
