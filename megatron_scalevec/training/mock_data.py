"""megatron-core's MockGPTDataset behind the ``training/data.py`` API.

Used by ``--mock-data`` and whenever ``training/data.py`` is absent. The samples are
megatron's synthetic ramps (``1, 2, 3, ... % vocab``), so a model learns them fast: good for
tests and smoke runs, meaningless as a language.
"""

from __future__ import annotations

import logging

import numpy as np
import torch


class _Tokenizer:
    """The few attributes megatron's dataset builder reads from a tokenizer.

    No ``pad``: megatron-core 0.16.1's GPTDataset then uses -1, which never occurs. With a pad id
    that occurs in the labels, its cached loss mask is zeroed *in place* at the first sample's
    pad positions and every later sample inherits them (masks depend on fetch history, so a
    resumed run would see different masks).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.unique_identifiers = {"class": "MockTokenizer", "vocab_size": vocab_size}


def build_datasets(data_path, tokenizer_model, seq_length, seed, train_samples, valid_samples,
                   split="98,2,0", cache_dir=None, vocab_size=512):
    from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: PLC0415
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa

    tok = _Tokenizer(vocab_size)
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, split=split,
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, tokenizer=tok, create_attention_mask=False,
                           path_to_cache=cache_dir)
    # Synthetic samples have nothing worth caching: without a cache dir megatron-core warns once
    # per split that it cannot save their indexes (3 lines every run); that line only is dropped.
    log = logging.getLogger("megatron.core.datasets.gpt_dataset")
    log.addFilter(_no_cache_note)
    try:
        train, valid, _ = BlendedMegatronDatasetBuilder(
            MockGPTDataset, [train_samples, valid_samples, 0], lambda: True, cfg).build()
    finally:
        log.removeFilter(_no_cache_note)
    return train, valid, tok


def _no_cache_note(record) -> bool:
    return not record.getMessage().startswith("Unable to save MockGPTDataset indexes")


def make_batch_iterator(dataset, micro_batch_size, data_parallel_rank, data_parallel_size,
                        consumed_samples, seed):
    """Endless micro-batches for this DP rank, starting after ``consumed_samples``: global
    batch order is sample index order; rank r takes its slice of each DP-sized chunk."""
    n = len(dataset)
    step = micro_batch_size * data_parallel_size
    start = consumed_samples
    while True:
        first = start + data_parallel_rank * micro_batch_size
        idx = [(first + i) % n for i in range(micro_batch_size)]
        samples = [dataset[i] for i in idx]
        batch = {k: torch.stack([torch.as_tensor(np.asarray(s[k])) for s in samples])
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        yield batch
        start += step
