#!/usr/bin/env python
"""The paper's ablation ladder (dense and MoE, paired seeds) and controls, via the trainer.

Usage: python tools/ablation.py [--out runs/ablation] [--families dense moe] [--seeds 3] ...
Re-running the same command resumes the sweep; --report-only rewrites tables and plots.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evidence.ablation import main  # noqa: E402

if __name__ == "__main__":
    main()
