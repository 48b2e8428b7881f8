"""Reading and writing full-tensor state dicts safely.

The exchange format between converters is a *full state dict*: parameter name -> the whole
(unsharded) tensor, with megatron-core names at TP=PP=1 (as Megatron-LM's checkpoint tools
exchange them). On one process at TP=PP=1 that is ``model.state_dict()`` without
``_extra_state``; dist checkpoints saved at any TP/PP/EP are read into such a model by
megatron-core's resharding load, and a checkpoint saved from it loads at any layout.

Safety rules: nothing here unpickles code. Weights are read with safetensors;
dist checkpoints inside ``safe_load.no_code_on_load`` (the one code-free loader). Output goes
to a temporary sibling directory that is renamed into place only when everything was written,
so a failed conversion leaves no output directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from typing import Optional

import torch

from megatron_scalevec.convert.arch import ARCH_FILE, ModelArch
from megatron_scalevec.convert.safe_load import no_code_on_load

StateDict = dict[str, torch.Tensor]
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.model"  # a SentencePiece model travelling with the weights


def copy_files(files: Optional[dict], directory: str) -> None:
    """Copy ``{name: source path}`` into ``directory`` (e.g. the tokenizer)."""
    for name, src in (files or {}).items():
        shutil.copyfile(src, os.path.join(directory, name))


def publishable(directory: str) -> None:
    """Give a finished output the permissions of a normal directory (``mkdtemp`` makes it
    0700): dirs 0777 and files 0666, both minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~umask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~umask)


def require(package: str, extra: str = "convert"):
    """Import an optional dependency or explain how to get it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(
            f"this conversion needs the optional package {package!r} ({e}): "
            f"pip install 'megatron_scalevec[{extra}]' (or pip install {package})") from e


def progress(items: Iterable, total: Optional[int] = None, desc: str = "tensors",
             enabled: bool = True):
    """A progress bar over tensors on a terminal (tqdm when installed, else a line every 10%);
    nothing when stderr is a file or pipe, where a bar's carriage returns would leave its
    last state on the line of whatever is printed next (the CLI's JSON report)."""
    if not enabled or not sys.stderr.isatty():
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc=desc, file=sys.stderr, leave=False)
        return
    step = max(1, (total or 0) // 10)
    for i, item in enumerate(items):
        if total and (i + 1) % step == 0:
            print(f"{desc}: {i + 1}/{total}", file=sys.stderr)
        yield item


def full_state_dict(model) -> StateDict:
    """name -> full tensor of a model built at TP=PP=1 (``_extra_state`` dropped)."""
    from megatron.core import parallel_state

    if (parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1
            or parallel_state.get_expert_model_parallel_world_size() != 1):
        raise RuntimeError("full_state_dict needs a model built at TP=PP=EP=1; load a sharded "
                           "checkpoint with load_dist() in one process instead")
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not k.endswith("_extra_state") and v is not None}


def load_full_into(model, sd: StateDict, what: str = "state dict") -> None:
    """Copy a full state dict into a TP=PP=1 model; every name and shape must match."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    check_names_and_shapes(sd, {k: tuple(v.shape) for k, v in own.items()}, what)
    model.load_state_dict({**model.state_dict(), **sd}, strict=True)


def check_names_and_shapes(sd: StateDict, expected: dict[str, tuple], what: str) -> None:
    """Raise naming every missing, unexpected and mis-shaped tensor (nothing is skipped)."""
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = sorted(f"{k}: {tuple(sd[k].shape)} != {expected[k]}" for k in set(sd) & set(expected)
                    if tuple(sd[k].shape) != tuple(expected[k]))
    if missing or unexpected or shapes:
        raise ValueError(f"{what} does not match the target model: missing={missing[:8]} "
                         f"(+{max(0, len(missing) - 8)}), unexpected={unexpected[:8]} "
                         f"(+{max(0, len(unexpected) - 8)}), shape mismatches={shapes[:8]}")


@contextlib.contextmanager
def atomic_output_dir(path: str, overwrite: bool = False):
    """Yield a temporary directory beside ``path``; rename it to ``path`` on success.

    On any exception the temporary directory is removed and ``path`` is left untouched
    (absent if it did not exist)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"output {path} exists; pass overwrite=True / --overwrite")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        yield tmp
        publishable(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_safetensors(sd: StateDict, path: str, metadata: Optional[dict] = None,
                     show_progress: bool = True, dtype: Optional[torch.dtype] = None) -> None:
    st = require("safetensors.torch")
    out = {}
    for k in progress(sorted(sd), len(sd), "writing", show_progress):
        t = sd[k].detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[k] = t.contiguous().cpu()
    st.save_file(out, path, metadata=metadata)


def load_safetensors(path: str) -> StateDict:
    """Tensors from one ``.safetensors`` file or a directory of them (HF shards)."""
    require("safetensors")
    files = [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {path}")
    sd: StateDict = {}
    for file in files:
        with safe_open_checked(file) as f:
            for k in f.keys():
                if k in sd:
                    raise ValueError(f"tensor {k!r} appears in two shards")
                sd[k] = f.get_tensor(k)
    return sd


def safe_open_checked(file: str):
    """``safetensors.safe_open`` whose failure (a truncated or corrupt file) is one
    ValueError naming the file instead of safetensors' own error."""
    st = require("safetensors")
    try:
        return st.safe_open(file, framework="pt")
    except st.SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def save_full(sd: StateDict, arch: ModelArch, out_dir: str, overwrite: bool = False,
              show_progress: bool = True, files: Optional[dict] = None) -> None:
    """Our full format: ``scalevec_arch.json`` + ``model.safetensors`` (+ ``files``)."""
    with atomic_output_dir(out_dir, overwrite) as tmp:
        arch.save(tmp)
        copy_files(files, tmp)
        save_safetensors(sd, os.path.join(tmp, WEIGHTS_FILE), {"format": "pt"},
                         show_progress)


def load_full(in_dir: str):
    """(state dict, arch) of a directory written by :func:`save_full`."""
    return load_safetensors(os.path.join(in_dir, WEIGHTS_FILE)), ModelArch.load(in_dir)


# ---- dist_checkpointing (any TP/PP/EP) ---------------------------------------------------
def load_sharded(sharded: dict, ckpt_dir: str) -> dict:
    """``dist_checkpointing.load`` of model tensors only, with no code unpickled: the DCP
    metadata through the data-only unpickler, ``torch.load`` weights-only, and the common
    state (Megatron-LM pickles its args there; our trainer its counters) never read."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    from megatron_scalevec.compat.mcore import load_tensors_only

    with no_code_on_load():
        strategy = get_default_load_sharded_strategy(ckpt_dir)
        return load_tensors_only(sharded, ckpt_dir, strategy)


def model_sharded_state_dict(model) -> dict:
    """The model's sharded tensors without ``_extra_state`` (never needed for weights)."""
    return {k: v for k, v in model.sharded_state_dict().items()
            if not k.endswith("_extra_state")}


def load_dist(ckpt_dir: str, arch: Optional[ModelArch] = None, scalevec: Optional[str] = None):
    """Build ``arch`` at the current layout and load a dist checkpoint saved at any layout.

    Returns the model. On one process this gives TP=PP=1, so ``full_state_dict(model)`` is
    the checkpoint's full state dict. A Megatron-LM checkpoint keeps the model's tensors under
    its own keys, which this reads directly (its pickled ``args`` are never loaded)."""
    from megatron_scalevec.convert.build import build_model

    arch = arch or ModelArch.load(ckpt_dir)
    model = build_model(arch, scalevec)
    state = load_sharded(model_sharded_state_dict(model), ckpt_dir)
    missing = [k for k in model.state_dict() if not k.endswith("_extra_state")
               and k not in state]
    if missing:
        raise ValueError(f"dist checkpoint {ckpt_dir} lacks {missing[:8]}")
    model.load_state_dict(state, strict=False)
    return model


def save_dist(model, out_dir: str, arch: ModelArch, overwrite: bool = False,
              files: Optional[dict] = None) -> None:
    """Save a model (built at any layout, on every rank) as a layout-free dist checkpoint.
    One process: the atomic-rename rule applies. Several ranks: rank 0 publishes."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    sharded = model_sharded_state_dict(model)
    if dist.get_world_size() == 1:
        with atomic_output_dir(out_dir, overwrite) as tmp:
            dist_checkpointing.save(sharded, tmp)
            arch.save(tmp)
            copy_files(files, tmp)
        return
    tmp = out_dir + ".tmp-dist"
    if dist.get_rank() == 0:
        if os.path.exists(out_dir) and not overwrite:
            raise FileExistsError(f"output {out_dir} exists")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(sharded, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        arch.save(tmp)
        copy_files(files, tmp)
        publishable(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    dist.barrier()


def resolve_checkpoint(path: str) -> str:
    """A save directory -> the iteration folder it points to: the trainer's ``latest`` or
    Megatron-LM's ``latest_checkpointed_iteration.txt`` (convert/megatron_lm.py); else
    ``path``."""
    from megatron_scalevec.convert.megatron_lm import resolve_save_dir  # noqa: PLC0415

    pointer = os.path.join(path, "latest")
    if not os.path.isfile(pointer):
        return resolve_save_dir(path)
    with open(pointer) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{pointer}: corrupt 'latest' pointer {text!r}")
    found = os.path.join(path, f"iter_{int(text):07d}")
    if not os.path.isdir(found):
        raise FileNotFoundError(f"{pointer} names iteration {int(text)} but {found} is missing")
    return found


def verify_checkpoint_files(path: str, hashes: bool = True) -> None:
    """Check ``path`` against its checksum manifest (written by the trainer,
    ``training/ckpt_guard.py``) before reading it; a checkpoint without one passes.
    ``hashes=False``: sizes only (``--no-verify-checkpoint``)."""
    from megatron_scalevec.training.ckpt_guard import verify_checkpoint  # noqa: PLC0415

    try:
        verify_checkpoint(path, hashes=hashes)
    except RuntimeError as e:  # ckpt_guard.CheckpointError: one line naming the file
        raise ValueError(str(e)) from None


def is_dist_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json"))


def is_full_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, WEIGHTS_FILE)) and \
        os.path.isfile(os.path.join(path, ARCH_FILE))
