"""Scale-free normalization N(z), and the norm modules built from it.

``ScaleVecNorm`` is a norm *and* its scale vector (it subclasses ScaleVector), so a plain
vector keeps megatron-core's parameter name (``input_layernorm.weight``) and the ``shared``
preset loads stock checkpoints key for key. It serves three places:

* ``kind="pre"``: a Pre-Norm before attention / MLP. It has a vector only for ``shared``
  (under HG the vectors move into the branch projections; under ``none`` there is none).
* ``kind="final"``: the norm before the output layer; a vector unless ``none``.
* ``kind="branch"``: DNP's per-branch norm (and QK-norm): a vector (role Output-Norm) unless
  ``none`` (QK-norm without parameters).

Under sequence parallelism a Pre-Norm sees only a shard of the tokens, so its replicated
vector's gradient is summed over the tensor-parallel group (sharding.py); this is why our
norm supports SP while megatron-core's ``WrappedTorchNorm`` refuses it.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.vectors import ScaleVector


def normalize(x: torch.Tensor, normalization: str, eps: float, group=None,
              global_size: Optional[int] = None) -> torch.Tensor:
    """N(x) over the last dim, without any learnable scale, in float32.

    ``group``: the last dim is split over this group; statistics are all-reduced so the
    result equals the unsplit one (``global_size`` is the logical width).
    """
    x = x.float()
    n = global_size or x.shape[-1] * sharding.group_size(group)
    if normalization == "RMSNorm":
        ms = sharding.all_reduce_sum(x.pow(2).sum(-1, keepdim=True), group) / n
        return x * torch.rsqrt(ms + eps)
    if normalization == "LayerNorm":
        mean = sharding.all_reduce_sum(x.sum(-1, keepdim=True), group) / n
        xc = x - mean
        var = sharding.all_reduce_sum(xc.pow(2).sum(-1, keepdim=True), group) / n
        return xc * torch.rsqrt(var + eps)
    raise ValueError(f"scale-vector norms support normalization RMSNorm or LayerNorm, "
                     f"got {normalization!r}")


def _sum_over(t: torch.Tensor, group) -> torch.Tensor:
    if sharding.group_size(group) > 1:
        torch.distributed.all_reduce(t, group=group)
    return t


class _ScaledRMSNorm(torch.autograd.Function):
    """``gamma * x / rms(x)`` saving only ``x`` and the per-row ``1/rms`` for backward (autograd
    of the composite keeps two full-size intermediates). The statistics, and the row sum the
    backward needs, run over the whole logical width when it is split over ``group``."""

    @staticmethod
    def forward(ctx, x, gamma, eps, group, n):
        xf = x.float()
        rstd = torch.rsqrt(_sum_over(xf.pow(2).sum(-1, keepdim=True), group) / n + eps)
        ctx.save_for_backward(x, rstd, gamma)
        ctx.group, ctx.n = group, n
        y = xf * rstd
        return (y * gamma if gamma is not None else y).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, gamma = ctx.saved_tensors
        xhat = x.float() * rstd
        dy = dy.float()
        dgamma = None
        if gamma is not None:
            if ctx.needs_input_grad[1]:
                dgamma = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(0)
            dy = dy * gamma
        dot = _sum_over((dy * xhat).sum(-1, keepdim=True), ctx.group) / ctx.n
        dx = rstd * (dy - xhat * dot)
        return dx.to(x.dtype), dgamma, None, None, None


class ScaleVecNorm(ScaleVector):
    """y = gamma * N(x); megatron-core builds it as ``build_module(spec, config=,
    hidden_size=, eps=)``, the strategy arrives through the spec's params."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *,
                 scalevec: ScaleVecConfig, kind: str = "pre", tp_group=None,
                 split: bool = False, grad_group=None, expert_allreduce=None):
        if kind not in ("pre", "final", "branch"):
            raise ValueError(f"ScaleVecNorm kind must be pre, final or branch, got {kind!r}")
        has_vector = {"pre": scalevec.vectors and not scalevec.hg,
                      "final": scalevec.vectors, "branch": scalevec.vectors}[kind]
        if kind != "branch":
            grad_group = sharding.seq_parallel_group(config)
            tp_group = sharding.tp_group(is_expert=False)
        super().__init__(
            hidden_size, scalevec.parameterization if has_vector else None,
            role="output" if kind == "branch" else "input", tp_group=tp_group, split=split,
            grad_group=grad_group, expert_allreduce=expert_allreduce,
            dtype=config.params_dtype)
        self.kind = kind
        self.eps = eps
        self.normalization = config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"scale-vector norms support normalization RMSNorm or LayerNorm, "
                             f"got {self.normalization!r}")

    def vector(self):
        """gamma (None without a vector), for the fused functions that apply it; read
        through the module call (vectors.py)."""
        return self()

    def forward_fused(self, x: torch.Tensor, rope=None, interleaved: bool = False):
        """A per-head branch norm through layers/fused.py (+ RoPE: ``rope`` = (cos, sin))."""
        from megatron_scalevec.layers import fused  # noqa: PLC0415 (layers imports norms)

        return fused.head_norm(x, self.vector(), self.eps, self.normalization, rope, interleaved)

    def forward(self, x: Optional[torch.Tensor] = None, parts: bool = False):
        """``gamma * N(x)``; without ``x`` the vector itself (ScaleVector.forward)."""
        if x is None:
            return super().forward(parts)
        if self.kind == "branch" and self.split_group is None:
            return self.forward_fused(x)  # keeps its output (the consumer's) + 1/rms
        gamma = super().forward()
        if self.normalization == "RMSNorm":
            return _ScaledRMSNorm.apply(x, gamma, self.eps, self.split_group, self.global_size)
        y = normalize(x, self.normalization, self.eps, self.split_group, self.global_size)
        if gamma is not None:
            y = y * gamma
        return y.to(x.dtype)
