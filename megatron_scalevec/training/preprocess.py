"""Text or JSONL -> Megatron indexed datasets (``.bin/.idx``), one document per record.

Flags follow Megatron-LM's ``tools/preprocess_data.py`` (``--input``, ``--output-prefix``,
``--tokenizer-model``, ``--json-keys``, ``--append-eod``, ``--workers``, ``--log-interval``);
each key ``K`` is written to ``<output-prefix>_<K>_document.{bin,idx}``. Only SentencePiece
models are accepted (``--tokenizer-type SentencePieceTokenizer``). Plain text inputs (anything not
``.json``/``.jsonl``) hold one document per line, per blank-line-separated paragraph or per file
(``--text-split``). Outputs are written under temporary names and renamed (``.idx`` last), so a
reader never sees a half-written dataset.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Optional

import numpy as np

from megatron_scalevec.cli_help import show_defaults
from megatron_scalevec.training.corpus import DataPathError, SentencePieceTokenizer

__all__ = ["main", "preprocess", "read_documents"]

_BATCH_DOCS = 64


# ----------------------------------------------------------------------------- reading
def _is_jsonl(path: str, input_format: str) -> bool:
    if input_format != "auto":
        return input_format == "jsonl"
    return path.endswith((".json", ".jsonl"))


def read_documents(
    paths: Sequence[str], json_keys: Sequence[str], input_format: str = "auto",
    text_split: str = "line",
) -> Iterator[tuple[dict, int]]:
    """Yield ``({key: text}, bytes_read_so_far)`` per document, in input order."""
    done = 0
    for path in paths:
        if not os.path.isfile(path):
            raise DataPathError(f"input {path!r} does not exist")
        with open(path, "rb") as f:
            if _is_jsonl(path, input_format):
                for n, raw in enumerate(f, 1):
                    done += len(raw)
                    if not raw.strip():
                        continue
                    try:
                        rec = json.loads(raw)
                        doc = {k: rec[k] for k in json_keys}
                    except (ValueError, KeyError, TypeError) as err:
                        raise DataPathError(
                            f"{path}:{n}: not a JSON object with keys {list(json_keys)} ({err})"
                        ) from err
                    if not all(isinstance(v, str) for v in doc.values()):
                        raise DataPathError(f"{path}:{n}: {list(json_keys)} must be strings")
                    yield doc, done
            else:
                yield from _text_documents(f, path, json_keys, text_split, done)
                done += os.path.getsize(path)


def _text_documents(f, path, json_keys, text_split, done):
    def decode(raw: bytes, n: int) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataPathError(f"{path}:{n}: not UTF-8 text ({err})") from err

    def doc(text):
        return {k: text for k in json_keys}

    if text_split == "file":
        yield doc(decode(f.read(), 1)), done + os.path.getsize(path)
        return
    para, n = [], 0
    for n, raw in enumerate(f, 1):
        done += len(raw)
        line = decode(raw, n)
        if text_split == "line":
            if line.strip():
                yield doc(line.rstrip("\r\n")), done
        elif line.strip():
            para.append(line)
        elif para:
            yield doc("".join(para)), done
            para = []
    if para:
        yield doc("".join(para)), done


# ----------------------------------------------------------------------------- encoding
_WORKER_TOKENIZER: Optional[SentencePieceTokenizer] = None


def _init_worker(model_path: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = SentencePieceTokenizer(model_path)


def _encode(job: tuple[list[dict], int], tokenizer=None) -> tuple[list[dict], int]:
    """``([{key: text}], bytes_read)`` -> ``([{key: ids}], bytes_read)``."""
    batch, done = job
    tok, threads = (tokenizer, -1) if tokenizer is not None else (_WORKER_TOKENIZER, 1)
    out = [dict() for _ in batch]
    for key in batch[0] if batch else []:
        for d, ids in zip(out, tok.tokenize_batch([doc[key] for doc in batch], threads)):
            d[key] = ids
    return out, done


def _jobs(documents, n):
    """Group ``(doc, bytes_read)`` pairs into ``([doc, ...], bytes_read_after_last)`` jobs."""
    it = iter(documents)
    while batch := list(itertools.islice(it, n)):
        yield [doc for doc, _ in batch], batch[-1][1]


class _Progress:
    """tqdm when it is installed, else one status line every ``interval`` documents."""

    def __init__(self, total_bytes: int, enabled: bool, interval: int, stream=None):
        self.total, self.enabled, self.interval = total_bytes, enabled, max(1, interval)
        self.stream = stream or sys.stderr
        self.docs = self.tokens = self.done = 0
        self.t0 = self._last = time.monotonic()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True,
                                desc="tokenizing", file=self.stream)
            except ImportError:
                pass

    def update(self, docs: int, tokens: int, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.docs, self.tokens, self.done = self.docs + docs, self.tokens + tokens, done
        if self.enabled and self.bar is None and (
            self.docs // self.interval != (self.docs - docs) // self.interval
        ):
            self.line()

    def line(self) -> None:
        dt = max(time.monotonic() - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        print(f"tokenizing: {self.docs} docs, {self.tokens} tokens, {self.done / 1e6:.1f}/"
              f"{self.total / 1e6:.1f} MB ({pct:.0f}%), {self.done / 1e6 / dt:.2f} MB/s",
              file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.line()


# ----------------------------------------------------------------------------- writing
def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer_model: str,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    input_format: str = "auto",
    text_split: str = "line",
    log_interval: int = 1000,
    progress: bool = True,
    overwrite: bool = True,
) -> dict:
    """Tokenize ``inputs`` into ``<output_prefix>_<key>_document`` per key; return statistics.

    Documents that tokenize to nothing are skipped (counted in ``skipped``). With ``append_eod``
    each document ends with the tokenizer's EOD id. ``overwrite=False``: an existing output is
    refused before anything is read.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    inputs = [os.path.expanduser(p) for p in inputs]
    for path in inputs:
        if not os.path.isfile(path):
            raise DataPathError(f"input {path!r} does not exist")
    finals = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    existing = [p + ext for p in finals.values() for ext in (".bin", ".idx")
                if os.path.exists(p + ext)]
    if existing and not overwrite:
        raise DataPathError(f"{existing[0]} exists: pass --overwrite to replace it, or another "
                            f"--output-prefix")
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temps = {k: f"{p}.{tag}" for k, p in finals.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    stats = {k: {"documents": 0, "tokens": 0, "skipped": 0} for k in json_keys}
    bar = _Progress(sum(os.path.getsize(p) for p in inputs), progress, log_interval)
    builders, pool = {}, None
    try:
        builders = {k: IndexedDatasetBuilder(t + ".bin", dtype=dtype) for k, t in temps.items()}
        jobs = _jobs(read_documents(inputs, json_keys, input_format, text_split), _BATCH_DOCS)
        if workers > 1:  # imap keeps the order; the reader runs ahead in pool's feeder thread
            pool = mp.Pool(workers, initializer=_init_worker, initargs=(tokenizer.model_path,))
            encoded = pool.imap(_encode, jobs, chunksize=1)
        else:
            encoded = (_encode(job, tokenizer) for job in jobs)
        for ids_batch, done in encoded:
            n_tok = 0
            for ids_doc in ids_batch:
                for key, ids in ids_doc.items():
                    if not ids:
                        stats[key]["skipped"] += 1
                        continue
                    if append_eod:
                        ids = ids + [tokenizer.eod]
                    builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                    stats[key]["documents"] += 1
                    stats[key]["tokens"] += len(ids)
                    n_tok += len(ids)
            bar.update(len(ids_batch), n_tok, done)
        for key, builder in builders.items():
            builder.finalize(temps[key] + ".idx")
        for key, final in finals.items():  # unpublish, replace data, publish the index last
            if os.path.exists(final + ".idx"):
                os.unlink(final + ".idx")
            os.replace(temps[key] + ".bin", final + ".bin")
            os.replace(temps[key] + ".idx", final + ".idx")
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
        for builder in builders.values():
            builder.data_file.close()
        for tmp in temps.values():
            for ext in (".bin", ".idx"):
                if os.path.exists(tmp + ext):
                    os.unlink(tmp + ext)
    for key, final in finals.items():
        stats[key]["prefix"] = final
    return stats


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Tokenize text or JSONL into Megatron indexed datasets (.bin/.idx)."
    )
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help="JSONL (.json/.jsonl: one object per line) or plain text files")
    g.add_argument("--json-keys", "--json-key", nargs="+", default=["text"], dest="json_keys",
                   help="JSON keys to extract, one output per key (default: text)")
    g.add_argument("--input-format", choices=["auto", "jsonl", "text"], default="auto")
    g.add_argument("--text-split", choices=["line", "blank", "file"], default="line",
                   help="plain text: one document per line, per paragraph, or per file")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
    g.add_argument("--tokenizer-model", required=True, help="SentencePiece .model file")
    g.add_argument("--append-eod", action="store_true",
                   help="end every document with the EOD token")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True,
                   help="writes <prefix>_<key>_document.bin/.idx")
    g.add_argument("--overwrite", action="store_true",
                   help="replace outputs that exist (refused otherwise)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="tokenizer processes (1: one process, SentencePiece threads on all cores)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="documents between status lines (without tqdm)")
    g.add_argument("--no-progress", action="store_true")
    return show_defaults(p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.workers < 1:
        _parser().error("--workers must be >= 1")
    from megatron_scalevec.training.summary import backend_note, folded_backend_warnings

    folded: list = []
    try:
        with folded_backend_warnings(folded):  # megatron-core's "TE / Apex not installed"
            from megatron_scalevec.compat.cpu import enable_cpu_compat

            enable_cpu_compat()  # a no-op with CUDA; on CPU it makes the megatron import fast
            from megatron.core.datasets import indexed_dataset  # noqa: F401
        if folded:
            print(backend_note(folded), file=sys.stderr, flush=True)
        t0 = time.monotonic()
        stats = preprocess(
            args.input, args.output_prefix, args.tokenizer_model, args.json_keys,
            append_eod=args.append_eod, workers=args.workers, input_format=args.input_format,
            text_split=args.text_split, log_interval=args.log_interval,
            progress=not args.no_progress, overwrite=args.overwrite,
        )
    except DataPathError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key, s in stats.items():
        print(f"{key}: {s['documents']} documents, {s['tokens']} tokens, {s['skipped']} empty "
              f"skipped -> {s['prefix']}.bin/.idx ({time.monotonic() - t0:.1f} s)")
    return 0
