"""Put the repository root on sys.path and enable the CPU layer before megatron is imported."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from megatron_scalevec.compat.cpu import enable_cpu_compat  # noqa: E402

enable_cpu_compat()
