"""megatron_scalevec/sharding.py on its own, against hand-computed values.

Checked: with ``group=None`` (one process, no process group) ``group_size`` is 1,
``group_rank`` 0, and ``all_reduce_sum`` / ``reduce_grad`` / ``sum_in_place`` are the identity,
gradients included. On two forked gloo ranks (megatron's TP group, tp=2): ``all_reduce_sum``
sums in forward and sums the gradients in backward; ``reduce_grad`` is the identity in forward
(and under no_grad) and sums the gradients in backward; ``sum_in_place`` sums in place. The
values each rank sees are written out here. ``placement`` for several names gives the split
flag and gradient group of the PLACEMENTS table in the module ("sp" the TP group only under
sequence parallelism).
"""

from types import SimpleNamespace

import torch

from megatron_scalevec import sharding
from scalevec_testing import init_model_parallel, run_on_ranks

NO_SP = SimpleNamespace(sequence_parallel=False)
SP = SimpleNamespace(sequence_parallel=True)


def test_group_none_is_size_one_and_identity():
    assert sharding.group_size(None) == 1 and sharding.group_rank(None) == 0
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    assert sharding.all_reduce_sum(x, None) is x
    assert sharding.reduce_grad(x, None) is x
    y = sharding.reduce_grad(sharding.all_reduce_sum(x * 2, None), None)
    y.backward(torch.tensor([1.0, 10.0, 100.0]))
    assert torch.equal(x.grad, torch.tensor([2.0, 20.0, 200.0]))
    t = torch.tensor([4.0, 5.0])
    assert sharding.sum_in_place(t, None) is t and torch.equal(t, torch.tensor([4.0, 5.0]))


def test_placement_passes_groups_through():
    """Groups are passed through, not looked up: stand-in objects for the TP / EP groups."""
    tp, ep, tp_ep = object(), object(), object()
    want = {  # name: (split, grad group), from the PLACEMENTS table
        "pre_norm": (False, None),        # "sp": no sequence parallelism here
        "head_norm": (False, tp),
        "qkv_output": (False, tp),
        "ffn_norm": (True, None),
        "fc1_output": (True, None),
        "shared_expert_input": (False, tp_ep),
        "shared_expert_output": (True, ep),
    }
    for name, (split, grad) in want.items():
        got = sharding.placement(name, NO_SP, tp, ep=ep, tp_ep=tp_ep)
        assert got["tp_group"] is tp and got["split"] is split, name
        assert got["grad_group"] is grad, name


def _two_ranks(rank, world):
    from megatron.core import parallel_state

    init_model_parallel(tp=2)
    tp = parallel_state.get_tensor_model_parallel_group()
    out = {"size": sharding.group_size(tp), "rank": sharding.group_rank(tp)}
    x0 = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)  # rank 0: [1, 2, 3]; rank 1: [2, 4, 6]
    up = torch.tensor([1.0, 10.0, 100.0]) * (rank + 1)  # each rank's upstream gradient
    for name, fn in (("all_reduce_sum", sharding.all_reduce_sum),
                     ("reduce_grad", sharding.reduce_grad)):
        x = x0.clone().requires_grad_()
        y = fn(x, tp)
        y.backward(up)
        out[name] = (y.detach(), x.grad)
    with torch.no_grad():
        x = x0.clone()
        out["no_grad_is_x"] = sharding.reduce_grad(x, tp) is x
    t = x0.clone()
    out["in_place_is_t"] = sharding.sum_in_place(t, tp) is t
    out["in_place"] = t
    a, b = x0.clone(), (x0[:2] * 10).reshape(2, 1)  # two shapes, one collective
    sharding.sum_coalesced([a, b], tp)
    out["coalesced"] = (a, b)
    out["sp_pre_norm"] = sharding.placement("pre_norm", SP, tp)["grad_group"] is tp
    out["no_sp_pre_norm"] = sharding.placement("pre_norm", NO_SP, tp)["grad_group"] is None
    out["router_sp"] = sharding.placement("router_input", SP, tp)["grad_group"] is tp
    return out


def test_two_ranks_forward_and_backward_semantics():
    results = run_on_ranks(_two_ranks, 2)
    summed = torch.tensor([3.0, 6.0, 9.0])  # [1, 2, 3] + [2, 4, 6]
    grads = torch.tensor([3.0, 30.0, 300.0])  # [1, 10, 100] + [2, 20, 200]
    for rank, out in enumerate(results):
        x0 = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
        assert (out["size"], out["rank"]) == (2, rank)
        y, g = out["all_reduce_sum"]  # sums forward, sums gradients backward
        assert torch.equal(y, summed) and torch.equal(g, grads), (rank, y, g)
        y, g = out["reduce_grad"]  # identity forward, sums gradients backward
        assert torch.equal(y, x0) and torch.equal(g, grads), (rank, y, g)
        assert out["no_grad_is_x"]
        assert out["in_place_is_t"] and torch.equal(out["in_place"], summed)
        a, b = out["coalesced"]  # each tensor summed in place, its shape kept
        assert torch.equal(a, summed) and torch.equal(b, torch.tensor([[30.0], [60.0]])), (a, b)
        assert out["sp_pre_norm"] and out["no_sp_pre_norm"] and out["router_sp"]
