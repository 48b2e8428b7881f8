"""Test helpers: run megatron-core code on several gloo ranks forked from the test process."""

from megatron_scalevec.testing.distributed import (
    RankError,
    gather_full_tensor,
    init_model_parallel,
    run_on_ranks,
)

__all__ = ["RankError", "gather_full_tensor", "init_model_parallel", "run_on_ranks"]
