"""megatron-core's optimizer on multi-tensor kernels, as GPUs run it, for the overhead
benchmark (bench.py; ``--cpu-fallbacks`` keeps megatron-core's CPU fallbacks). Why: each
function's docstring."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["multi_tensor_adam", "multi_tensor_kernels"]


def _fusable(group, state) -> bool:
    """torch has a fused Adam kernel for every parameter of the group, none has state yet."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices as devices
    except ImportError:  # older torch: keep foreach
        return False
    ok = set(devices())
    return not group.get("differentiable") and all(
        p.is_floating_point() and p.device.type in ok and not state.get(p)
        for p in group["params"])


def multi_tensor_adam(optimizer, fused: bool = True) -> int:
    """Switch torch's Adam/AdamW under megatron-core's optimizer to a multi-tensor form: its
    fused kernel where torch has one (``fused=True``, ``foreach`` off, as torch requires),
    else ``foreach``; returns how many optimizers were switched. Without TE or apex
    megatron-core falls back to torch's AdamW, which on CPU loops over the parameters in
    Python (``foreach`` still takes two host syncs per parameter); on GPU megatron-core runs a
    fused multi-tensor Adam. The loop would charge a strategy's tiny extra parameters (an OR
    magnitude per vector, per expert) a cost GPUs do not pay."""
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                use_fused = fused and _fusable(group, inner.state)
                group["fused"], group["foreach"] = use_fused, not use_fused
            switched += 1
    return switched


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's ``l2_norm_impl`` on torch's multi-tensor norm: (the total L2 norm as a
    1-element fp32 tensor on the tensors' device, the per-tensor norms or None)."""
    tensors = [t for tl in tensor_lists for t in tl]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), norms if per_tensor else None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron-core's ``multi_tensor_scale_impl`` (dst = src * scale) on torch's multi-tensor
    ops; in place when src and dst are the same list (clipping)."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if src is dst:
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


@contextlib.contextmanager
def multi_tensor_kernels():
    """While active, megatron-core's local fallbacks of the multi-tensor L2 norm and scale
    (gradient norm, clipping, fp16 main-param copies) run on torch's multi-tensor ops; yields
    how many bindings were replaced. GPUs run these as fused multi-tensor kernels (TE or apex);
    the fallbacks, one op and a host float per tensor, would charge many tiny parameters a
    cost GPUs do not pay. Bindings to TE or apex kernels are left alone."""
    import importlib

    from megatron.core import utils

    stand_ins = {utils.local_multi_tensor_l2_norm: _foreach_l2_norm,
                 utils.local_multi_tensor_scale: _foreach_scale}
    saved = []
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        for attr in ("l2_norm_impl", "multi_tensor_scale_impl"):
            fn = getattr(module, attr, None)
            if fn in stand_ins:
                saved.append((module, attr, fn))
                setattr(module, attr, stand_ins[fn])
    try:
        yield len(saved)
    finally:
        for module, attr, fn in reversed(saved):
            setattr(module, attr, fn)
