"""Where scale vectors live across ranks, and how their gradients are reduced.

Rules (one place, so the math modules never mention process groups):

* A vector is either *replicated* on its tensor-parallel group or *split* along it (the
  output-side FFN vectors follow the column split of ``linear_fc1``). Statistics over a split
  vector (``|u|`` for OR, ``mean(v)`` for ER, the DNP norm over the FFN width) are all-reduced
  with :func:`all_reduce_sum`, differentiable both ways, so the result equals the unsplit one.
* A *replicated* vector whose use sees only rank-local data (rows of a column-parallel weight,
  local heads, a sequence-parallel shard of tokens) gets a partial gradient. We sum it over
  that group: in autograd with :func:`reduce_grad` every micro-batch, or under megatron-core's
  DDP once a step for all vectors together (:func:`sum_coalesced`, vectors.py). No vector
  carries ``sequence_parallel``, so ``finalize_model_grads`` never reduces one a second time;
  the rule holds for the expert-tensor-parallel group too. Two exceptions follow stock exactly,
  because they are stock's parameters: a LayerNorm bias under sequence parallelism carries
  ``sequence_parallel`` (norms.py), and the QK-norm in megatron-core's own ``q_layernorm`` /
  ``k_layernorm`` slot (``qk_norm`` below) is summed over TP by finalize's name rule.
* Expert vectors copy ``allreduce`` from their expert weight, so DDP reduces them over the
  expert data-parallel group, never over the dense one.
* Gradient norm (and so clipping): megatron-core's ``get_main_grads_for_grad_norm`` counts a
  parameter on every rank of the optimizer's grad-stats group when it carries
  ``tensor_model_parallel``, else on dense-TP rank 0 only, and never when it is ``shared``.
  That is right for dense vectors (replicated over the dense TP group or split with
  ``tensor_model_parallel``). Expert vectors are replicated over the *expert*-TP group, and
  ``expert_vectors='shared'`` ones also over EP, so :func:`mark_expert` /
  :func:`mark_replicas` say explicitly which copy counts: every copy carries
  ``tensor_model_parallel`` and all but one of identical copies carry ``shared``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron_scalevec.backward import on_backward

# Where each scale vector lives: split along its layer's tensor-parallel group (else
# replicated on it), and the group over which one rank's use of it is partial, so that its
# gradient is summed there in autograd (reduce_grad). "tp": the layer's TP group (expert-TP for
# experts); "sp": the dense TP group under sequence parallelism (a shard of the tokens);
# "ep" / "tp_ep": the expert groups of one vector shared by all routed experts (moe.py).
PLACEMENTS = {
    # vector                     split   partial over
    "pre_norm":                 (False, "sp"),    # Pre-Norm gamma (shared), and its SP shard
    "final_norm":               (False, "sp"),
    "head_norm":                (False, "tp"),    # R^head_dim, shared by the local heads
    "qk_norm":                  (False, None),    # QK-norm in stock's slot: finalize_model_
    #                                               grads sums it over TP by its name
    "ffn_norm":                 (True, None),     # DNP over the FFN width, split like fc1
    "input_folded":             (False, "tp"),    # HG gamma folded into W: each rank its rows
    "input_activation":         (False, "sp"),    # HG gamma scaling a (dense) activation
    "input_activation_expert":  (False, "tp"),    # ... an expert's (no TP copy / gather)
    "qkv_output":               (False, "tp"),    # DP a on the local heads' rows
    "fc1_output":               (True, None),     # DP a in R^ffn, split with fc1's columns
    "router_input":             (False, "sp"),    # gamma_r: each rank routes its SP shard
    "shared_expert_input":      (False, "tp_ep"),
    "shared_expert_output":     (True, "ep"),
    "shared_expert_ffn_norm":   (True, "ep"),
}


def placement(name: str, config, tp_group, *, ep=None, tp_ep=None) -> dict:
    """ScaleVector's ``tp_group``, ``split`` and ``grad_group`` for vector ``name`` of a layer
    whose tensor-parallel group is ``tp_group`` (:data:`PLACEMENTS`)."""
    split, partial = PLACEMENTS[name]
    groups = {None: None, "tp": tp_group, "sp": seq_parallel_group(config), "ep": ep,
              "tp_ep": tp_ep}
    return dict(tp_group=tp_group, split=split, grad_group=groups[partial])


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; backward sums the gradients too (every rank's input feeds every output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_in_place(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group`` in place, outside autograd (inside a custom backward)."""
    if group_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def sum_coalesced(tensors: list, group) -> None:
    """Each of ``tensors`` summed over ``group`` in place, in one collective (outside autograd:
    the step-closing pass of vectors.py)."""
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def sum_over_world(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a small host tensor of counts) summed over every rank, when distributed."""
    if dist.is_available() and dist.is_initialized():
        device = t.device
        if dist.get_backend() == "nccl":  # NCCL reduces device tensors only
            t = t.cuda()
        dist.all_reduce(t)
        t = t.to(device)
    return t


def gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """The sequence-parallel shards of ``x`` (dim 0) from every rank of ``group``, in order."""
    out = x.new_empty((x.shape[0] * group_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` summed over ``group`` and split along dim 0: this rank's sequence shard."""
    shard = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(shard, x.contiguous(), group=group)
    return shard


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)


def reduce_grad(x: torch.Tensor, group) -> torch.Tensor:
    """``x``; its gradient summed over ``group`` in backward."""
    if group_size(group) == 1 or not torch.is_grad_enabled():
        return x
    return on_backward(x, lambda grad: sum_in_place(grad.clone(), group))


def ready(modules) -> None:
    """Run the forward pre-hooks of ``modules`` for a caller that reads their parameters
    without calling them (grouped experts stack their experts' weights): megatron-core's DDP
    waits there for an overlapped parameter all-gather (``overlap_param_gather``); without
    them the previous step's values would be read. Private: ``nn.Module._forward_pre_hooks``
    and ``_forward_pre_hooks_with_kwargs`` (where ``register_forward_pre_hook`` keeps its
    hooks; checked on torch 2.9 to 2.13)."""
    for m in modules:
        with_kwargs = m._forward_pre_hooks_with_kwargs
        for key, hook in list(m._forward_pre_hooks.items()):
            if key in with_kwargs:
                hook(m, (), {})
            else:
                hook(m, ())


def tp_group(is_expert: bool):
    """The tensor-parallel group a layer is split over (expert-TP for experts)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def mark_split(param: torch.nn.Parameter) -> None:
    """Mark a vector split along the tensor-parallel dimension (counted once per shard)."""
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)


def mark_expert(param: torch.nn.Parameter, allreduce: bool, *, tp_group=None,
                split: bool = False) -> None:
    """Expert params are reduced by DDP's expert buffers (expert-DP), as their weights are;
    in the grad norm a copy replicated over the expert-TP group counts on its rank 0 only."""
    param.allreduce = allreduce
    if not split:
        param.tensor_model_parallel = True  # not "dense-TP rank 0 only" (megatron's default)
        if group_rank(tp_group) != 0:
            param.shared = True  # an identical copy of expert-TP rank 0's: not in the norm


def mark_replicas(module: torch.nn.Module, group) -> None:
    """``module``'s parameters hold identical values and gradients on every rank of ``group``
    (shared expert vectors over EP): only rank 0's copies count in the grad norm."""
    if group_rank(group) == 0:
        return
    for p in module.parameters():
        p.shared = True


def seq_parallel_group(config) -> Optional[object]:
    """Group over which a norm's replicated vector sees only a shard of the tokens."""
    if getattr(config, "sequence_parallel", False):
        return tp_group(is_expert=False)
    return None
