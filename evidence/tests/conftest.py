"""The evidence tooling's tests: the repository root on sys.path and the CPU layer on, as in the
repository root's conftest.py (these tests live beside the code they test, outside the package's
suite)."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

os.environ.setdefault("MEGATRON_SCALEVEC_FUSED_COMPILE", "off")  # eager kernels, as in tests/

from megatron_scalevec.compat.cpu import enable_cpu_compat  # noqa: E402

enable_cpu_compat()
