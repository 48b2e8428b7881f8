"""Which linear and attention classes a layer is built from: a swap of parts, not a branch
inside a layer (local megatron-core linears, or Transformer Engine's for FP8)."""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_scalevec.layers.linear import ScaleVecColumnParallelLinear


def linear_modules(transformer_impl: str = "local") -> dict:
    """{'column', 'row', 'attention'}: megatron-core's local parts; or TE's (FP8 capable), with
    'ln_column' (the fused norm + linear), 'norm' ({normalization: class}) and the grouped
    experts' 'grouped_column', 'grouped_row', 'grouped_mlp' (layers/te_classes.py)."""
    if transformer_impl == "local":
        return {"column": ScaleVecColumnParallelLinear, "row": RowParallelLinear,
                "attention": DotProductAttention}
    if transformer_impl == "transformer_engine":
        from megatron_scalevec.layers import te  # noqa: PLC0415 (optional, guarded)

        te.require_te()
        from megatron_scalevec.layers.te_classes import PARTS  # noqa: PLC0415 (needs TE)

        return dict(PARTS)
    raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', "
                     f"got {transformer_impl!r}")
