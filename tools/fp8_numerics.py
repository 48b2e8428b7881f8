#!/usr/bin/env python
"""FP8 numerics of folded scale vectors, emulated on CPU (docs/RESULTS.md, FP8).

Usage: python tools/fp8_numerics.py [--out runs/fp8] [--variants shared hg hg+dp unified]
       [--load CKPT ...] [--sigmas 0 1 2 3] [--train-compare shared unified] [--mean-kept]
Re-running reuses the trained checkpoints under --out/ckpt.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evidence.fp8_report import main  # noqa: E402

if __name__ == "__main__":
    main()
