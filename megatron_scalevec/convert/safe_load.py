"""The one code-free loader: nothing read from a checkpoint can execute code.

Used by the converters (``convert/io.py``), our trainer's loads (``training/checkpointing.py``)
and Megatron-LM's own ``--load`` (installed by ``megatron_lm.install``):

* torch DCP's ``.metadata`` file goes through a data-only unpickler (its dataclasses, torch
  sizes and dtypes; anything else is refused, naming it);
* every ``torch.load`` is forced to ``weights_only=True``, even where the caller passes
  ``weights_only=False`` (torch's DCP planner does so for sharded objects), with the few numpy
  types an old pickled RNG state needs allowed;
* ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` (which would lift torch's own guard) refuses the load.

Imports only torch, pickle and numpy, so every loader can use it without import cycles.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle

import torch

_SAFE_GLOBAL_PREFIXES = ("torch.distributed.checkpoint.", "torch.distributed._shard.",
                         "megatron.core.dist_checkpointing.")
_SAFE_GLOBALS = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
                 ("builtins", "frozenset"), ("builtins", "slice"),
                 ("torch.serialization", "_get_layout")}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, unsafe or made for another model."""


class DataOnlyUnpickler(pickle.Unpickler):
    """Loads the dist-checkpoint metadata file: its dataclasses, torch sizes and dtypes only."""

    def find_class(self, module, name):
        if module.startswith(_SAFE_GLOBAL_PREFIXES) or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint "
                                     f"metadata (only data classes are allowed)")


class SafePickleModule:
    """Stands in for the ``pickle`` module DCP's filesystem reader uses (loads data only)."""

    dump = staticmethod(pickle.dump)
    dumps = staticmethod(pickle.dumps)
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL

    @staticmethod
    def load(f, **_):
        return DataOnlyUnpickler(f).load()

    @staticmethod
    def loads(b, **_):
        return DataOnlyUnpickler(io.BytesIO(b)).load()


def _numpy_rng_globals() -> list:
    """What an old checkpoint's pickled numpy RNG state needs (arrays only, no callables)."""
    import numpy as np  # noqa: PLC0415

    try:
        from numpy._core.multiarray import _reconstruct  # noqa: PLC0415
    except ImportError:
        from numpy.core.multiarray import _reconstruct  # noqa: PLC0415
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


@contextlib.contextmanager
def allowed_globals(globals_: list):
    """``torch.serialization.safe_globals`` that adds only what is not allowed yet: torch's
    context removes every global it names on exit (torch 2.13), those megatron-core registered
    for its own loads at import (``Namespace``, numpy's) included, which then fail."""
    new = [g for g in globals_ if g not in torch.serialization.get_safe_globals()]
    with torch.serialization.safe_globals(new):
        yield


@contextlib.contextmanager
def no_code_on_load():
    """While loading a checkpoint: the DCP ``.metadata`` file through the data-only unpickler
    and every ``torch.load`` with ``weights_only=True`` (even where the caller passes
    ``weights_only=False``)."""
    import torch.distributed.checkpoint.filesystem as fs  # noqa: PLC0415

    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        raise CheckpointError("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: refusing to load a "
                              "checkpoint that could then run pickled code")
    orig_load, orig_pickle = torch.load, fs.pickle

    def weights_only_load(*args, **kwargs):
        kwargs["weights_only"] = True
        return orig_load(*args, **kwargs)

    torch.load, fs.pickle = weights_only_load, SafePickleModule
    try:
        with allowed_globals(_numpy_rng_globals()):
            yield
    finally:
        torch.load, fs.pickle = orig_load, orig_pickle


def install_metadata_guard() -> None:
    """For processes we do not drive (Megatron-LM's own load): DCP's ``.metadata`` is always
    read with the data-only unpickler. Idempotent."""
    import torch.distributed.checkpoint.filesystem as fs  # noqa: PLC0415

    fs.pickle = SafePickleModule
