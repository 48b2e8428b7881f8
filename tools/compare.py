#!/usr/bin/env python
"""shared vs unified in a few minutes on a CPU: each at its best LR of a 3-point grid, one plot
with both validation curves and the difference with its interval.

Usage: python tools/compare.py [--data-path PREFIX ...] [--seeds 3] [--out runs/compare]
Re-running resumes (finished runs are kept).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evidence.compare import main  # noqa: E402

if __name__ == "__main__":
    main()
