"""Optimizer-step boundaries as one module sees them: what is fixed within a step (the scale
vectors, so the fold's scale and the vectors' own transforms) is paid once per step.

The step a parameter is counted in is carried by our own flag (:data:`OPEN`): :func:`start`
opens it on a training forward, :func:`close` ends it once the step's gradient is mapped.
megatron-core's DDP begins each training iteration with ``zero_grad_buffer()``, and the one mark
that leaves on a parameter is ``grad_added_to_main_grad = False``: :func:`start` sets that
attribute (a folded weight's gradient reaches ``main_grad`` outside ``.grad``, its DDP meaning),
and :func:`new_step` reads it only to see that reset (megatron-core's DDP attribute; checked on
0.16.1 and 0.19.2). Training forwards (grad enabled; a recomputed forward counts where it runs,
in backward order) are counted against megatron-core's micro-batch calculator, which
Megatron-LM, Megatron-Bridge and our trainer set up; the last one's backward is the step's last
for that module under every schedule (1F1B, interleaved, no pipelining), before DDP reduces its
gradient buckets.
"""

from __future__ import annotations

from typing import Optional

import torch


def microbatches() -> Optional[int]:
    """Micro-batches per optimizer step, from megatron-core's calculator; None where none is
    set up."""
    from megatron.core import num_microbatches_calculator as calc  # noqa: PLC0415

    try:
        return calc.get_num_microbatches()
    except (AttributeError, AssertionError):  # no calculator: ``None.get()``
        return None


def per_step(param: torch.nn.Parameter) -> Optional[int]:
    """The step's micro-batch count when ``param``'s gradient can be gathered once per step
    here (a training forward, megatron-core's DDP, a calculator), else None."""
    if not torch.is_grad_enabled() or not param.requires_grad or not hasattr(param, "main_grad"):
        return None
    return microbatches()


OPEN = "scalevec_step_open"  # ours: this parameter is counted in an open step


def new_step(param: torch.nn.Parameter) -> bool:
    """True where no step is open on ``param``: none was started, :func:`close` ended it, or
    DDP's ``zero_grad_buffer()`` reset it since :func:`start`."""
    return not getattr(param, OPEN, False) or not getattr(param, "grad_added_to_main_grad", False)


def start(params) -> None:
    """Open a step on ``params`` (:func:`new_step`): their step's gradient reaches ``main_grad``
    outside ``.grad`` until :func:`close`, so DDP's hook adds no ``.grad`` of theirs."""
    for p in params:
        setattr(p, OPEN, True)
        p.grad_added_to_main_grad = True


def close(params) -> None:
    """End the step on ``params``: their gradient goes through ``.grad`` to DDP as usual."""
    for p in params:
        setattr(p, OPEN, False)
        p.grad_added_to_main_grad = False


def over_count(what: str, seen: int, n: int) -> RuntimeError:
    return RuntimeError(
        f"scale vectors: training forward {seen} of {what} in one step, but "
        f"get_num_microbatches() is {n}: call the DDP model's zero_grad_buffer() at the start "
        f"of every training step (as Megatron-LM does) and give forward_backward_func the "
        f"calculator's num_microbatches")


def never_closed(what: str, seen: int, n: int) -> RuntimeError:
    return RuntimeError(
        f"scale vectors: the last optimizer step accumulated {what}'s gradient over {seen} "
        f"training forwards but never mapped it (expected {n} micro-batches, "
        f"get_num_microbatches()); forward_backward_func's num_microbatches must match "
        f"megatron-core's micro-batch calculator")
