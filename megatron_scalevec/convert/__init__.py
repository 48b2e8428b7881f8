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

from megatron_scalevec.convert.arch import ModelArch, build_model
from megatron_scalevec.convert.fold import fold_state_dict, fold_to_stock
from megatron_scalevec.convert.warmstart import FunctionChangeError, warm_start

__all__ = ["FunctionChangeError", "ModelArch", "build_model", "fold_state_dict",
           "fold_to_stock", "warm_start"]
