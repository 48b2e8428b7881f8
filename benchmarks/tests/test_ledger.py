"""The GPU cost ledger's measuring methods (benchmarks/ledger.py) against plain-torch cases
whose answer is known by hand: kept bytes of a known graph, the traffic of one matmul and of
in-place ops, a known sequence of collectives, known host reads."""

import collections
import sys
import types

import torch
import torch.distributed as dist

from benchmarks.ledger import Collectives, HostSyncs, Traffic, kept_bytes, split
from scalevec_testing.distributed import run_on_ranks


class _Pin(torch.autograd.Function):
    """Keeps a tensor on ``ctx`` without save_for_backward, as TE does (ctx.weight = ...)."""

    @staticmethod
    def forward(ctx, x):
        ctx.pinned = x * 3  # fresh, kept for backward outside saved-tensor hooks
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.pinned


def test_kept_bytes_of_a_known_graph():
    w = torch.nn.Parameter(torch.randn(32, 16))
    inp = torch.randn(8, 32)

    def matmul():
        x = inp * 2  # fresh; mm keeps it for dW
        return (x @ w).sum()  # x @ w is freed once summed (sum keeps only a size)

    assert kept_bytes(matmul) == 8 * 32 * 4  # x, not W (a parameter), not the loss

    leaf = torch.randn(8, 32, requires_grad=True)

    def pinned():
        x = leaf * 2  # mul by a number keeps nothing
        return (_Pin.apply(x) @ w).sum()  # mm keeps _Pin's output; _Pin keeps x * 3 on ctx

    # saved-tensor hooks see the mm's input only; the tensor pinned on ctx counts too
    assert kept_bytes(pinned) == 2 * 8 * 32 * 4
    # exp keeps its output, the result here (excluded); the mm's output is freed
    assert kept_bytes(lambda: (inp @ w).exp()) == 0


def test_traffic_of_a_matmul_and_in_place_ops():
    a, b = torch.randn(8, 32), torch.randn(32, 16)
    with Traffic() as t:
        a @ b
    assert t.bytes == (8 * 32 + 32 * 16 + 8 * 16) * 4, t.by_op
    c, d = torch.randn(100), torch.randn(100)
    with Traffic() as t:
        c.add_(d)  # reads c and d, writes c
        c.copy_(d)  # reads d, writes c
        c.view(10, 10).t()  # views move nothing
        torch.empty(1000)  # an allocation moves nothing
    assert t.bytes == 3 * 400 + 2 * 400, t.by_op


def test_host_syncs_by_kind():
    x = torch.tensor([1.0, -2.0, 3.0])
    with HostSyncs() as h:
        x.sum().item()
        float(x[0])
        x.tolist()
        x[x > 0]  # boolean index: a data-dependent shape
        torch.nonzero(x)
        torch.tensor([1, 2], device="cpu")  # host data sent to a device
        x.to("cpu", non_blocking=True)  # not counted: non-blocking
        x * 2  # not a sync
    assert h.calls == collections.Counter({"d2h:item": 1, "d2h:__float__": 1, "d2h:tolist": 1,
                                           "shape:index[bool]": 1, "shape:nonzero": 1,
                                           "h2d:tensor": 1}), h.calls


def _known_sequence(rank, world):
    bound = types.ModuleType("megatron._ledger_test_bound")  # as megatron binds at import
    bound.gather_func = dist.all_gather_into_tensor
    sys.modules[bound.__name__] = bound
    x = torch.ones(4)
    try:
        with Collectives() as c:
            for _ in range(3):
                dist.all_reduce(x)
            bound.gather_func(torch.empty(4 * world), x)
            dist.all_gather([torch.empty(4) for _ in range(world)], x)
        dist.all_reduce(x)  # after exit: not counted
    finally:
        del sys.modules[bound.__name__]
    return dict(c.calls), bound.gather_func is dist.all_gather_into_tensor


def test_collectives_of_a_known_sequence():
    for calls, restored in run_on_ranks(_known_sequence, 2):
        assert calls == {"all_reduce": 3, "all_gather_into_tensor": 1, "all_gather": 1}, calls
        assert restored


def test_split_per_step_and_per_micro_batch():
    assert split(10 + 3, 10 + 4 * 3, 4) == (10, 3)


def test_a_fused_body_counts_as_one_kernel():
    """Traffic.one_op: a fused kernel reads its inputs and writes its outputs once; eager, the
    same body also writes and reads its intermediate (a * 2)."""
    a = torch.randn(256)

    def body(x):
        return x * 2 + 1

    with Traffic() as eager:
        body(a)
    with Traffic() as fused:
        Traffic.one_op(body, "body")(a)
    assert eager.bytes == 4 * 1024 and fused.bytes == 2 * 1024, (eager.by_op, fused.by_op)
    assert fused.by_op == {"fused:body": 2 * 1024}
