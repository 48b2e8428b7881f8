"""The package's test suite: where a test goes, and the fixtures several test files share.

Layout (tests/ mirrors megatron_scalevec/):

* ``tests/test_<module>.py``: a top-level module (config, vectors, norms, ops, optim, sharding,
  specs, invariance, megatron_lm), and what concerns the repository as a whole: packaging, the
  docs' recipes and code anchors, import rules, tools/te_check.py, the forked-rank test runner;
* ``tests/layers/``, ``tests/convert/``, ``tests/training/``, ``tests/compat/``: the subpackage
  of that name (training also holds the end-to-end runs of pretrain_gpt.py and the launchers);
* ``tests/parity/``: the same model gives the same losses and gradients in different layouts or
  code paths (parallel layouts, overlapped parameter gathers, activation recompute, the step map
  against the per-micro-batch path).

Every directory is a package (an empty ``__init__.py``), so two test files may share a basename in
different directories under pytest's default import mode; a new directory needs one too.

Sharing: a test file never imports another test module, this file included
(tests/test_import_cycles.py checks it). Fixtures go here; functions that several files call
(often inside forked ranks) go to scalevec_testing/, which tools and benchmarks use as well. The
repository root's conftest.py sets up the CPU layer and the per-test time budget for every suite.
"""

import os

import pytest


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """A 200 KB slice of the embedded corpus (JSONL), built once per session."""
    from megatron_scalevec.training import data

    cache = str(tmp_path_factory.mktemp("small_corpus"))
    return data.embedded_corpus(cache, max_bytes=200_000, chunk_bytes=4096)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory, small_corpus):
    """A SentencePiece model (vocabulary 600) trained on :func:`small_corpus`."""
    from megatron_scalevec.training import data

    return data.train_tokenizer(small_corpus, os.path.join(tmp_path_factory.mktemp("tok"), "spm"),
                                vocab_size=600)
