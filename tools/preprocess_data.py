#!/usr/bin/env python
"""Tokenize text or JSONL into Megatron indexed datasets (megatron_scalevec.training.preprocess).

Example:
    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-model tok.model --output-prefix data/corpus --append-eod --workers 4
"""

import os
import sys

if __name__ == "__main__":
    try:
        import megatron_scalevec  # noqa: F401
    except ImportError:  # run from a checkout without installing
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_scalevec.training.preprocess import main

    sys.exit(main())
