"""``tools/example_data.py``: the inputs the docs' own-data commands read, made from what the
default run already uses, so a reader without a corpus or a tokenizer can follow them:

* ``--corpus corpus.jsonl``: a few hundred kilobytes of the embedded corpus (this Python's
  standard library) in small documents, one ``{"text": ...}`` per line;
* ``--tokenizer spm.model``: the default run's SentencePiece model (4096 pieces).

Both are built once in the cache (as the default run builds them) and copied; an existing
output is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from megatron_scalevec.cli_help import show_defaults
from megatron_scalevec.training.corpus import (
    DEFAULT_CACHE_DIR,
    DEFAULT_VOCAB_SIZE,
    DataPathError,
    atomic_path,
    corpus_file,
    embedded_corpus,
    train_tokenizer,
)

SAMPLE_BYTES = 400_000
SAMPLE_CHUNK = 2048  # small documents: a 2% validation split still holds some


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="example_data.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="write a small JSONL corpus here")
    p.add_argument("--tokenizer", help="write the default run's SentencePiece model here")
    p.add_argument("--max-bytes", type=int, default=SAMPLE_BYTES, help="text in the corpus")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return show_defaults(p)


def _copy(src: str, dst: str) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
    print(f"wrote {dst}", flush=True)


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        if not (a.corpus or a.tokenizer):
            raise DataPathError("nothing to write: pass --corpus FILE and/or --tokenizer FILE")
        if a.max_bytes < SAMPLE_CHUNK:
            raise DataPathError(f"--max-bytes {a.max_bytes} is below one document "
                                f"({SAMPLE_CHUNK} bytes)")
        for out in (a.corpus, a.tokenizer):
            if out and os.path.exists(out) and not a.overwrite:
                raise DataPathError(f"{out} exists: pass --overwrite to replace it, or another "
                                    f"name")
        if a.tokenizer and not os.path.isfile(
                os.path.join(os.path.expanduser(a.cache_dir), "tokenizer",
                             f"stdlib-spm{DEFAULT_VOCAB_SIZE}.meta.json")):
            print(f"building the embedded corpus and its tokenizer in {a.cache_dir} (once; "
                  f"later runs reuse them)", flush=True)
        if a.corpus:
            _copy(embedded_corpus(a.cache_dir, a.max_bytes, SAMPLE_CHUNK), a.corpus)
        if a.tokenizer:
            cache = os.path.expanduser(a.cache_dir)
            model = train_tokenizer(corpus_file(cache) if os.path.isfile(corpus_file(cache))
                                    else embedded_corpus(cache),
                                    os.path.join(cache, "tokenizer",
                                                 f"stdlib-spm{DEFAULT_VOCAB_SIZE}"))
            _copy(model, a.tokenizer)
    except DataPathError as e:
        print(f"example_data: error: {e}", file=sys.stderr)
        return 2
    return 0
