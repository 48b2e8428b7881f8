"""megatron_scalevec: the scale-vector strategy (arXiv 2605.26895) for megatron-core.

``ScaleVecConfig`` holds the strategy; ``megatron_scalevec.specs`` builds models with it.
"""

from megatron_scalevec.config import ScaleVecConfig

__all__ = ["ScaleVecConfig"]
__version__ = "0.1.0"
