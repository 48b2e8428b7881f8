#!/usr/bin/env python
"""shared vs unified at several sizes on a tokens-per-parameter budget; loss-vs-compute fit and
the compute multiplier with a bootstrap interval over seeds.

Usage: python tools/scaling.py [--out runs/scaling] [--sizes 2x32 2x48 2x64 3x80] [--seeds 2]
Re-running resumes; --report-only refits and redraws.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evidence.scaling import main  # noqa: E402

if __name__ == "__main__":
    main()
