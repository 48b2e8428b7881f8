#!/usr/bin/env python
"""Convert checkpoints (see megatron_scalevec/convert/cli.py for the usage and examples)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_scalevec.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
