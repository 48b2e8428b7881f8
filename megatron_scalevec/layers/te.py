"""Transformer Engine linears with scale vectors (optional accelerator, imported behind a guard).

TE's linears own their weight and take no external one, and their FP8 casts happen inside
the GEMM, so the vectors are applied on the activation side (layers/linear.py) and FP8 comes
from TE's own GEMMs. Nothing here runs without TE; :func:`te_modules` says why clearly.
"""

from __future__ import annotations

import importlib.util

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers.linear import ScaleVecLinearMixin

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
_CACHE = {}


def te_modules() -> dict:
    """{'column': ScaleVec TE column linear, 'row': TERowParallelLinear, 'attention': ...}."""
    if not HAVE_TE:
        raise ImportError("transformer_impl='transformer_engine' needs Transformer Engine "
                          "(pip install 'megatron_scalevec[te]' on a CUDA machine); use "
                          "transformer_impl='local' otherwise")
    if _CACHE:
        return _CACHE
    from megatron.core.extensions.transformer_engine import (  # noqa: PLC0415
        TEColumnParallelLinear,
        TEDotProductAttention,
        TERowParallelLinear,
    )

    class ScaleVecTEColumnParallelLinear(ScaleVecLinearMixin, TEColumnParallelLinear):
        """TEColumnParallelLinear with per-branch vectors applied to activations."""

        def __init__(self, input_size, output_size, *, scalevec: ScaleVecConfig, branches: str,
                     config, is_expert: bool = False, **kwargs):
            super().__init__(input_size, output_size, config=config, is_expert=is_expert,
                             **kwargs)
            mode = scalevec.resolve_apply_mode(local_linear=False)
            if mode != "activation":
                raise ValueError("Transformer Engine linears own their weight: scale vectors "
                                 "need apply_mode 'activation' (or 'auto') with them")
            group = sharding.tp_group(is_expert)
            self._init_scale_vectors(scalevec, branches, config, input_size,
                                     output_size // sharding.group_size(group), is_expert,
                                     group, mode)

        def forward(self, x):
            if not self.has_scale_vectors:
                return super().forward(x)
            return self._activation_forward(
                x, lambda y: super(ScaleVecTEColumnParallelLinear, self).forward(y))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            return self.scale_vector_sharded_state_dict(sd, prefix, sharded_offsets, metadata)

    _CACHE.update(column=ScaleVecTEColumnParallelLinear, row=TERowParallelLinear,
                  attention=TEDotProductAttention)
    return _CACHE
