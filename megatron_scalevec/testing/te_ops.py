"""Test-only torch versions of the few Transformer Engine extension functions that TE's non-FP8
forward and backward of ``LayerNormLinear``, ``Linear`` and ``GroupedLinear`` call (fp32, CPU),
installed on te_stub's stand-in extension."""

from __future__ import annotations


def install(mod) -> None:
    """Put the implemented functions on the stand-in extension module."""
    mod.get_num_cublas_streams = lambda: 4
    # DotProductAttention's constructor reads it (encoded as cudnn does: 9.10.0)
    mod.get_cudnn_version = lambda: 91000
