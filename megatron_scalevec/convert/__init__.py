"""Checkpoint conversion: baseline <-> scale-vector variants, exact folding, Hugging Face.

One module per direction, all exchanging *full state dicts* (name -> whole tensor, stock
megatron-core names at TP=PP=1):

* :mod:`.arch` -- :class:`ModelArch`, what it takes to rebuild a model; building helpers.
* :mod:`.io` -- safe reading/writing (safetensors, dist checkpoints at any layout, atomic
  output directories, progress bar).
* :mod:`.warmstart` -- stock/shared -> any variant (function-preserving; DNP on request).
* :mod:`.fold` -- any variant without DNP on V/gate/up -> stock megatron-core (exact).
* :mod:`.hf` -- stock <-> Hugging Face Llama / Qwen3 / Mixtral / Qwen3-MoE (transformers is
  an optional extra).
* :mod:`.hf_remote` -- export of every strategy: a stock family where one fits, else (DNP,
  dense or MoE; MoE layouts with no stock family) our own modeling file
  (:mod:`.hf_modeling`, copied into the export); measured on the export.
* :mod:`.hf_tokenizer` -- the SentencePiece tokenizer as ``tokenizer.json`` for AutoTokenizer.

``tools/convert_checkpoint.py`` is the command line over these.
"""

import importlib

# Imported on first use (PEP 562): ``convert_checkpoint.py --help`` and the trainer's flag
# parsing read ``convert.arch`` without importing megatron-core (and its Apex/TE warnings).
_LAZY = {"ModelArch": "arch", "build_model": "arch", "fold_state_dict": "fold",
         "fold_to_stock": "fold", "FunctionChangeError": "warmstart", "warm_start": "warmstart"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
