"""Training data: megatron-core GPT datasets and a resumable micro-batch stream.

With ``data_path`` given, ``build_datasets`` reads Megatron indexed datasets (``.bin/.idx``, made
by ``tools/preprocess_data.py``) through megatron-core's ``BlendedMegatronDatasetBuilder``. With
no ``data_path`` it builds the embedded default under ``cache_dir`` (``--data-cache-path``; by
default ``~/.cache/megatron_scalevec``):

    corpus/python-<ver>-stdlib-<cap>-<chunk>-v1.jsonl   the Python standard library's source
    tokenizer/stdlib-spm<vocab>.model (+ .vocab, .meta.json)   BPE trained on it
    data/stdlib-<key>_text_document.bin/.idx             the corpus tokenized, EOD per document

megatron-core's sample/shuffle index cache goes where Megatron-LM puts it: in
``--data-cache-path`` when given, else beside the data (``<prefix>/cache/GPTDataset_indices``).

Every file is written to a temporary name and renamed, so an interrupted build leaves no partial
artifact; the next run rebuilds only what is missing. Several nodes need not share a filesystem
(a home directory per node): global rank 0 builds first, then the first rank of every other node
(torchrun's ``LOCAL_RANK`` 0) builds what its node does not see yet (on a shared filesystem it
finds rank 0's files and writes nothing), and only then does every rank read; the nodes' embedded
data must come out the same (checked: one line if not). Corpus and tokenizer code lives in
``corpus.py`` and is re-exported here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_scalevec.training.corpus import (
    DEFAULT_CACHE_DIR,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CORPUS_BYTES,
    DEFAULT_VOCAB_SIZE,
    DataPathError,
    SentencePieceTokenizer,
    atomic_path,
    corpus_file,
    embedded_corpus,
    sha256_file,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "BatchIterator",
    "DataPathError",
    "SentencePieceTokenizer",
    "atomic_path",
    "build_datasets",
    "check_indexed_dataset",
    "embedded_corpus",
    "embedded_dataset",
    "make_batch_iterator",
    "train_tokenizer",
]


# ----------------------------------------------------------------------------- datasets
def check_indexed_dataset(prefix: str) -> int:
    """Fail with a message naming ``prefix`` unless it is a readable, complete indexed dataset.

    Reads the ``.idx`` layout itself (megatron's reader asserts, and a half-built reader then
    fails again in ``__del__``). Returns the number of sequences (one per document for GPT).
    """
    import struct

    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    if prefix.endswith((".bin", ".idx")):
        raise DataPathError(f"data path {prefix!r}: give the prefix without .bin/.idx")
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        raise DataPathError(f"data path {prefix!r}: missing {', '.join(missing)}")
    idx = prefix + ".idx"
    try:
        with open(idx, "rb") as f:
            head = f.read(34)
            if len(head) < 34 or head[:9] != _INDEX_HEADER:
                raise ValueError("not a Megatron index (bad header)")
            version, code, n, docs = struct.unpack("<QBQQ", head[9:])
            if version != 1:
                raise ValueError(f"index version {version}, expected 1")
            itemsize = np.dtype(DType.dtype_from_code(code)).itemsize
            if os.path.getsize(idx) < 34 + 12 * n + 8 * docs:
                raise ValueError("truncated")
            lengths = np.fromfile(f, dtype=np.int32, count=n)
            pointers = np.fromfile(f, dtype=np.int64, count=n)
    except Exception as err:
        raise DataPathError(f"data path {prefix!r}: unreadable index {idx} ({err})") from err
    need = int(pointers[-1]) + int(lengths[-1]) * itemsize if n else 0
    have = os.path.getsize(prefix + ".bin")
    if have != need:
        raise DataPathError(
            f"data path {prefix!r}: {prefix}.bin has {have} bytes, its index expects {need} "
            "(truncated or from another run)"
        )
    if n == 0:
        raise DataPathError(f"data path {prefix!r}: no documents")
    return int(n)


def _parse_blend(data_path: list[str]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron's blend list: ``[p1, p2, ...]`` or ``[w1, p1, w2, p2, ...]``."""
    items = [str(x).strip() for x in data_path if str(x).strip()]
    if not items:
        raise DataPathError("--data-path is empty")

    def number(s):
        try:
            return float(s)
        except ValueError:
            return None

    weights = [number(s) for s in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataPathError(f"data path weights must be >= 0 with a positive sum: {weights}")
        return [os.path.expanduser(p) for p in items[1::2]], weights
    if any(number(s) is not None for s in items):
        raise DataPathError(f"data path {items}: expected 'prefix ...' or 'weight prefix ...'")
    return [os.path.expanduser(p) for p in items], None


def _check_splits(prefixes, split_matrix, sizes, seq_length):
    """Refuse a split that was asked for samples but holds < one sample of tokens (megatron
    would loop forever counting epochs)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        ds = IndexedDataset(prefix, mmap=True)  # keep it alive: its mmap backs the array
        lengths = np.array(ds.index.sequence_lengths)
        del ds
        for name, bounds, size in zip(("train", "valid", "test"), split_matrix, sizes):
            if not size or bounds is None:
                continue
            beg, end = (int(round(b * len(lengths))) for b in bounds)
            tokens = int(np.sum(lengths[beg:end], dtype=np.int64))
            if tokens <= seq_length:
                raise DataPathError(
                    f"data path {prefix!r}: the {name} split has {end - beg} documents and "
                    f"{tokens} tokens, fewer than one sample of {seq_length + 1}; change --split"
                )


def _is_node_builder() -> bool:
    """This rank builds its node's files: global rank 0, and the first rank of every node
    (torchrun's ``LOCAL_RANK`` 0; without it, one node)."""
    dist = torch.distributed
    local = os.environ.get("LOCAL_RANK")
    return dist.get_rank() == 0 or (local is not None and int(local) == 0)


def _per_node(fn: Callable, *args, **kwargs) -> None:
    """``fn`` on global rank 0, then on the first rank of every other node (each node's
    filesystem gets what it lacks); every rank waits for both rounds, and a failure on any
    builder is raised on every rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        fn(*args, **kwargs)
        return
    for round_ in (0, 1):
        err = None
        mine = dist.get_rank() == 0 if round_ == 0 else (_is_node_builder() and
                                                         dist.get_rank() != 0)
        if mine:
            try:
                fn(*args, **kwargs)
            except Exception as e:  # shared with the other ranks, then re-raised
                err = e
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            raise RuntimeError(f"rank {failed[0][0]} failed to build the data: {failed[0][1]}")


def _same_on_every_rank(value: str, what: str) -> None:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    if len(set(seen)) > 1:
        odd = next(r for r, v in enumerate(seen) if v != seen[0])
        raise DataPathError(f"the nodes built different {what} (rank 0: {seen[0]}, rank {odd}: "
                            f"{seen[odd]}): pass --data-cache-path on a filesystem every node "
                            f"shares")


@contextlib.contextmanager
def _as_one_process():
    """megatron-core's dataset builder as in a single process (no barriers, this rank builds
    and saves its index cache): a node's builder making the files its node reads."""
    dist = torch.distributed
    saved = dist.is_initialized, dist.get_rank
    dist.is_initialized, dist.get_rank = (lambda: False), (lambda group=None: 0)
    try:
        yield
    finally:
        dist.is_initialized, dist.get_rank = saved


def embedded_dataset(
    cache_dir: str = DEFAULT_CACHE_DIR,
    tokenizer_model: Optional[str] = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus_max_bytes: int = DEFAULT_CORPUS_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    workers: int = 1,
    log: Optional[Callable[[str], None]] = None,
) -> tuple[str, str]:
    """Build (once) the embedded default; return ``(indexed_dataset_prefix, tokenizer_model)``.
    ``log`` gets one line before a build that takes a while (corpus and tokenizer missing).

    Not distributed-aware: ``build_datasets`` calls it on each node's builder first (which
    builds what is missing), then on every rank (which only reads).
    """
    from megatron_scalevec.training.preprocess import preprocess

    cache = Path(os.path.expanduser(cache_dir))
    if tokenizer_model is not None and not os.path.isfile(tokenizer_model):
        raise DataPathError(f"tokenizer model {tokenizer_model!r} does not exist")
    tok_prefix = str(cache / "tokenizer" / f"stdlib-spm{vocab_size}")
    if log is not None and not (
            os.path.isfile(corpus_file(str(cache), corpus_max_bytes, chunk_bytes))
            and (tokenizer_model is not None or os.path.isfile(tok_prefix + ".meta.json"))):
        log(f"building the embedded corpus (this Python's standard library), its tokenizer and "
            f"dataset in {cache} (once; later runs reuse them)")
    corpus = embedded_corpus(str(cache), corpus_max_bytes, chunk_bytes)
    if tokenizer_model is None:
        tokenizer_model = train_tokenizer(corpus, tok_prefix, vocab_size)
    key = hashlib.sha256(
        (sha256_file(corpus) + sha256_file(tokenizer_model) + "eod").encode()
    ).hexdigest()[:16]
    prefix = str(cache / "data" / f"stdlib-{key}_text_document")
    if not (os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin")):
        preprocess([corpus], str(cache / "data" / f"stdlib-{key}"), tokenizer_model,
                   json_keys=["text"], append_eod=True, workers=workers, progress=False)
    return prefix, tokenizer_model


def build_datasets(
    data_path: Optional[list[str]],
    tokenizer_model: Optional[str],
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int,
    split: str = "98,2,0",
    cache_dir: Optional[str] = DEFAULT_CACHE_DIR,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus_max_bytes: int = DEFAULT_CORPUS_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    log: Optional[Callable[[str], None]] = None,
):
    """Return ``(train_ds, valid_ds, tokenizer)``: megatron-core ``GPTDataset``s (or a
    ``BlendedDataset`` for a weighted blend) whose items are ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` of length ``seq_length``.

    ``data_path=None`` uses the embedded default (``tokenizer_model`` optional: trained if None);
    otherwise ``tokenizer_model`` is required. Call it on every rank (it synchronizes); works
    without ``torch.distributed`` too. ``valid_ds`` is None when the split gives it no share.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cache = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
    if data_path is None or len(data_path) == 0:
        embedded = (cache, tokenizer_model, vocab_size, corpus_max_bytes, chunk_bytes)
        _per_node(embedded_dataset, *embedded, log=log)  # one process: no fork in a rank
        prefix, tokenizer_model = embedded_dataset(*embedded)  # built: only reads
        _same_on_every_rank(os.path.basename(prefix), "embedded data (corpus or tokenizer)")
        prefixes, weights = [prefix], None
    else:
        if tokenizer_model is None:
            raise DataPathError("--data-path needs --tokenizer-model (the model it was made with)")
        prefixes, weights = _parse_blend(data_path)
        for p in prefixes:  # every rank checks: a bad path fails everywhere, nobody hangs
            check_indexed_dataset(p)
        # megatron-core keys its index cache (shared: ``cache``/indices) by the prefixes as
        # given: a relative one would reuse another directory's same-named dataset's indices
        prefixes = [os.path.abspath(p) for p in prefixes]
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    config = GPTDatasetConfig(  # index cache: --data-cache-path, else beside the data
        random_seed=int(seed), sequence_length=int(seq_length), blend=(prefixes, weights),
        split=split, path_to_cache=os.path.abspath(os.path.expanduser(cache_dir))
        if cache_dir else None, tokenizer=tokenizer,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    sizes = [int(train_samples), int(valid_samples), 0]
    _check_splits(prefixes, config.split_matrix, sizes, int(seq_length))

    def build():
        return BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, is_built_on_rank or (lambda: True), config).build()

    def build_alone():
        with _as_one_process(), _single_process_rank():
            build()

    _per_node(build_alone)  # each node's index cache, before anyone reads it
    with _single_process_rank():
        train, valid, _ = build()
    return train, valid, tokenizer


@contextlib.contextmanager
def _single_process_rank():
    """megatron-core 0.16.1's ``BlendedDataset`` calls ``torch.distributed.get_rank()`` on a
    cache miss even without a process group (a crash in one process); report rank 0 there."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        yield
        return
    saved = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = saved


# ----------------------------------------------------------------------------- batches
@dataclasses.dataclass
class BatchIterator:
    """Micro-batches in megatron's GPT layout for one data-parallel rank, resumable.

    Global sample ``g`` (counting every DP rank) is dataset item ``g mod len`` in the first pass
    (the dataset is already shuffled) and a ``seed``-permuted item in later passes. A micro-batch
    step takes the next ``micro_batch_size * data_parallel_size`` samples; this rank gets its
    slice. ``consumed_samples`` is the data position to checkpoint; a stream made with it yields
    exactly what the interrupted one would have.
    """

    dataset: object
    micro_batch_size: int
    data_parallel_rank: int
    data_parallel_size: int
    consumed_samples: int = 0
    seed: int = 0
    device: Optional[torch.device] = None

    def __post_init__(self):
        if len(self.dataset) == 0:
            raise ValueError("cannot iterate an empty dataset")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data-parallel rank {self.data_parallel_rank} not in "
                             f"[0, {self.data_parallel_size})")
        if self.micro_batch_size < 1 or self.consumed_samples < 0:
            raise ValueError("micro_batch_size must be >= 1 and consumed_samples >= 0")
        self._perm_epoch, self._perm = -1, None

    def _item(self, g: int) -> int:
        n = len(self.dataset)
        epoch, pos = divmod(g, n)
        if epoch == 0:
            return pos
        if epoch != self._perm_epoch:
            self._perm = np.random.RandomState((self.seed + epoch) % 2**32).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[pos])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        start = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        samples = [self.dataset[self._item(g)] for g in range(start, start + self.micro_batch_size)]
        self.consumed_samples += self.micro_batch_size * self.data_parallel_size
        batch = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            t = torch.stack([torch.as_tensor(s[key]) for s in samples])
            batch[key] = t.to(self.device) if self.device is not None else t
        batch["attention_mask"] = None  # causal: the attention kernel builds the mask
        return batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed}


def make_batch_iterator(
    dataset,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
    seed: int = 0,
    device: Optional[torch.device] = None,
) -> BatchIterator:
    """A resumable micro-batch stream (see ``BatchIterator``) for one data-parallel rank."""
    return BatchIterator(dataset, int(micro_batch_size), int(data_parallel_rank),
                         int(data_parallel_size), int(consumed_samples), int(seed), device)
