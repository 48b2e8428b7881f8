"""Text sources and tokenizers for the data pipeline: the embedded standard-library corpus, a
SentencePiece tokenizer in megatron-core's duck type, its training, and atomic file writes.

``data.py`` re-exports everything here; nothing in this file imports megatron.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import sysconfig
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_CORPUS_BYTES",
    "DEFAULT_VOCAB_SIZE",
    "DataPathError",
    "SentencePieceTokenizer",
    "atomic_path",
    "corpus_file",
    "embedded_corpus",
    "sha256_file",
    "train_tokenizer",
]

DEFAULT_CACHE_DIR = "~/.cache/megatron_scalevec"
DEFAULT_CORPUS_BYTES = 12_000_000  # below a whole non-test stdlib (14 MB on 3.11): the cap decides
DEFAULT_CHUNK_BYTES = 32_768  # one document: a file, or a blank-line-bounded piece of a big one
DEFAULT_VOCAB_SIZE = 4096
_CORPUS_FORMAT = "v1"
_SKIP_DIRS = {"site-packages", "dist-packages", "lib-dynload", "__pycache__", "test", "tests",
              "idle_test", "encodings"}  # tests hold odd data, encodings are code tables


class DataPathError(ValueError):
    """A data path (indexed dataset prefix or input file) is missing, corrupt or unusable."""


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary sibling of ``path``; rename it onto ``path`` only if the block succeeds."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- tokenizer
class SentencePieceTokenizer:
    """A SentencePiece model with the duck type megatron-core's GPT datasets read.

    ``GPTDatasetConfig`` uses ``vocab_size`` (token dtype), ``eod`` (masks, EOD loss), ``pad`` and
    ``eos`` (pad-collision check) and ``unique_identifiers`` (its index-cache hash: here the
    model's content hash, so the cache follows the model, not its path). EOD is the model's EOS.
    """

    def __init__(self, model_path: str):
        import sentencepiece as spm

        self.model_path = os.path.abspath(os.path.expanduser(model_path))
        if not os.path.isfile(self.model_path):
            raise DataPathError(f"tokenizer model {self.model_path!r} does not exist")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.model_path)
        except Exception as err:
            raise DataPathError(
                f"tokenizer model {self.model_path!r} is not a SentencePiece model: {err}"
            ) from err
        if self._sp.eos_id() < 0:
            raise DataPathError(f"tokenizer model {self.model_path!r} has no EOS piece for EOD")
        self.model_sha256 = sha256_file(self.model_path)
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("model_sha256", self.model_sha256),
             ("vocab_size", self.vocab_size)]
        )
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        self._vocab = None

    def __reduce__(self):  # workers re-load the model from its path
        return (type(self), (self.model_path,))

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()  # -1 when the model has none: megatron's own "no pad" value

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    @property
    def vocab(self) -> dict:
        if self._vocab is None:
            self._vocab = {self._sp.IdToPiece(i): i for i in range(self.vocab_size)}
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return {i: piece for piece, i in self.vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """Encode many texts at once on ``num_threads`` threads (-1: all cores)."""
        return self._sp.Encode(list(texts), out_type=int, num_threads=num_threads)

    def detokenize(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])


# ----------------------------------------------------------------------------- embedded corpus
def _stdlib_files(root: Path) -> list[Path]:
    """The standard library's .py/.txt files in a machine-independent order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:  # _sysconfigdata*: build-machine specific
            if name.endswith((".py", ".txt")) and not name.startswith("_sysconfigdata"):
                out.append(rel_dir / name)
    return sorted(out, key=lambda p: p.as_posix())


def _chunks(text: str, chunk_bytes: int) -> Iterator[str]:
    """Split at blank lines once a piece reaches ``chunk_bytes`` (hard stop at 4x); lossless."""
    piece, size = [], 0
    for line in text.splitlines(keepends=True):
        piece.append(line)
        size += len(line)
        if (size >= chunk_bytes and not line.strip()) or size >= 4 * chunk_bytes:
            yield "".join(piece)
            piece, size = [], 0
    if piece:
        yield "".join(piece)


def corpus_file(cache_dir: str = DEFAULT_CACHE_DIR, max_bytes: int = DEFAULT_CORPUS_BYTES,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> str:
    """Where :func:`embedded_corpus` caches the corpus of these sizes (built or not)."""
    return str(Path(os.path.expanduser(cache_dir)) / "corpus" / (
        f"python-{platform.python_version()}-stdlib-{max_bytes}-{chunk_bytes}-"
        f"{_CORPUS_FORMAT}.jsonl"))


def embedded_corpus(
    cache_dir: str = DEFAULT_CACHE_DIR,
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> str:
    """Write (once) and return the JSONL corpus made from this Python's standard library.

    Records are ``{"text", "source", "part"}``; files are read in sorted path order and
    documents are added until the next one would pass ``max_bytes`` of UTF-8 text. Cached by
    Python version and sizes.
    """
    out = Path(corpus_file(cache_dir, max_bytes, chunk_bytes))
    if out.is_file():
        return str(out)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root) if root.is_dir() else []
    if not files:
        raise DataPathError(f"no standard-library sources under {str(root)!r} for the corpus")
    total, count = 0, 0
    with atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for rel in files:
            try:
                text = (root / rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            full = False
            for part, chunk in enumerate(_chunks(text, chunk_bytes)):
                size = len(chunk.encode("utf-8"))
                full = total + size > max_bytes
                if full:
                    break
                if chunk.strip():
                    rec = {"text": chunk, "source": rel.as_posix(), "part": part}
                    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    total, count = total + size, count + 1
            if full:
                break
        f.close()
        if count == 0:
            raise DataPathError(f"max_bytes={max_bytes} leaves the embedded corpus empty")
    return str(out)


# ----------------------------------------------------------------------------- tokenizer training
def _lines_of(corpus_jsonl: str, json_key: str) -> Iterator[str]:
    with open(corpus_jsonl, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (ValueError, KeyError, TypeError) as err:
                raise DataPathError(f"{corpus_jsonl}:{n}: no JSON string {json_key!r}") from err
            for sub in text.split("\n"):
                if sub.strip():
                    yield sub


def train_tokenizer(
    corpus_jsonl: str,
    out_prefix: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    json_key: str = "text",
    max_sentences: int = 2_000_000,
    seed: int = 1234,
) -> str:
    """Train (or reuse) a SentencePiece model on a JSONL corpus; return ``<out_prefix>.model``.

    Lossless for code: identity normalization, no whitespace folding or dummy prefix, byte
    fallback, and ``\\n``/``\\t`` as pieces (training reads lines). Ids: pad 0, unk 1, bos 2,
    eos = EOD 3. Reused when ``<out_prefix>.meta.json`` records the same corpus hash and options;
    the model is renamed into place before the meta file, which marks it complete.
    """
    import sentencepiece as spm

    if not os.path.isfile(corpus_jsonl):
        raise DataPathError(f"tokenizer corpus {corpus_jsonl!r} does not exist")
    options = dict(vocab_size=int(vocab_size), model_type=model_type, json_key=json_key,
                   max_sentences=int(max_sentences), seed=int(seed), version=1)
    key = hashlib.sha256(
        (sha256_file(corpus_jsonl) + json.dumps(options, sort_keys=True)).encode()
    ).hexdigest()
    model_path, meta_path = f"{out_prefix}.model", f"{out_prefix}.meta.json"
    if os.path.isfile(model_path) and os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            if json.load(f).get("key") == key:
                return model_path
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(int(seed))
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines_of(corpus_jsonl, json_key), model_writer=buf,
            vocab_size=int(vocab_size), model_type=model_type, character_coverage=1.0,
            byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True,
            user_defined_symbols=["\n", "\t"], pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            input_sentence_size=int(max_sentences), shuffle_input_sentence=True,
            max_sentence_length=16384, num_threads=max(1, min(8, os.cpu_count() or 1)),
            minloglevel=2,
        )
    except RuntimeError as err:
        raise DataPathError(f"SentencePiece training on {corpus_jsonl!r} failed: {err}") from err
    with atomic_path(model_path) as tmp:
        Path(tmp).write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_file=model_path)
    with atomic_path(f"{out_prefix}.vocab") as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for i in range(sp.GetPieceSize()):
                f.write(f"{sp.IdToPiece(i)}\t{sp.GetScore(i)}\n")
    with atomic_path(meta_path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "corpus": os.path.abspath(corpus_jsonl), **options}, f)
    return model_path


