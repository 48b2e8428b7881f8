"""Data pipeline: embedded corpus, tokenizer, preprocess CLI, megatron datasets, batch stream."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_scalevec.training import data
from megatron_scalevec.training.data import DataPathError
from megatron_scalevec.training.preprocess import main as preprocess_main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = dict(max_bytes=400_000, chunk_bytes=4096)
VOCAB = 600


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def corpus(cache):
    return data.embedded_corpus(cache, **TINY)


@pytest.fixture(scope="module")
def tok_model(cache, corpus):
    return data.train_tokenizer(corpus, os.path.join(cache, "tok", "spm"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tok(tok_model):
    return data.SentencePieceTokenizer(tok_model)


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_embedded_corpus_is_built_once_from_the_stdlib(cache, corpus):
    recs = _records(corpus)
    assert len(recs) > 50
    assert sum(len(r["text"].encode()) for r in recs) <= TINY["max_bytes"]
    sources = [r["source"] for r in recs]
    assert sources == sorted(sources) and all(s.endswith((".py", ".txt")) for s in sources)
    assert any("def " in r["text"] for r in recs)
    mtime = os.stat(corpus).st_mtime_ns
    assert data.embedded_corpus(cache, **TINY) == corpus
    assert os.stat(corpus).st_mtime_ns == mtime  # cached, not rewritten
    assert not [n for n in os.listdir(os.path.dirname(corpus)) if ".tmp-" in n]


def test_tokenizer_round_trips_and_is_cached(corpus, tok_model, tok):
    assert tok.vocab_size == VOCAB
    assert (tok.pad, tok.bos, tok.eos, tok.eod) == (0, 2, 3, 3)
    assert tok.unique_identifiers["model_sha256"] == tok.model_sha256
    for rec in _records(corpus)[:40]:
        ids = tok.tokenize(rec["text"])
        assert max(ids) < VOCAB and tok.eod not in ids
        assert tok.detokenize(ids) == rec["text"]
    odd = "  x = 1\n\n\tif y:\t# é 中文 \U0001f600\r\n    return  'a'  \n"
    assert tok.detokenize(tok.tokenize(odd)) == odd
    assert pickle.loads(pickle.dumps(tok)).tokenize(odd) == tok.tokenize(odd)
    mtime = os.stat(tok_model).st_mtime_ns
    prefix = tok_model[: -len(".model")]
    assert data.train_tokenizer(corpus, prefix, vocab_size=VOCAB) == tok_model
    assert os.stat(tok_model).st_mtime_ns == mtime


def _write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


def _read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]


def test_preprocess_jsonl_and_text(tmp_path, tok_model, tok, capsys, monkeypatch):
    texts = ["def f(x):\n    return x + 1\n", "", "print('hello')\n", "class A:\n\tpass\n"]
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": t, "title": f"doc {i}"} for i, t in enumerate(texts)])
    out = str(tmp_path / "out" / "corpus")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the textual progress fallback
    rc = preprocess_main(["--input", str(src), "--output-prefix", out, "--tokenizer-model",
                          tok_model, "--json-keys", "text", "title", "--append-eod",
                          "--log-interval", "1", "--workers", "1"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "tokenizing: 4 docs" in err and "(100%)" in err
    docs = _read_docs(out + "_text_document")
    nonempty = [t for t in texts if t]
    assert len(docs) == len(nonempty)  # the empty document is skipped
    for ids, text in zip(docs, nonempty):
        assert ids[-1] == tok.eod and (ids == tok.eod).sum() == 1
        assert tok.detokenize(ids[:-1]) == text
    assert len(_read_docs(out + "_title_document")) == len(texts)
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp-" in n]

    lines = tmp_path / "in.txt"
    lines.write_text("first line\n\nsecond line\nthird\n", encoding="utf-8")
    for workers in ("1", "2"):
        rc = preprocess_main(["--input", str(lines), "--output-prefix", out + workers,
                              "--tokenizer-model", tok_model, "--workers", workers,
                              "--no-progress"])
        assert rc == 0
    one, two = _read_docs(out + "1_text_document"), _read_docs(out + "2_text_document")
    assert [tok.detokenize(d) for d in one] == ["first line", "second line", "third"]
    assert all((a == b).all() for a, b in zip(one, two)) and len(one) == len(two)


def test_build_line_before_the_corpus_and_tokenizer_build(tmp_path):
    said = []
    data.embedded_dataset(str(tmp_path), vocab_size=VOCAB, corpus_max_bytes=TINY["max_bytes"],
                          chunk_bytes=TINY["chunk_bytes"], log=said.append)
    assert len(said) == 1 and "building the embedded corpus" in said[0], said


def test_preprocess_refuses_to_overwrite_unless_asked(tmp_path, tok_model, capsys):
    """An existing .bin/.idx is kept (one line, exit 2) unless --overwrite; megatron-core's
    "not installed" warnings are one line."""
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": "def f(x):\n    return x\n"}])
    out = str(tmp_path / "out")
    argv = ["--input", str(src), "--output-prefix", out, "--tokenizer-model", tok_model,
            "--no-progress"]
    assert preprocess_main(argv) == 0
    capsys.readouterr()
    before = {n: os.path.getmtime(tmp_path / n) for n in os.listdir(tmp_path)}
    assert preprocess_main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"error: {out}_text_document.bin exists: pass "
                                             f"--overwrite to replace it, or another "
                                             f"--output-prefix"), err
    assert {n: os.path.getmtime(tmp_path / n) for n in os.listdir(tmp_path)} == before
    assert preprocess_main(argv + ["--overwrite"]) == 0


def test_preprocess_folds_the_backend_warnings(tmp_path, tok_model):
    src = tmp_path / "in.jsonl"
    _write_jsonl(src, [{"text": "x = 1\n"}])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                        "--input", str(src), "--output-prefix", str(tmp_path / "o"),
                        "--tokenizer-model", tok_model, "--no-progress"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr and len(p.stderr.strip().splitlines()) <= 1, p.stderr


def test_example_data_refuses_an_existing_output(tmp_path, capsys):
    from megatron_scalevec.training.example_data import main

    (tmp_path / "corpus.jsonl").write_text("mine\n")
    assert main(["--corpus", str(tmp_path / "corpus.jsonl"), "--cache-dir",
                 str(tmp_path / "cache")]) == 2
    assert "corpus.jsonl exists: pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "corpus.jsonl").read_text() == "mine\n"
    assert not (tmp_path / "cache").exists()


def test_preprocess_failure_leaves_no_output(tmp_path, tok_model, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"txt": "no key"}\n', encoding="utf-8")
    out = str(tmp_path / "bad")
    rc = preprocess_main(["--input", str(src), "--output-prefix", out, "--tokenizer-model",
                          tok_model, "--append-eod", "--no-progress"])
    assert rc == 2
    assert f"{src}:2" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["bad.jsonl"]


@pytest.fixture(scope="module")
def prefix(cache, corpus, tok_model):
    from megatron_scalevec.training.preprocess import preprocess

    stats = preprocess([corpus], os.path.join(cache, "user", "c"), tok_model, progress=False)
    return stats["text"]["prefix"]


def test_build_datasets_from_a_data_path(cache, prefix, tok_model, tok):
    n_docs = data.check_indexed_dataset(prefix)
    assert n_docs == len(_records(data.embedded_corpus(cache, **TINY)))
    train, valid, got_tok = data.build_datasets([prefix], tok_model, 32, 7, 200, 20,
                                                split="90,10,0", cache_dir=cache)
    assert got_tok.model_sha256 == tok.model_sha256
    assert len(train) >= 200 and len(valid) >= 20
    item = train[0]
    assert item["tokens"].shape == item["labels"].shape == (32,)
    assert item["loss_mask"].shape == item["position_ids"].shape == (32,)
    assert torch.equal(item["tokens"][1:], item["labels"][:-1])
    assert not set(train.indices) & set(valid.indices)  # held-out documents
    blend, _, _ = data.build_datasets(["0.3", prefix, "0.7", prefix], tok_model, 32, 7, 100, 10,
                                      split="90,10,0", cache_dir=cache)
    assert len(blend) >= 100 and blend[3]["tokens"].shape == (32,)


def test_build_datasets_embedded_default_is_cached(tmp_path):
    kw = dict(vocab_size=VOCAB, corpus_max_bytes=TINY["max_bytes"],
              chunk_bytes=TINY["chunk_bytes"])
    train, valid, tok = data.build_datasets(None, None, 64, 3, 50, 10, cache_dir=str(tmp_path),
                                            **kw)
    assert tok.vocab_size == VOCAB and len(train) >= 50 and len(valid) >= 10
    assert train[1]["tokens"].shape == (64,) and int(train[1]["tokens"].max()) < VOCAB
    files = {os.path.join(r, f): os.stat(os.path.join(r, f)).st_mtime_ns
             for r, _, fs in os.walk(tmp_path) for f in fs}
    assert {"corpus", "tokenizer", "data"} <= set(os.listdir(tmp_path))
    assert list(tmp_path.glob("*-GPTDataset-train-*.npy"))  # the index cache, as Megatron-LM's
    said = []  # the one line before a build, none when everything is cached
    again, _, _ = data.build_datasets(None, None, 64, 3, 50, 10, cache_dir=str(tmp_path),
                                      log=said.append, **kw)
    assert said == []
    assert torch.equal(again[5]["tokens"], train[5]["tokens"])
    assert {os.path.join(r, f): os.stat(os.path.join(r, f)).st_mtime_ns
            for r, _, fs in os.walk(tmp_path) for f in fs} == files


class _Toy(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        t = torch.full((4,), i)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(4),
                "position_ids": torch.arange(4)}


def _ids(batches):
    return [b["tokens"][:, 0].tolist() for b in batches]


def test_batch_iterator_resumes_exactly():
    ds = _Toy()
    straight = []
    for r in range(2):
        it = data.make_batch_iterator(ds, 2, r, 2, 0, seed=5)
        straight.append(_ids([next(it) for _ in range(9)]))
    for r in range(2):
        it = data.make_batch_iterator(ds, 2, r, 2, 0, seed=5)
        first = _ids([next(it) for _ in range(4)])
        assert it.consumed_samples == 16
        resumed = data.make_batch_iterator(ds, 2, r, 2, it.consumed_samples, seed=5)
        assert first + _ids([next(resumed) for _ in range(5)]) == straight[r]
    # step k gives rank r the global samples 4k+2r, 4k+2r+1; pass 0 in dataset order (megatron's
    # GPTDataset is already shuffled), later passes reshuffled by the seed
    flat = [x for step in range(9) for r in range(2) for x in straight[r][step]]
    assert flat[:10] == list(range(10))
    assert sorted(flat[10:20]) == list(range(10)) and flat[10:20] != list(range(10))
    one = data.make_batch_iterator(ds, 4, 0, 1, 0, seed=5)  # DP=1, same samples per step
    assert [x for _ in range(9) for x in _ids([next(one)])[0]] == flat
    batch = next(data.make_batch_iterator(ds, 3, 0, 1))
    assert batch["attention_mask"] is None and batch["tokens"].shape == (3, 4)
    assert batch["loss_mask"].dtype == torch.float32
    with pytest.raises(ValueError, match="rank"):
        data.make_batch_iterator(ds, 2, 2, 2)


def test_bad_data_paths_name_the_path(tmp_path, prefix, tok_model):
    missing = str(tmp_path / "nope")
    with pytest.raises(DataPathError, match="nope"):
        data.build_datasets([missing], tok_model, 32, 1, 10, 1, cache_dir=str(tmp_path))
    with pytest.raises(DataPathError, match="without .bin"):
        data.check_indexed_dataset(prefix + ".bin")
    bad = str(tmp_path / "bad")
    with open(prefix + ".bin", "rb") as f:
        payload = f.read()
    with open(bad + ".bin", "wb") as f:
        f.write(payload)
    with open(bad + ".idx", "wb") as f:
        f.write(b"garbage, not an index")
    with pytest.raises(DataPathError, match="unreadable index .*bad.idx"):
        data.build_datasets([bad], tok_model, 32, 1, 10, 1, cache_dir=str(tmp_path))
    with open(prefix + ".idx", "rb") as f:
        index = f.read()
    with open(bad + ".idx", "wb") as f:
        f.write(index)
    with open(bad + ".bin", "wb") as f:
        f.write(payload[: len(payload) // 2])
    with pytest.raises(DataPathError, match=r"bad.bin has .*\(truncated"):
        data.check_indexed_dataset(bad)
    with pytest.raises(DataPathError, match="tokenizer model .*missing.model"):
        data.build_datasets([prefix], str(tmp_path / "missing.model"), 32, 1, 10, 1,
                            cache_dir=str(tmp_path))
    with pytest.raises(DataPathError, match="needs --tokenizer-model"):
        data.build_datasets([prefix], None, 32, 1, 10, 1, cache_dir=str(tmp_path))
    with pytest.raises(DataPathError, match="valid split has 0 documents"):
        data.build_datasets([prefix], tok_model, 32, 1, 10, 5, split="999,1,0",
                            cache_dir=str(tmp_path))


def _build_on_rank(rank, world_size, cache_dir, kw, env=None):
    from megatron_scalevec.training import preprocess

    os.environ.update((env or {}).get(rank, {}))
    calls = []
    real = preprocess.preprocess  # the corpus tokenized: what building the data means
    preprocess.preprocess = lambda *a, **k: calls.append(rank) or real(*a, **k)
    train, valid, tok = data.build_datasets(None, None, 32, 11, 40, 8, cache_dir=cache_dir, **kw)
    it = data.make_batch_iterator(train, 2, rank, world_size, 0, 11)
    return len(calls), len(train), len(valid), train[7]["tokens"].tolist(), next(it)["tokens"]


def test_build_datasets_on_two_gloo_ranks(tmp_path):
    from scalevec_testing.distributed import run_on_ranks

    kw = dict(vocab_size=VOCAB, corpus_max_bytes=200_000, chunk_bytes=4096)
    out = run_on_ranks(_build_on_rank, 2, str(tmp_path), kw, timeout=120)
    assert [o[0] for o in out] == [1, 0]  # only rank 0 built the embedded cache
    assert out[0][1:4] == out[1][1:4]  # the others read the same datasets
    assert not torch.equal(out[0][4], out[1][4])  # each rank its own slice of the batch


def test_nodes_without_a_shared_home_build_their_own_copy(tmp_path):
    """Two "nodes" (each rank LOCAL_RANK 0, as torchrun sets it on one node each) whose HOMEs
    differ: each builds the embedded default and its index cache in its own home (none given:
    the default cache, ~/.cache/megatron_scalevec) and both read the same datasets; nodes
    whose copies came out different (another corpus size here) are refused on every rank."""
    from scalevec_testing.distributed import RankError, run_on_ranks

    kw = dict(vocab_size=VOCAB, corpus_max_bytes=200_000, chunk_bytes=4096)
    env = {r: {"HOME": str(tmp_path / f"home{r}"), "LOCAL_RANK": "0"} for r in (0, 1)}
    out = run_on_ranks(_build_on_rank, 2, None, kw, env, timeout=180)
    assert [o[0] for o in out] == [1, 1]  # one build per node
    assert out[0][1:4] == out[1][1:4]
    for r in (0, 1):
        assert list((tmp_path / f"home{r}").glob(".cache/megatron_scalevec/data/*/cache/*/*.npy"))
    with pytest.raises(RankError, match="nodes built different embedded data"):
        run_on_ranks(_build_with_corpus, 2, env, timeout=180)


def _build_with_corpus(rank, world_size, env):
    os.environ.update(env[rank])
    data.build_datasets(None, None, 32, 11, 40, 8, vocab_size=VOCAB, chunk_bytes=4096,
                        corpus_max_bytes=200_000 + 50_000 * rank)


def _build_with(rank, world_size, cache_dir, tokenizer_model):
    data.build_datasets(None, tokenizer_model, 32, 1, 10, 2, cache_dir=cache_dir)


def test_a_rank0_build_error_reaches_every_rank(tmp_path):
    from scalevec_testing.distributed import RankError, run_on_ranks

    missing = str(tmp_path / "no_such.model")
    with pytest.raises(RankError, match="no_such.model"):  # not a TimeoutError: nobody hangs
        run_on_ranks(_build_with, 2, str(tmp_path), missing, timeout=60)


def test_same_named_datasets_in_two_directories_get_their_own_indices(
        tmp_path, cache, tok_model, monkeypatch):
    """megatron-core's sample-index cache (shared under cache_dir) is keyed by the data path:
    ``--data-path my_text_document`` run in two directories with different corpora must not
    reuse the other's indices (given as relative it did: the smaller corpus then read samples
    past its end)."""
    from megatron_scalevec.training.preprocess import preprocess  # noqa: PLC0415

    docs = {"large": [{"text": "class A:\n    x = [i * i for i in range(99)]\n" * 30}] * 60,
            "small": [{"text": "def f():\n    return 1\n"}] * 40}
    for name, records in docs.items():
        os.makedirs(tmp_path / name)
        monkeypatch.chdir(tmp_path / name)
        _write_jsonl("c.jsonl", records)
        preprocess(["c.jsonl"], "my", tok_model, progress=False)
        train, _, _ = data.build_datasets(["my_text_document"], tok_model, 16, 1, 50, 5,
                                          split="90,10,0", cache_dir=cache)
        for i in range(len(train)):  # every sample read from this directory's own data
            assert train[i]["tokens"].shape == (16,), (name, i)
