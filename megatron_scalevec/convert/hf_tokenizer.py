"""Ship a SentencePiece BPE tokenizer with a Hugging Face export, usable by ``AutoTokenizer``.

transformers 5 tokenizers are ``tokenizers``-backed; converting a ``.model`` file on load
needs protobuf and assumes Llama's normalization. We write the ``tokenizer.json`` ourselves
from the model (vocabulary, merges ranked by the score of the merged piece, byte fallback,
whitespace as ``▁``, no dummy prefix: the options corpus.py trains with), copy the
``tokenizer.model`` beside it, and check that both give the same ids on a sample text before
the export is published. No BOS is added (our training data has none).
"""

from __future__ import annotations

import os
import shutil
import tempfile

SAMPLE = ("def f(x, *args):\n\treturn {'a': [1, 2.5e-3]}  # naïve café — λ→∞ 😀\n"
          "class A(B):\n    \"\"\"Doc.\"\"\"\n\n    pass\r\n")


def _merges(sp, vocab: dict) -> list:
    ranked = []
    for piece, pid in vocab.items():
        if len(piece) < 2 or sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid):
            continue
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                ranked.append((-sp.get_score(pid), vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in ranked]


def write_tokenizer(spm_path: str, out_dir: str) -> dict:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``tokenizer.model``; returns
    the special-token ids. Raises ValueError when the result would tokenize differently."""
    import sentencepiece as spm

    from megatron_scalevec.convert.io import require

    tk = require("tokenizers")  # not installed by '.[plot]': name the extra that brings it
    AddedToken, Tokenizer = tk.AddedToken, tk.Tokenizer
    decoders, models, normalizers = tk.decoders, tk.models, tk.normalizers
    tf = require("transformers")
    AutoTokenizer, PreTrainedTokenizerFast = tf.AutoTokenizer, tf.PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor()
    sp.Load(spm_path)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    unk = sp.id_to_piece(sp.unk_id())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(sp, vocab), unk_token=unk,
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    special = {name: sp.id_to_piece(i) for name, i in
               (("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()),
                ("eos_token", sp.eos_id()), ("pad_token", sp.pad_id())) if i >= 0}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in special.values()])
    # Built and checked alone (a config.json beside it would make AutoTokenizer read it).
    work = tempfile.mkdtemp(prefix=".tokenizer-", dir=out_dir)
    try:
        PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(work)
        shutil.copyfile(spm_path, os.path.join(work, "tokenizer.model"))
        ours = sp.encode(SAMPLE)
        theirs = AutoTokenizer.from_pretrained(work)(SAMPLE, add_special_tokens=False).input_ids
        for name in os.listdir(work):
            os.replace(os.path.join(work, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if list(theirs) != list(ours):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                     min(len(ours), len(theirs)))
        raise ValueError(f"the Hugging Face tokenizer built from {spm_path} differs from "
                         f"SentencePiece at token {first} of the sample text; this model's "
                         f"options are not supported (ship tokenizer.model only)")
    return {k: sp.piece_to_id(v) for k, v in special.items()}
