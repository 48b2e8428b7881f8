#!/usr/bin/env python
"""Step time and memory of each scale-vector variant vs megatron-core's stock spec.

Usage: python tools/bench_overhead.py [--variants stock unified ...] [--device cuda --bf16]
"""

from megatron_scalevec.bench import main

if __name__ == "__main__":
    main()
