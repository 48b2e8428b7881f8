"""Trainer <-> converter: what a checkpoint carries for the converter, and starting a run from
converted weights (``--pretrained-checkpoint``, ``--finetune``; Megatron-LM's meaning).

* Every trainer checkpoint gets ``scalevec_arch.json`` (this run's :class:`ModelArch`) and,
  when the run has one, its SentencePiece ``tokenizer.model``, so
  ``convert_checkpoint.py --load <save dir>`` (or ``<save dir>/iter_N``) needs no ``--arch``.
* ``--pretrained-checkpoint PATH``: when ``--load`` holds no checkpoint yet, the weights come
  from PATH (converter output, full or dist, or a trainer checkpoint, saved at any layout);
  iteration, optimizer, scheduler and data position start from zero. A checkpoint in
  ``--load`` (the same run resumed) takes precedence, as in Megatron-LM.
* ``--finetune``: the weights only from ``--load``, iteration and optimizer reset.

The source's architecture must equal this run's (strategy included); a mismatch is refused
naming every differing field, before anything is read. Loading unpickles nothing.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_scalevec.convert.arch import ARCH_FILE, STOCK, ModelArch
from megatron_scalevec.convert.io import TOKENIZER_FILE
from megatron_scalevec.training.build import run_arch


def checkpoint_files(trainer) -> dict:
    """``{file name: bytes}`` the trainer writes into every checkpoint for the converter: the
    arch and the SentencePiece model its datasets were tokenized with (none for mock data)."""
    files = {ARCH_FILE: (run_arch(trainer.args, trainer.vocab_size).to_json() + "\n").encode()}
    tokenizer = getattr(getattr(trainer.train_ds, "config", None), "tokenizer", None)
    tokenizer_model = getattr(tokenizer, "model_path", None)
    if tokenizer_model:
        with open(tokenizer_model, "rb") as f:
            files[TOKENIZER_FILE] = f.read()
    return files


class PretrainedError(ValueError):
    """Weights that cannot start this run (missing, another model, another strategy)."""

    collective = True  # every rank checks the same files and raises the same line


def _canonical(strategy: str) -> str:
    from megatron_scalevec.config import ScaleVecConfig  # noqa: PLC0415

    return strategy if strategy == STOCK else ScaleVecConfig.from_string(strategy).to_string()


def check_arch(path: str, ours: ModelArch) -> ModelArch:
    """The source's arch; refused unless it builds the same parameters as this run."""
    arch_file = os.path.join(path, ARCH_FILE)
    if not os.path.isfile(arch_file):
        raise PretrainedError(f"{path}: no {ARCH_FILE}; not converter or trainer output "
                              f"(convert it with tools/convert_checkpoint.py first)")
    theirs = ModelArch.load(arch_file)
    if _canonical(theirs.scalevec) != _canonical(ours.scalevec):
        from megatron_scalevec.training.checkpointing import conversion_advice  # noqa: PLC0415

        keep = ("--spec baseline" if theirs.scalevec == STOCK else
                f"--scalevec {theirs.scalevec}")
        raise PretrainedError(
            f"{path} holds strategy {theirs.scalevec!r}, this run trains {ours.scalevec!r}: "
            f"pass {keep} to train its strategy; "
            f"{conversion_advice(path, theirs.scalevec, ours.scalevec)}")
    diff = theirs.replace(scalevec=ours.scalevec).differences(ours)
    if diff:
        raise PretrainedError(f"{path} is another model than this run (checkpoint != run): "
                              f"{'; '.join(diff)}")
    return theirs


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _full_name(st, names) -> str:
    """The full-state-dict name (TP=PP=EP=1, global layer and expert numbers) of a sharded
    tensor. Its prepended axes are, in order, the layer of a homogeneous block (key
    ``decoder.layers.<name>``) and the expert of ``experts.experts.``; the stock spec's
    checkpoint names of the fused Pre-Norms (``linear_qkv.layer_norm_weight``) are undone."""
    key, axis, head = st.key, 0, "decoder.layers."
    if key.startswith(head) and not key[len(head):].split(".", 1)[0].isdigit():
        key = f"{head}{st.global_offset[0]}.{key[len(head):]}"
        axis = 1
    if ".experts.experts." in key:
        key = key.replace(".experts.experts.", f".experts.local_experts.{st.global_offset[axis]}.")
    if key not in names:
        key = key.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
        key = key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    return key


def _fill(st, reader, names: set, used: set) -> torch.Tensor:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: PLC0415

    if isinstance(st, (list, tuple)):
        return type(st)(_fill(x, reader, names, used) for x in st)
    if isinstance(st, dict):
        return {k: _fill(v, reader, names, used) for k, v in st.items()}
    assert isinstance(st, ShardedTensor), type(st)
    name = _full_name(st, names)
    if name not in names:
        raise PretrainedError(f"the pretrained weights lack {name} (sharded key {st.key})")
    full = reader.get_tensor(name)
    n = st.prepend_axis_num
    if tuple(full.shape) != tuple(st.global_shape[n:]):
        raise PretrainedError(f"{name}: shape {tuple(full.shape)} in the pretrained weights, "
                              f"{tuple(st.global_shape[n:])} in this model")
    used.add(name)
    index = tuple(slice(o, o + s) for o, s in zip(st.global_offset[n:], st.local_shape))
    return full[index].clone()


def _load_full(path: str, models: list) -> None:
    """Our full format (one safetensors file of whole tensors) into models at any layout:
    every sharded tensor of the model (after megatron-core's factories, e.g. the [gate; up]
    split of fc1) is cut from the whole tensor at its global offset."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory  # noqa: PLC0415

    from megatron_scalevec.convert.io import (  # noqa: PLC0415
        WEIGHTS_FILE,
        model_sharded_state_dict,
        safe_open_checked,
    )

    used: set = set()
    try:
        reader = safe_open_checked(os.path.join(path, WEIGHTS_FILE))
    except ValueError as e:
        raise PretrainedError(str(e)) from None
    with reader:
        names = set(reader.keys())
        for m in models:
            local = {}
            for name, v in model_sharded_state_dict(m).items():
                if isinstance(v, ShardedTensorFactory):
                    local[name] = v.merge_fn(_fill(v.build(), reader, names, used))
                else:
                    local[name] = _fill(v, reader, names, used)
            _load_local(m, local, path)


def _load_dist(path: str, models: list) -> None:
    from megatron_scalevec.convert.io import load_sharded, model_sharded_state_dict  # noqa

    sharded = {str(i): model_sharded_state_dict(m) for i, m in enumerate(models)}
    try:
        loaded = load_sharded(sharded, path)
    except BaseException as e:  # noqa: BLE001 -- CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        from megatron_scalevec.training.faults import first_line  # noqa: PLC0415

        raise PretrainedError(f"{path}: loading the weights failed (corrupt or incomplete): "
                              f"{first_line(e)[:300]}") from None
    for i, m in enumerate(models):
        _load_local(m, loaded[str(i)], path)


def _load_local(model, local: dict, path: str) -> None:
    missing = [k for k in model.state_dict() if not k.endswith("_extra_state")
               and k not in local]
    if missing:
        raise PretrainedError(f"{path} lacks {missing[:8]}")
    model.load_state_dict(local, strict=False)


def check_weights_source(path: str, ours: ModelArch) -> str:
    """Everything about ``path`` that can refuse it before the model is built (the folder,
    the arch and strategy, the checksum manifest); returns the folder to read."""
    from megatron_scalevec.convert.io import (  # noqa: PLC0415
        WEIGHTS_FILE,
        is_full_checkpoint,
        resolve_checkpoint,
        safe_open_checked,
        verify_checkpoint_files,
    )

    try:
        src = resolve_checkpoint(path)
        check_arch(src, ours)
        verify_checkpoint_files(src)
        if is_full_checkpoint(src):  # its header (a truncated file fails here)
            with safe_open_checked(os.path.join(src, WEIGHTS_FILE)):
                pass
    except (ValueError, FileNotFoundError) as e:  # PretrainedError is a ValueError
        raise PretrainedError(str(e)) from None
    except ImportError as e:  # safetensors for our full format: the extra that brings it
        raise PretrainedError(f"--pretrained-checkpoint {path}: {e}") from None
    return src


def check_source(args, vocab_size: int) -> Optional[str]:
    """The checked folder of ``--pretrained-checkpoint`` / ``--finetune``, else None."""
    path = args.load if args.finetune else args.pretrained_checkpoint
    if path is None:
        return None
    return check_weights_source(path, run_arch(args, vocab_size))


def load_weights(path: str, model_chunks: list, ours: ModelArch, checked: bool = False) -> str:
    """Load weights only from ``path`` into the (DDP-wrapped) chunks; returns the folder
    read. Works at any TP/PP/EP layout. ``checked``: :func:`check_weights_source` ran."""
    from megatron_scalevec.convert.io import is_dist_checkpoint, is_full_checkpoint  # noqa

    src = path if checked else check_weights_source(path, ours)
    models = [_unwrap(m) for m in model_chunks]
    with torch.no_grad():
        if is_full_checkpoint(src):
            _load_full(src, models)
        elif is_dist_checkpoint(src):
            _load_dist(src, models)
        else:
            raise PretrainedError(f"{src}: neither our full format (model.safetensors) nor a "
                                  f"dist checkpoint (metadata.json)")
    return src


def start_from_weights(args, model_chunks, optimizer, vocab_size: int,
                       checked: Optional[str] = None) -> Optional[str]:
    """``--finetune`` / ``--pretrained-checkpoint``: weights only, fresh optimizer state.
    Returns the line to log, or None when neither applies. ``checked``: the folder
    :func:`check_source` returned (not checked again)."""
    path = checked or (args.load if args.finetune else args.pretrained_checkpoint)
    if path is None:
        return None
    src = load_weights(path, model_chunks, run_arch(args, vocab_size), checked=bool(checked))
    optimizer.reload_model_params()  # main (fp32) copies follow the loaded weights
    return f"weights from {src} ({'--finetune' if args.finetune else '--pretrained-checkpoint'})" \
           f": iteration 0, optimizer and scheduler fresh"
