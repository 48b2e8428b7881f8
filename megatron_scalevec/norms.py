"""Scale-free normalization N(z), and the norm modules built from it.

``ScaleVecNorm`` is a norm *and* its scale vector (it subclasses ScaleVector), so a plain
vector keeps megatron-core's parameter name (``input_layernorm.weight``) and the ``shared``
preset loads stock checkpoints key for key. It serves three places:

* ``kind="pre"``: a Pre-Norm before attention / MLP. It has a vector only for ``shared``
  (under HG the vectors move into the branch projections; under ``none`` there is none).
* ``kind="final"``: the norm before the output layer; a vector unless ``none``.
* ``kind="qk"``: ``qk_layernorm``'s QK-norm without DNP, in megatron-core's own
  ``q_layernorm`` / ``k_layernorm`` slot: a vector (role Output-Norm) unless ``none``; its
  gradient, partial over the tensor-parallel group (each rank has its heads), is summed there by
  megatron-core's ``finalize_model_grads``, which matches these names, as for stock.
* ``kind="branch"``: DNP's per-branch norm (QK-norm under DNP): a vector (role Output-Norm)
  unless ``none``.

Under ``normalization="LayerNorm"`` the norms megatron-core has (pre, final, qk) keep its bias
(``ScaleVecConfig.layernorm_bias``): ``gamma * N(x) + beta``, ``N(x) + beta`` without a vector.
Like stock's, the bias of a Pre-Norm or final norm under sequence parallelism carries
``sequence_parallel`` and is summed over the tensor-parallel group by ``finalize_model_grads``;
it is not a scale vector (no role, never decayed, outside gamma).

Under sequence parallelism a Pre-Norm sees only a shard of the tokens, so its replicated
vector's gradient is summed over the tensor-parallel group (sharding.py); this is why our
norm supports SP while megatron-core's ``WrappedTorchNorm`` refuses it.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_scalevec import compile, ops, sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.vectors import ScaleVector


def normalize(x: torch.Tensor, normalization: str, eps: float, group=None,
              global_size: Optional[int] = None) -> torch.Tensor:
    """N(x) over the last dim as an autograd composite (ops.normalize, the reference);
    ``group``: the last dim is split over it (``global_size``: the logical width)."""
    n = global_size or x.shape[-1] * sharding.group_size(group)
    return ops.normalize(x, normalization, eps, n, lambda t: sharding.all_reduce_sum(t, group))


class _ScaledNorm(torch.autograd.Function):
    """``gamma * N(x)`` (ops.py) saving only ``x`` and the per-row statistics for backward
    (autograd of the composite keeps two full-size intermediates). The statistics, and the row
    sums the backward needs, run over the whole logical width when it is split over
    ``group``. Unsplit (every Pre-Norm and final norm), forward and backward are one fused
    kernel body each (compile.py), as megatron-core's and TE's norms are one kernel."""

    @staticmethod
    def forward(ctx, x, gamma, beta, layer, eps, group, n):
        if group is None:
            y, mean, rstd = compile.kernel(_norm_fwd)(x, gamma, beta, layer, eps, n)
        else:  # a split norm (DNP over the FFN width) has no bias
            mean, rstd = ops.row_stats([x], layer, eps, n,
                                       lambda t: sharding.sum_in_place(t, group))
            y = _scaled(x, gamma, None, mean, rstd)
        ctx.save_for_backward(x, mean, rstd, gamma)
        ctx.group, ctx.n, ctx.has_beta = group, n, beta is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd, gamma = ctx.saved_tensors
        needs = ctx.needs_input_grad[1] and gamma is not None
        dbeta = None
        if ctx.needs_input_grad[2] and ctx.has_beta:  # the bias: the rows' sum of dy
            dbeta = dy.reshape(-1, dy.shape[-1]).float().sum(0)
        if ctx.group is None:
            dx, dgamma = compile.kernel(_norm_bwd)(dy, x, mean, rstd, gamma, needs, ctx.n)
        else:
            xhat, dy, dgamma = _norm_bwd_rows(dy, x, mean, rstd, gamma, needs)
            sums = sharding.sum_in_place(_grad_sums(dy, xhat, mean), ctx.group) / ctx.n
            dx = _norm_bwd_dx(dy, xhat, rstd, sums, mean, x.dtype)
        return dx, dgamma, dbeta, None, None, None, None


def _scaled(x, gamma, beta, mean, rstd):
    y = ops.scale_free(x, mean, rstd)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y.to(x.dtype)


def _norm_fwd(x, gamma, beta, layer: bool, eps: float, n: int):
    mean, rstd = ops.row_stats([x], layer, eps, n)
    return _scaled(x, gamma, beta, mean, rstd), mean, rstd


def _norm_bwd_rows(dy, x, mean, rstd, gamma, needs: bool):
    """xhat, the gradient at N(x) (float32) and gamma's gradient."""
    xhat = ops.scale_free(x, mean, rstd)
    dy = dy.float()
    dgamma = None
    if gamma is not None:
        if needs:
            dgamma = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(0)
        dy = dy * gamma
    return xhat, dy, dgamma


def _grad_sums(dy, xhat, mean):
    return torch.cat([(dy * xhat).sum(-1, keepdim=True)] +
                     ([dy.sum(-1, keepdim=True)] if mean is not None else []), -1)


def _norm_bwd_dx(dy, xhat, rstd, sums, mean, dtype):
    mean_g = sums[..., 1:] if mean is not None else None
    return ops.scale_free_grad(dy, xhat, rstd, sums[..., :1], mean_g).to(dtype)


def _norm_bwd(dy, x, mean, rstd, gamma, needs: bool, n: int):
    xhat, dy, dgamma = _norm_bwd_rows(dy, x, mean, rstd, gamma, needs)
    dx = _norm_bwd_dx(dy, xhat, rstd, _grad_sums(dy, xhat, mean) / n, mean, x.dtype)
    return dx, dgamma


class ScaleVecNorm(ScaleVector):
    """y = gamma * N(x); megatron-core builds it as ``build_module(spec, config=,
    hidden_size=, eps=)``, the strategy arrives through the spec's params."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *,
                 scalevec: ScaleVecConfig, kind: str = "pre", placement=None,
                 expert_allreduce=None):
        if kind not in ("pre", "final", "qk", "branch"):
            raise ValueError(f"ScaleVecNorm kind must be pre, final, qk or branch, got {kind!r}")
        has_vector = scalevec.vectors and not (kind == "pre" and scalevec.hg)
        if kind != "branch":  # built by megatron-core from the spec: placed here
            placement = sharding.placement(f"{kind}_norm", config, sharding.tp_group(False))
        super().__init__(
            hidden_size, scalevec.parameterization if has_vector else None,
            role="input" if kind in ("pre", "final") else "output", **(placement or {}),
            expert_allreduce=expert_allreduce, dtype=config.params_dtype)
        self.kind = kind
        self.eps = eps
        self.normalization = config.normalization
        self.layer = ops.is_layer_norm(self.normalization)  # one clear error if neither
        self.bias = None
        if self.layer and kind != "branch" and scalevec.layernorm_bias == "stock":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
            if kind != "qk" and getattr(config, "sequence_parallel", False):  # as stock
                self.bias.sequence_parallel = True

    def named_scale_vectors(self):
        """A Pre-Norm or final norm declares itself (declared.py); a QK / DNP branch norm is
        declared by the module that applies it (attention, MLP, experts)."""
        if self.kind in ("pre", "final"):
            yield Declared("", self, self.role, "pre")

    def forward(self, x: Optional[torch.Tensor] = None):
        """``gamma * N(x)``; without ``x``, as every ScaleVector, gamma itself (None without a
        vector): the one way its value is read (vectors.py), e.g. by the fused functions that
        apply it."""
        if x is None:
            return super().forward()
        return _ScaledNorm.apply(x, super().forward(), self.bias, self.layer, self.eps,
                                 self.split_group, self.global_size)


def ffn_norms(config, scalevec: ScaleVecConfig, width: int, placement: dict,
              allreduce: Optional[bool] = None) -> dict:
    """DNP's ``{"gate": norm, "up": norm}`` over an FFN's local ``width`` (None where there is
    none: no DNP; no gate without a GLU): the one definition for an MLP, a TE grouped expert
    and the shared expert vectors. ``allreduce``: an expert weight's (None: dense)."""
    def norm():
        return ScaleVecNorm(config, width, config.layernorm_epsilon, scalevec=scalevec,
                            kind="branch", placement=placement, expert_allreduce=allreduce)

    up = norm() if scalevec.dnp else None
    gate = norm() if scalevec.dnp and config.gated_linear_unit else None
    return {"gate": gate, "up": up}
