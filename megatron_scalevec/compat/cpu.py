"""Run megatron-core (0.16.1-0.19.x) on CPU with gloo: the one compatibility layer.

``enable_cpu_compat()`` does nothing when CUDA is available. Otherwise it installs the patches
below once (idempotent) and returns True. Call it before importing megatron (then megatron is
imported by it with ``torch.compile`` kept eager) or after (already-compiled jit functions are
unwrapped back to eager). The device mode is thread-local in torch: call it again in a new
thread that runs megatron code.

It patches ``torch.cuda`` and ``dist.all_gather`` for the whole process, so only entry points a
user runs call it (our trainer, the converter's and the preprocessor's command lines,
``python -m megatron_scalevec.env``), or the user; library code never does, and until it is
called nothing of ours consults it (tests/compat/test_cpu_off.py).

==  ============================  ==============================  ================================
#   what breaks on CPU            why                             what we do
==  ============================  ==============================  ================================
1   device='cuda', .cuda(),       literal CUDA devices all over   a TorchFunctionMode, entered
    .to('cuda'),                  megatron (masks, buffers, grad  once and kept on, maps cuda/int
    device=current_device()       scaler, schedules)              devices to cpu, .cuda() to
                                                                  identity, drops pin_memory
                                                                  (about 1.5 us per torch call,
                                                                  ~3% of a tiny step)
2   assert p.grad.type() ==       clip_grads, Float16Module,      under the mode Tensor.type()
    'torch.cuda.FloatTensor'      optimizer compare type strings  reports torch.cuda.*;
                                                                  .type('torch.cuda.X') casts to
                                                                  the CPU type
3   torch.cuda.current_device,    CUDA assertion (p2p comm,       current_device() -> 'cpu',
    synchronize, set_device,      dist-ckpt, global buffers)      device_count() -> 1, the others
    device_count                                                  no-ops
4   CUDA RNG tracker              _get/_set_cuda_rng_state,       use the CPU default generator;
    fork()/add()                  torch.cuda.get/set_rng_state    drop the tracker's 'CPU RNG
                                  need CUDA                       state changed' warning (one RNG
                                                                  on CPU)
5   TRAP: torch.cuda.manual_seed  every TP rank would get the     it seeds the CPU default
    as a no-op                    same model-parallel RNG state   generator
6   moe_utils.te_general_gemm     NameError without TE (0.16.1    define it as None
                                  bug)
7   torch.cuda.Stream, Event,     alltoall dispatcher and shared  no-op stream/event objects;
    current_stream, stream()      experts use side streams        stream() is a null context
8   alltoall split sizes          maybe_move_tensor_to_cpu        CPU tensors asked for as_numpy
                                  converts only CUDA tensors:     become numpy arrays, as on GPU
                                  splits stay tensors,
                                  all_to_all_single TypeError
9   uneven dist.all_gather on     ProcessGroupGloo::allgather:    padded all_gather_into_tensor
    gloo (alltoall with EP and    invalid tensor size             and slices (uneven list
    expert-TP > 1)                                                reduce_scatter works on gloo)
10  dist_checkpointing sync save  results queue from a spawn      a plain queue.Queue() while a
                                  Manager: 5-8 s, re-imports      sync save() runs
                                  __main__, hangs without a main
                                  guard
11  megatron.core.jit: jit_fuser  import 5 s instead of 2 s;      torch.compile eager while we
    = torch.compile at import     inductor compiles fused         import megatron,
                                  functions on CPU                disable_jit_fuser(), unwrap
                                                                  compiled functions
12  activation recompute          the forward that a checkpoint   its backward runs inside the
                                  re-runs in backward runs        device mode (patch 1)
                                  without the device mode
                                  (causal mask on 'cuda')
13  selective recompute of        CheckpointWithoutOutput takes   without TE (no FP8 possible)
    layernorm / moe_act           its FP8 branch always (``fp8    its fp8 flag is set False
                                  is not None``, 0.16.1): TE
                                  names undefined without TE
14  torch's CUDA build on a CPU    torch.utils.cpp_extension,      its logger is told to keep
    machine (CI's Python 3.12     imported by megatron-core 0.19, warnings to itself (errors
    leg)                          warns "No CUDA runtime is       still show)
                                  found" at import
15  our fused kernel bodies       dynamo guards on the mode of   the bodies run outside the
    compiled twice per shape      patch 1 (on in forward, off    mode (compile.run_bodies_inside)
                                  on autograd's backward thread)
16  pipeline schedules free a     gloo's isend reads the buffer  the freed storage stays
    sent activation's storage     on its own thread after the    referenced by the tensor until
    (deallocate_pipeline_         call returns (CUDA's caching   its backward: the interleaved
    outputs, Megatron-LM's        allocator keeps it for NCCL's  schedule (PP2 + VPP) sent freed
    default) right after isend    stream): a freed buffer is     memory (NaN, or a loss varying
                                  sent                           run to run)
==  ============================  ==============================  ================================
"""

import contextlib
import functools
import logging
import queue
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from megatron_scalevec import compile as fused_compile
from megatron_scalevec.compat import mcore

__all__ = ["enable_cpu_compat", "is_cpu_compat_enabled"]

_ENABLED = False
_LOCK = threading.Lock()
_TLS = threading.local()
_SYNC_SAVE = threading.local()


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return isinstance(dev, int) and not isinstance(dev, bool)


def _cpu_type(t):
    if isinstance(t, torch.dtype):
        return t
    name = t if isinstance(t, str) else f"{t.__module__}.{t.__name__}"
    return name.replace("torch.cuda.", "torch.")


class _CudaAsCpuMode(TorchFunctionMode):
    """Map every CUDA device request to the CPU (patches 1, 2)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SPECIAL:
            return _SPECIAL[func](func, args, kwargs)
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def _tensor_to(func, args, kwargs):
    args = tuple("cpu" if i and _is_cuda_device(a) else a for i, a in enumerate(args))
    if _is_cuda_device(kwargs.get("device")):
        kwargs = {**kwargs, "device": "cpu"}
    return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    kwargs = dict(kwargs)
    dtype = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
    if dtype is None:
        name = func(args[0])
        return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
    return func(args[0], _cpu_type(dtype), **kwargs)


_SPECIAL = {
    torch.Tensor.to: _tensor_to,
    torch.Tensor.cuda: lambda func, args, kwargs: args[0],
    torch.Tensor.pin_memory: lambda func, args, kwargs: args[0],
    torch.Tensor.record_stream: lambda func, args, kwargs: None,
    torch.Tensor.type: _tensor_type,
}
_MODE = _CudaAsCpuMode()


class _Stream:
    """No-op stand-in for ``torch.cuda.Stream`` and ``torch.cuda.Event`` (patch 7)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    wait_event = record = wait = synchronize = wait_stream

    def record_event(self, event=None):
        return event if event is not None else _Stream()

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CURRENT_STREAM = _Stream()


def _cpu_rng_state(*args, **kwargs):
    return torch.default_generator.get_state()


def _set_cpu_rng_state(new_state, *args, **kwargs):
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.default_generator.set_state(new_state)


def _seed_cpu(seed):
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda():
    cuda = torch.cuda
    noop = lambda *args, **kwargs: None  # noqa: E731
    for name, value in {
        "current_device": lambda: "cpu",
        "device_count": lambda: 1,
        "synchronize": noop,
        "set_device": noop,
        "Stream": _Stream,
        "Event": _Stream,
        "current_stream": lambda *args, **kwargs: _CURRENT_STREAM,
        "default_stream": lambda *args, **kwargs: _CURRENT_STREAM,
        "set_stream": noop,
        "stream": lambda *args, **kwargs: contextlib.nullcontext(),
        "get_rng_state": _cpu_rng_state,
        "set_rng_state": _set_cpu_rng_state,
        "get_rng_state_all": lambda: [_cpu_rng_state()],
        "set_rng_state_all": lambda states: _set_cpu_rng_state(states[0]),
        "manual_seed": _seed_cpu,  # patch 5: never a no-op
        "manual_seed_all": _seed_cpu,
    }.items():
        if not isinstance(value, type):
            # A distinct function per name: torch._dynamo's trace rules refuse one object
            # registered under two torch.cuda names.
            value = (lambda fn: lambda *args, **kwargs: fn(*args, **kwargs))(value)
        setattr(cuda, name, value)
        if hasattr(cuda.random, name):
            setattr(cuda.random, name, value)


def _eager_compile(model=None, **kwargs):
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def _eager_torch_compile():
    saved = torch.compile
    torch.compile = _eager_compile
    try:
        yield
    finally:
        torch.compile = saved


def _compiled_original(value):
    """The eager function behind a torch.compile'd one, else None. Any lookup that raises is
    "not compiled": Megatron-Bridge's ``safe_import`` placeholders raise on every attribute."""
    try:
        return getattr(value, "_torchdynamo_orig_callable", None)
    except Exception:  # noqa: BLE001 -- a placeholder's UnavailableError, whatever its type
        return None


def _unwrap_compiled_in_megatron():
    """Replace already torch.compile'd functions (module and class level) by the originals."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron.") or mod is None:
            continue
        classes = [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == name]
        for holder in [mod, *classes]:
            for attr, value in list(vars(holder).items()):
                orig = _compiled_original(value)
                if orig is not None:
                    setattr(holder, attr, orig)


def _uneven_all_gather(orig):
    @functools.wraps(orig)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list}
        if async_op or len(shapes) == 1 or torch.distributed.get_backend(group) != "gloo":
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        width = max(t.numel() for t in tensor_list)
        padded = tensor.new_zeros(width)
        padded[: tensor.numel()] = tensor.reshape(-1)
        out = tensor.new_empty(width * len(tensor_list))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        for i, t in enumerate(tensor_list):
            t.copy_(out[i * width : i * width + t.numel()].view(t.shape))
        return None

    return all_gather


def in_device_mode(fn):
    """``fn`` run under the device mode (patch 1): for code that runs on autograd's backward
    thread, where the thread-local mode entered by ``enable_cpu_compat`` is not on."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _CudaAsCpuMode():
            return fn(*args, **kwargs)

    return run


def _patch_megatron():
    from megatron.core import jit
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    jit.disable_jit_fuser()
    _unwrap_compiled_in_megatron()
    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state
    logging.getLogger(mrandom.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG" not in record.getMessage()
    )

    for name in ("CheckpointFunction", "CheckpointWithoutOutputFunction"):  # patch 12
        fn = getattr(mrandom, name, None)
        if fn is not None:
            fn.backward = staticmethod(in_device_mode(fn.backward))

    without_output = getattr(mrandom, "CheckpointWithoutOutput", None)
    if without_output is not None and not hasattr(mrandom, "FP8GlobalStateManager"):  # 13
        init = without_output.__init__

        @functools.wraps(init)
        def no_fp8(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.fp8 = False

        without_output.__init__ = no_fp8

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    orig_move = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(orig_move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":  # already there (also
            # when the test-only TE stand-in makes `is_cuda` answer True)
            return tensor.detach().numpy().copy() if as_numpy else tensor
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    schedules = sys.modules.get("megatron.core.pipeline_parallel.schedules")
    if schedules is None:
        from megatron.core.pipeline_parallel import schedules
    free = schedules.deallocate_output_tensor

    @functools.wraps(free)
    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):  # patch 16
        sent = out.data if deallocate_pipeline_outputs and torch.is_tensor(out) else None
        free(out, deallocate_pipeline_outputs)
        if sent is not None:
            out._cpu_sent_storage = sent  # until the output (and its backward) is gone

    schedules.deallocate_output_tensor = deallocate_output_tensor

    # patch 10; the factory and the class that owns the sync save() moved in 0.17 (mcore.py)
    def sync_queue(orig):
        @functools.wraps(orig)
        def results_queue(*args, **kwargs):
            return queue.Queue() if getattr(_SYNC_SAVE, "active", False) else orig(*args, **kwargs)

        return results_queue

    mcore.patch_results_queue(sync_queue)
    strategy = mcore.sync_save_strategy_class()
    orig_save = strategy.save

    @functools.wraps(orig_save)
    def save(self, *args, **kwargs):
        _SYNC_SAVE.active = True
        try:
            return orig_save(self, *args, **kwargs)
        finally:
            _SYNC_SAVE.active = False

    strategy.save = save


@contextlib.contextmanager
def _outside_device_mode():
    """The fused kernel bodies run without the device mode (patch 15): they name no device,
    and it is on in forward only, so dynamo would compile each body once with it and once
    without. Private ``torch.overrides._get_current_function_mode_stack`` and
    ``_pop_mode_temporarily``, checked on torch 2.13.0 (no public way to leave a mode)."""
    modes = torch.overrides._get_current_function_mode_stack()
    if modes and isinstance(modes[-1], _CudaAsCpuMode):
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield


def _enter_mode_in_this_thread():
    if not getattr(_TLS, "mode_on", False):
        _MODE.__enter__()
        _TLS.mode_on = True


def enable_cpu_compat() -> bool:
    """Install the CPU patches (see the module docstring). Returns False on a CUDA machine."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if not _ENABLED:
            _patch_torch_cuda()
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # patch 14
            torch.distributed.all_gather = _uneven_all_gather(torch.distributed.all_gather)
            fused_compile.run_bodies_inside(_outside_device_mode)  # patch 15
            with _eager_torch_compile():
                _patch_megatron()
            _ENABLED = True
        _enter_mode_in_this_thread()
    return True


def is_cpu_compat_enabled() -> bool:
    """True once ``enable_cpu_compat()`` has installed the patches."""
    return _ENABLED
