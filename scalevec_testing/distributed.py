"""Run a function on N gloo ranks forked from a parent that already imported megatron.

Forking skips the interpreter start and the torch/megatron imports (about 1 s per layout instead
of 9-20 s with ``torchrun``). Each rank runs ``fn(rank, world_size, *args, **kwargs)`` with the
CPU compatibility layer enabled, one intra-op thread and gloo groups with one worker thread
(:func:`one_gloo_worker_thread`); return values come back to the parent through a pipe,
ordered by rank.

The parent must never have created a gloo process group itself (not even one it destroyed
since): gloo keeps process-wide transport state, and forked children then abort or segfault
when they create their own groups. Run single-process megatron code as ``run_on_ranks(fn, 1)``.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import random
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from megatron_scalevec.compat.cpu import enable_cpu_compat

__all__ = ["RankError", "gather_full_tensor", "init_model_parallel", "run_on_ranks"]

_JOIN_GRACE_S = 10.0
_FORK_HINT = (
    "; killed by a signal: did the parent process create a gloo process group before forking?"
    " (see the scalevec_testing.distributed docstring)"
)


class RankError(RuntimeError):
    """A rank raised (or died); carries that rank's traceback text."""

    def __init__(self, rank: int, remote_traceback: str):
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free port for a rendezvous, picked at random below the kernel's ephemeral range.

    A port from ``bind(0)`` is ephemeral: after we release it, the kernel may hand it to
    another process's outgoing connection before our ranks bind it (gloo opens many; with two
    test runs side by side a Megatron-LM launch failed with EADDRINUSE). Below the range only
    an explicit bind takes a port."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.Random()  # not the global RNG: tests seed that
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high - 1}")


def _start_autograd_without_device_threads() -> None:
    """torch's autograd engine decides once, at a process's first backward, whether to start
    per-device worker threads, from the devices counted then; once it has, every child the
    process forks refuses its own backward ("autograd's threading in combination with
    fork-based multiprocessing"). torch's CUDA build (2.13.0, Python 3.12 here) counts a
    device after a ``torch.compile`` even with no GPU: a test that compiled before the parent's
    first backward broke every later rank's backward. One backward at import, before anything
    compiles, settles it with none."""
    torch.ones(1, requires_grad=True).sum().backward()


_start_autograd_without_device_threads()


def _compile_in_this_thread() -> None:
    """Inductor compiles C++ on a thread pool that a fork does not reset (torch 2.13.0 clears
    its process pool in the child, not ``AsyncCompile.pool()``): a rank forked after the parent
    compiled anything waited forever on its own first compile (TE's FP8 scale update hung CI
    so). The rank compiles in its own thread instead: ``compile_threads`` of the private
    ``torch._inductor.config`` where the parent has decided it already, else the public
    ``TORCHINDUCTOR_COMPILE_THREADS`` (read at the first compile)."""
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.compile_threads = 1


def one_gloo_worker_thread() -> None:
    """Every gloo group this rank creates runs one worker thread (torch's default is two), so
    a group's async collectives run one at a time, in the order they were issued. A rank's
    heap was corrupted now and then while megatron-core's overlapped parameter all-gathers
    were in flight together on two threads (torch 2.13.0; glibc's "malloc_consolidate():
    unaligned fastbin chunk detected" abort, or a segfault in ``_coalescing_manager``), in
    tests/parity/test_overlap.py's grouped-experts cases: 2 of 8 runs of that file, once in 4
    full suites, with both ranks issuing the same collectives in the same order. Not proven
    the cause (rare: none in 14 runs since with one thread, none in 8 with two). NCCL, the
    path users train on, has no such pool. Private: the name ``distributed_c10d.
    ProcessGroupGloo``, through which ``_new_process_group_helper`` builds gloo groups, and
    ``ProcessGroupGloo._Options`` (``_threads``, ``_timeout``, ``_devices``), checked on torch
    2.13.0."""
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

    base = c10d.ProcessGroupGloo  # a fresh rank's: the parent never builds a gloo group

    class OneThreadGloo(base):
        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            options = base._Options()
            options._timeout = timeout
            options._threads = 1
            options._devices = [base.create_default_device()]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneThreadGloo


def _rank_main(conn, fn, rank, world_size, port, timeout, args, kwargs):
    initialized = False
    try:
        _compile_in_this_thread()
        torch.set_num_threads(1)
        enable_cpu_compat()
        one_gloo_worker_thread()
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=timeout),
        )
        initialized = True
        message = ("ok", fn(rank, world_size, *args, **kwargs), time.time())
    except BaseException:
        message = ("err", traceback.format_exc(), time.time())
    try:
        # Plain pickle, not multiprocessing's: that one passes tensors as shared-memory file
        # descriptors, which vanish when this rank exits before the parent reads them.
        conn.send_bytes(pickle.dumps(message))
    except Exception:
        text = "could not send the result back:\n" + traceback.format_exc()
        conn.send_bytes(pickle.dumps(("err", text, time.time())))
    conn.close()
    if initialized and message[0] == "ok":
        from megatron.core import parallel_state

        dist.barrier()  # nobody tears the group down while a peer still talks to it
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _receive(conn, rank, proc):
    try:
        return pickle.loads(conn.recv_bytes())
    except EOFError:
        proc.join(1.0)
        code = proc.exitcode
        hint = _FORK_HINT if code is not None and code < 0 else ""
        # a rank that died silently is the likely root cause: its peers only lost a connection
        return "err", f"exited (code {code}) without sending a result{hint}", 0.0


def _collect(conns, procs, timeout):
    deadline = time.monotonic() + timeout
    pending = {conn: rank for rank, conn in enumerate(conns)}
    results = [None] * len(conns)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"ranks {sorted(pending.values())} did not finish within {timeout} s"
            )
        errors = []
        ready = mp.connection.wait(list(pending), timeout=left)
        while ready:
            for conn in ready:
                rank = pending.pop(conn)
                status, payload, stamp = _receive(conn, rank, procs[rank])
                if status == "err":
                    errors.append((stamp, rank, payload))
                results[rank] = payload
            # after a failure, peers fail too (broken connections): report the earliest one
            ready = mp.connection.wait(list(pending), timeout=0.2) if errors and pending else []
        if errors:
            _, rank, payload = min(errors)
            raise RankError(rank, payload)
    return results


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120, **kwargs) -> list:
    """Fork ``world_size`` gloo ranks, run ``fn(rank, world_size, *args, **kwargs)`` on each.

    Returns the (picklable) results ordered by rank. Raises ``RankError`` with the failing
    rank's traceback if a rank raises, ``TimeoutError`` if the ranks do not all finish within
    ``timeout`` seconds; in both cases every child is killed and reaped.
    """
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("run_on_ranks: destroy the parent's default process group first")
    ctx = mp.get_context("fork")
    port = free_port()
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(send_end, fn, rank, world_size, port, timeout, args, kwargs),
                name=f"gloo-rank-{rank}",
            )
            proc.start()
            send_end.close()
            procs.append(proc)
            conns.append(recv_end)
        results = _collect(conns, procs, timeout)
        grace = time.monotonic() + _JOIN_GRACE_S
        for proc in procs:
            proc.join(max(0.0, grace - time.monotonic()))
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join()
            proc.close()
        for conn in conns:
            conn.close()


def init_model_parallel(tp=1, pp=1, ep=1, etp=None, vpp=None, seed=1234) -> None:
    """(Re)initialize megatron model parallelism inside a rank and seed its RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    model_parallel_cuda_manual_seed(seed)


def gather_full_tensor(local: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """All-gather equally shaped shards of ``local`` across ``group`` and concatenate on ``dim``."""
    size = dist.get_world_size(group)
    if size == 1:
        return local.detach().clone()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    return torch.cat(shards, dim=dim)
