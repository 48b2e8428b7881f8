#!/usr/bin/env python
"""GPU cost ledger: kept bytes, memory traffic, collectives and host syncs of each scale-vector
variant against stock megatron-core and ``shared``, local and TE layouts, dense and MoE
(benchmarks/ledger_report.py; columns in docs/benchmarks.md, "GPU cost ledger").

Usage: python tools/bench_ledger.py [--variants stock shared unified ...] [--layouts local te]
       [--kinds dense moe] [--hidden-size 256 --num-layers 2 --seq-length 64] [--no-memory]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.ledger_report import main  # noqa: E402

if __name__ == "__main__":
    main()
