#!/usr/bin/env python
"""The scale vectors' learning rate per width and strategy (issue 51), via the trainer.

Usage: python tools/vector_lr.py [--out runs/evidence/vector_lr] [--widths 64 128] ...
Re-running the same command resumes the sweep; --report-only rewrites the tables and figure.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evidence.vector_lr import main  # noqa: E402

if __name__ == "__main__":
    main()
