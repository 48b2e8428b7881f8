"""megatron_scalevec/layers/linear.py on its own: one ScaleVecColumnParallelLinear, built
directly under megatron's parallel state in forked gloo ranks, against plain torch.

The reference, written here: ``F.linear(x, W * scale, bias)`` with ``scale[o, i] =
a_s[o % r] * gamma_s[i]`` for the branch ``s`` of row ``o`` (qkv: per query group, ``hpg`` q
heads then k then v; fc1: gate then up), each gamma from its parameters by SPEC.md's formula
(plain, OR, ER) over the whole logical vector. Checked: output and the gradients of the input,
the weight, the bias and every vector parameter, in weight mode (the fold) with and without
bias, in activation mode, with the step's gradient mapped once per step (``main_grad`` and
megatron-core's micro-batch calculator), and at TP=2 with and without sequence parallelism
(the test sums the per-rank reference gradients itself), OR on fc1's split output vector.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers.linear import ScaleVecColumnParallelLinear
from scalevec_testing import gather_full_tensor, init_model_parallel, oracles, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.compare import rand as _rand
from scalevec_testing.compare import rel as _rel

HIDDEN, HEADS, GROUPS, HD, FFN = 32, 4, 2, 8, 64  # M.tiny_config()
TOKENS = (6, 2)  # [s, b]
REL = 1e-5


def _build(branches, strategy, bias=False, mode=None, **overrides):
    cfg = M.tiny_config(**overrides)
    out = (HEADS + 2 * GROUPS) * HD if branches == "qkv" else 2 * FFN
    scalevec = ScaleVecConfig.from_string(strategy, **({"apply_mode": mode} if mode else {}))
    lin = ScaleVecColumnParallelLinear(
        HIDDEN, out, scalevec=scalevec, branches=branches,
        config=cfg, init_method=cfg.init_method, bias=bias, gather_output=False,
        skip_bias_add=False, is_expert=False)
    with torch.no_grad():  # away from init (gamma = 1, bias = 0), the same on every rank
        for i, (name, p) in enumerate(sorted(lin.named_parameters())):
            if name != "weight":
                p.add_(0.3 * _rand(*p.shape, seed=100 + i))
    return lin


def _slot_names(branches, rows_local):
    """The branch of each local row and its index within the slot (r = rows per slot)."""
    if branches == "qkv":
        hpg = HEADS // GROUPS
        names, r = ["q"] * hpg + ["k", "v"], HD
    else:
        names, r = ["gate", "up"], rows_local // 2
    o = torch.arange(rows_local)
    return [names[s] for s in ((o // r) % len(names)).tolist()], o % r


def _gamma(parts, kind):
    """SPEC.md's gamma from leaf copies of one vector's parameters (the whole vector)."""
    assert {"plain": "weight", "or": "direction", "er": "logit"}[kind] in parts
    return oracles.gamma(parts)


def _reference_leaves(lin, tp_group):
    """Leaf copies of every parameter; a vector split over TP (fc1's ``a``) gathered whole."""
    leaves = {}
    for name, p in lin.named_parameters():
        split = name.startswith("scale_") and getattr(p, "tensor_model_parallel", False)
        full = gather_full_tensor(p, 0, tp_group) if split else p.detach().clone()
        leaves[name] = full.requires_grad_()
    return leaves


def _vector(lin, leaves, group, name, tp_rank):
    """This rank's slice of vector ``group.name`` (e.g. scale_out.gate) from the leaves."""
    kind = lin.scalevec.parameterization
    parts = {k.rsplit(".", 1)[1]: v for k, v in leaves.items()
             if k.startswith(f"{group}.{name}.")}
    gamma = _gamma(parts, kind)
    local = getattr(lin, group)[name].size
    return gamma if gamma.numel() == local else gamma.view(-1, local)[tp_rank]


def _reference(lin, branches, x, leaves, tp_rank=0):
    """F.linear with the vectors applied to this rank's rows (plain torch)."""
    w = leaves["weight"]
    names, within = _slot_names(branches, w.shape[0])
    ones = torch.ones(w.shape[1])
    rows = []
    for o, name in enumerate(names):
        a = _vector(lin, leaves, "scale_out", name, tp_rank)[within[o]] \
            if name in lin.scale_out else 1.0
        gamma = _vector(lin, leaves, "scale_in", name, tp_rank) if name in lin.scale_in else ones
        rows.append(a * gamma)
    scale = torch.stack(rows)
    return F.linear(x, w * scale, leaves.get("bias"))


def _errors(lin, leaves, dx, ref_dx, micro=1):
    """Relative errors of the module's gradients against the reference leaves'."""
    errs = {"dx": _rel(dx, ref_dx)}
    for name, p in lin.named_parameters():
        got = p.main_grad if micro > 1 and name == "weight" else p.grad
        ref = leaves[name].grad
        if got is not None and ref.shape != got.shape:  # split: this rank's slice of the whole
            ref = ref.view(-1, got.numel())[dist.get_rank()]
        errs[name] = _rel(got, ref)
    return errs


def _one_process(rank, world, branches, strategy, bias, mode, micro):
    init_model_parallel()
    lin = _build(branches, strategy, bias, mode)
    leaves = _reference_leaves(lin, None)
    if micro > 1:  # megatron-core's DDP protocol: G into main_grad, mapped once per step
        lin.weight.main_grad = torch.zeros_like(lin.weight)
        M.set_microbatches(micro)
    errs = {}
    for mb in range(micro):
        x = _rand(*TOKENS, HIDDEN, seed=mb).requires_grad_()
        ref_x = x.detach().clone().requires_grad_()
        up = _rand(*TOKENS, lin.output_size, seed=10 + mb)
        y, out_bias = lin(x)
        ref = _reference(lin, branches, ref_x, leaves)
        assert out_bias is None
        errs[f"out{mb}"] = _rel(y, ref)
        (y * up).sum().backward()
        (ref * up).sum().backward()
        errs[f"dx{mb}"] = _rel(x.grad, ref_x.grad)
    M.set_microbatches(None)
    assert lin._step_map.mapped == (micro > 1)  # the step's G mapped once, on its last
    errs.update(_errors(lin, leaves, x.grad, ref_x.grad, micro))
    return lin.scalevec_mode, errs


CASES = {  # name: (branches, strategy, bias, apply mode, micro-batches)
    "qkv_hg": ("qkv", "hg", False, None, 1),
    "qkv_hg_bias": ("qkv", "hg", True, None, 1),
    "qkv_dp": ("qkv", "shared+dp", False, None, 1),
    "qkv_hg+dp+or": ("qkv", "hg+dp+or", False, None, 1),
    "fc1_hg+dp+er": ("fc1", "hg+dp+er", False, None, 1),
    "fc1_hg_bias": ("fc1", "hg", True, None, 1),
    "qkv_hg+dp_activation": ("qkv", "hg+dp", False, "activation", 1),
    "qkv_hg+dp_map_once_per_step": ("qkv", "hg+dp", False, None, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_folded_linear_matches_plain_linear_with_vectors(case):
    branches, strategy, bias, mode, micro = CASES[case]
    (used, errs), = run_on_ranks(_one_process, 1, branches, strategy, bias, mode, micro)
    assert used == (mode or "weight")
    assert len(errs) >= 2 * micro + 3, errs  # outputs, inputs, weight and vectors compared
    assert max(errs.values()) < REL, errs


def test_dp_output_vectors_refuse_a_bias():
    def build(rank, world):
        init_model_parallel()
        with pytest.raises(ValueError, match="DP output-side vectors with a linear bias"):
            _build("qkv", "hg+dp", bias=True)
        return True

    assert run_on_ranks(build, 1) == [True]


def _two_ranks(rank, world):
    from megatron.core import parallel_state

    init_model_parallel(tp=2)
    tp = parallel_state.get_tensor_model_parallel_group()
    results = {}
    for branches, strategy, sp in (("qkv", "hg+dp", False), ("qkv", "hg+dp", True),
                                   ("fc1", "hg+dp+or", False), ("fc1", "hg+dp+or", True)):
        lin = _build(branches, strategy, sequence_parallel=sp)
        leaves = _reference_leaves(lin, tp)
        full = _rand(*TOKENS, HIDDEN, seed=1)  # the same on both ranks
        shard = full.chunk(2)[rank] if sp else full  # SP: this rank's tokens
        x = shard.clone().requires_grad_()
        ref_x = full.clone().requires_grad_()
        up = _rand(*TOKENS, lin.output_size_per_partition, seed=2 + rank)
        y, _ = lin(x)
        ref = _reference(lin, branches, ref_x, leaves, rank)
        (y * up).sum().backward()
        (ref * up).sum().backward()
        # the loss is the sum of both ranks': the whole input and every vector leaf feed both
        for t in [ref_x] + [v for n, v in leaves.items() if n != "weight"]:
            dist.all_reduce(t.grad, group=tp)
        ref_dx = ref_x.grad.chunk(2)[rank] if sp else ref_x.grad
        errs = _errors(lin, leaves, x.grad, ref_dx)
        errs["out"] = _rel(y, ref)
        split = [n for n, p in lin.named_parameters() if p.shape != leaves[n].shape]
        results[(branches, strategy, sp)] = (errs, split)
    return results


def test_tensor_parallel_two_ranks_match_the_plain_reference():
    for results in run_on_ranks(_two_ranks, 2):
        for case, (errs, split) in results.items():
            assert max(errs.values()) < REL, (case, errs)
            if case[0] == "fc1":  # a in R^ffn follows fc1's column split, OR's |u| whole
                assert split == ["scale_out.gate.direction", "scale_out.up.direction"], split
            else:
                assert split == [], split
