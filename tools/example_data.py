#!/usr/bin/env python
"""Write the inputs of the docs' own-data commands: a small corpus.jsonl from the embedded
corpus and the default run's SentencePiece model (megatron_scalevec.training.example_data).

    python tools/example_data.py --corpus corpus.jsonl --tokenizer spm.model
"""

import os
import sys

if __name__ == "__main__":
    try:
        import megatron_scalevec  # noqa: F401
    except ImportError:  # run from a checkout without installing
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_scalevec.training.example_data import main

    sys.exit(main())
