#!/usr/bin/env python
"""Step time, saved activations and total peak memory of each scale-vector variant vs
megatron-core's stock spec and our ``shared`` (benchmarks/overhead.py).

Usage: python tools/bench_overhead.py [--variants stock shared unified ...] [--null]
       [--device cuda --bf16]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.overhead import main  # noqa: E402

if __name__ == "__main__":
    main()
