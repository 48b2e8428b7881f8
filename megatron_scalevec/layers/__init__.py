"""Attention, MLP and linear pieces that apply scale vectors (math only)."""

from megatron_scalevec.layers.attention import ScaleVecSelfAttention
from megatron_scalevec.layers.linear import ScaleVecColumnParallelLinear, ScaleVecLinearMixin
from megatron_scalevec.layers.mlp import ScaleVecMLP

__all__ = ["ScaleVecColumnParallelLinear", "ScaleVecLinearMixin", "ScaleVecMLP",
           "ScaleVecSelfAttention"]
