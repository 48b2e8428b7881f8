"""What the trainer does when something goes wrong: divergence (non-finite loss or gradients),
writer processes outliving a killed trainer, lost ranks, and errors that must print as one line.

The divergence check is collective (one all-reduced flag per step), so every rank stops at the
same iteration with the same message. megatron-core's own ``check_for_nan_in_grad`` (DDP) is not
used for this: it raises on the rank that sees the NaN alone, before the data-parallel
collective, and leaves the other ranks waiting in it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist


class DivergenceError(RuntimeError):
    """Loss or gradients became NaN/Inf: the run stops and no checkpoint is written."""

    collective = True  # every rank raises it with the same text: print it once


class LostRankError(RuntimeError):
    """Another rank (or node) stopped answering: its process died or the network failed."""


def _params(model):
    for i, chunk in enumerate(model):
        prefix = f"chunk{i}." if len(model) > 1 else ""
        for name, p in chunk.named_parameters():
            while name.startswith("module."):  # DDP, Float16Module
                name = name[len("module."):]
            yield prefix + name, p


def _grad(p):
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def _grad_buffers(model):
    for chunk in model:
        for attr in ("buffers", "expert_parallel_buffers"):
            for buf in getattr(chunk, attr, None) or []:
                yield buf.grad_data


def _any_rank(flag: bool, device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def nonfinite_grad_names(model, limit: int = 5) -> list:
    """Names (without wrapper prefixes) of the first ``limit`` parameters on this rank whose
    gradient holds NaN or Inf."""
    names = []
    for name, p in _params(model):
        g = _grad(p)
        if g is not None and not bool(torch.isfinite(g).all()):
            names.append(name)
            if len(names) >= limit:
                break
    return names


def check_step(model, loss: float, iteration: int, device) -> None:
    """Raise DivergenceError on every rank when the loss (already averaged over ranks) or any
    gradient on any rank is non-finite. One pass over the gradient buffers, one all-reduce."""
    bufs = list(_grad_buffers(model))
    if bufs:
        local_bad = any(not bool(torch.isfinite(b).all()) for b in bufs)
    else:
        local_bad = any(g is not None and not bool(torch.isfinite(g).all())
                        for g in (_grad(p) for _, p in _params(model)))
    bad_grads = _any_rank(local_bad, device)
    if math.isfinite(loss) and not bad_grads:
        return
    names = nonfinite_grad_names(model) if local_bad else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    first = [n for rank_names in gathered for n in rank_names]
    first = list(dict.fromkeys(first))[:5]
    what = f"loss is {loss}" if not math.isfinite(loss) else f"loss {loss:.4g}"
    grads = (f"; non-finite gradients in {', '.join(first)}" if first else
             "; gradients finite" if not bad_grads else "; non-finite gradients")
    err = DivergenceError(
        f"training diverged at iteration {iteration}: {what}{grads}. Stopped before the "
        f"optimizer step; no checkpoint written from this state (lower --lr, raise "
        f"--lr-warmup-iters or --clip-grad; --no-check-for-nan-in-loss-and-grad disables "
        f"this check)")
    err.loss, err.grads_finite = loss, not bad_grads
    raise err


def params_finite(model, device) -> bool:
    """True on every rank when every parameter on every rank is finite."""
    local_bad = any(not bool(torch.isfinite(p.detach()).all()) for _, p in _params(model))
    return not _any_rank(local_bad, device)


def finite_or_none(record: dict) -> dict:
    """The record with NaN/Inf floats replaced by None (JSON has no NaN) and their keys listed
    under ``"nonfinite"``, so metrics.jsonl stays valid JSON and plots can mark them."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    out = {k: (None if k in bad else v) for k, v in record.items()}
    out["nonfinite"] = bad
    return out


# --- writer processes die with the trainer ---------------------------------------------------
_PR_SET_PDEATHSIG = 1
_HOOK = {"installed": False, "parent": None}


def _before_fork():
    _HOOK["parent"] = os.getpid()


def _after_fork_in_child():
    """A forked child (megatron's checkpoint writer processes) gets SIGKILL when its parent
    dies, so a kill -9 of the trainer during a save leaves no orphan writers behind."""
    try:
        import ctypes  # noqa: PLC0415

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != _HOOK["parent"]:  # the parent died before prctl took effect
        os._exit(1)


def kill_children_with_parent() -> bool:
    """Install the fork hook (Linux only; idempotent). Returns whether it is active."""
    if not sys.platform.startswith("linux"):
        return False
    if not _HOOK["installed"]:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _HOOK["installed"] = True
    return True


# --- Ctrl-C during a save ------------------------------------------------------------------
@contextlib.contextmanager
def interrupts_held():
    """Hold a Ctrl-C that arrives inside the block until the block ends, then raise it.

    megatron-core's checkpoint writer forks processes; a KeyboardInterrupt raised inside
    CPython's fork hooks is swallowed ("Exception ignored") and can leave a lock held so that
    the next fork never returns (a trainer stuck after Ctrl-C mid-save). Held, the save
    finishes and is published, and the run ends naming it. A second Ctrl-C raises at once."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending = []

    def hold(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


# --- one-line messages ---------------------------------------------------------------------
def first_line(e: BaseException) -> str:
    """A short description of an exception: torch DCP's CheckpointException carries one
    traceback per failing rank in its text; report the first rank's error instead."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"rank {rank}: {first_line(inner)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "Socket Timeout", "timed out", "Timeout", "NCCL communicator was aborted",
                 "ProcessGroupGloo", "Connection refused")


def is_lost_rank(e: BaseException) -> bool:
    """Whether an error raised inside a collective means that a peer went away."""
    dist_error = getattr(dist, "DistError", ())
    text = str(e)
    return isinstance(e, dist_error) or any(m in text for m in _LOST_MARKERS)
