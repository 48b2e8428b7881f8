"""Test support for megatron_scalevec, beside the package and never installed with it (setup.py
packages ``megatron_scalevec`` only; tests/test_packaging.py checks the wheel): gloo ranks forked
from the calling process, tiny models, and the CPU stand-ins of Transformer Engine's compiled
kernels (te_stub, te_ops, te_fp8) and of Megatron-Bridge's GPU imports (bridge_shim), used by
tests, benchmarks and tools. The stand-ins activate only where :data:`OPT_IN` is set to 1
(conftest.py sets it for the test suite; the ledger benchmark for its TE rows).

What several test files share lives here too, because a test file never imports another
(tests/test_import_cycles.py checks it): ``markers`` (``needs_te``), ``te_compare`` (the TE path
against the local spec), ``experts`` (the tiny MoE config, layouts and checkpoint rank functions),
``trainer_flags`` (the tiny trainer command line and its rank function). Shared pytest fixtures
live in tests/conftest.py (which also says where a new test goes)."""

import os

from scalevec_testing.distributed import (
    RankError,
    gather_full_tensor,
    init_model_parallel,
    run_on_ranks,
)

OPT_IN = "MEGATRON_SCALEVEC_STANDINS"


def opted_in() -> bool:
    """The stand-ins were asked for explicitly (``MEGATRON_SCALEVEC_STANDINS=1``)."""
    return os.environ.get(OPT_IN) == "1"


__all__ = ["OPT_IN", "RankError", "gather_full_tensor", "init_model_parallel", "opted_in",
           "run_on_ranks"]
