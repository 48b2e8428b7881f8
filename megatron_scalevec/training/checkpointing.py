"""Save and resume with megatron-core ``dist_checkpointing`` (torch_dist format).

Layout of ``--save DIR``::

    DIR/iter_0000100/      one complete checkpoint (model, optimizer, scheduler, RNG, data
                           position, the strategy string)
    DIR/latest             the iteration of the last complete checkpoint (written atomically)

A save writes ``DIR/.tmp_iter_XXXXXXX`` and renames it only when every rank has finished, then
replaces ``latest``: a save interrupted at any point leaves the previous checkpoint and its
``latest`` pointer intact. Before publishing, every file gets a checksum in
``scalevec_manifest.json`` (ckpt_guard.py), verified on load; the model state is checked finite
before anything is written. The distributed optimizer is saved ``fully_reshardable`` (the default
format fails with torch AdamW in 0.16.1), so a run can resume at another TP/PP/DP layout.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_scalevec.training import ckpt_guard
from megatron_scalevec.training.ckpt_guard import CheckpointError  # noqa: F401 (re-export)
from megatron_scalevec.training.faults import first_line

CHECKPOINT_VERSION = 1
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
try:  # torch DCP's error type derives from BaseException: ``except Exception`` misses it
    from torch.distributed.checkpoint.api import CheckpointException as _DCPError
except ImportError:  # pragma: no cover
    _DCPError = Exception
LOAD_ERRORS = (Exception, _DCPError)


def _rank0() -> bool:
    return dist.get_rank() == 0


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest(root: str):
    """The iteration ``latest`` points to, or None when ``root`` holds no checkpoint yet."""
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        if any(n.startswith("iter_") for n in os.listdir(root)):
            raise CheckpointError(f"{root}: checkpoint folders but no 'latest' file: an "
                                  f"incomplete or foreign checkpoint directory")
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: corrupt 'latest' pointer {text!r}")
    return int(text)


def _layout() -> dict:
    ps = parallel_state
    return dict(tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(),
                dp=ps.get_data_parallel_world_size(),
                ep=ps.get_expert_model_parallel_world_size())


def _rng_object() -> ShardedObject:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = dict(random=random.getstate(),
                 numpy=(name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
                 torch=torch.get_rng_state(),
                 tracker=tensor_parallel.get_cuda_rng_tracker().get_states())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    ps = parallel_state
    return ShardedObject("rng_state", state,
                         (ps.get_pipeline_model_parallel_world_size(),
                          ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(),
                          ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _set_rng(state: dict) -> None:
    random.setstate(state["random"])
    name, keys, *rest = state["numpy"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys  # tensors since manifest v1
    np.random.set_state((name, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _gpt(m):
    """The GPTModel inside DDP / Float16Module: keys without wrapper prefixes, as Megatron-LM
    writes them."""
    while hasattr(m, "module"):
        m = m.module
    return m


def _model_sd(model) -> dict:
    if len(model) == 1:
        return {"model": _gpt(model[0]).sharded_state_dict()}
    return {f"model{i}": _gpt(m).sharded_state_dict() for i, m in enumerate(model)}


def _models_sd(sd: dict) -> dict:
    """The model part the optimizer maps its parameters through: the chunks' state dicts side
    by side (``model0``, ``model1``, ...), as Megatron-LM passes them. Merged into one dict,
    virtual-pipeline chunks collide: each names its layers from 0."""
    return sd["model"] if "model" in sd else {k: v for k, v in sd.items()
                                               if k.startswith("model")}


def _state_dict(model, optimizer, scheduler, iteration, consumed, strategy, meta, is_loading,
                with_rng=True, with_optim=True, optim_meta=None):
    sd = _model_sd(model)
    if with_optim and optimizer is not None:
        sd["optimizer"] = optimizer.sharded_state_dict(_models_sd(sd), is_loading=is_loading,
                                                       metadata=OPTIM_METADATA)
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_object()
    sd.update(iteration=iteration, consumed_samples=consumed, scalevec=strategy,
              checkpoint_version=CHECKPOINT_VERSION, layout=_layout(), model_meta=meta,
              optim_meta=dict(optim_meta or {}))
    return sd


def save_checkpoint(root, iteration, model, optimizer, scheduler, consumed, strategy, meta,
                    extra_files=None, optim_meta=None):
    """Write ``root/iter_N`` through a temporary folder, add the checksum manifest, then
    publish it and ``latest``. ``extra_files`` ({name: bytes}, rank 0) go in with the tensors:
    the converter's ``scalevec_arch.json`` and the tokenizer (training/pretrained.py)."""
    final, tmp = iter_dir(root, iteration), os.path.join(root, f".tmp_iter_{iteration:07d}")
    if _rank0():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    sd = _state_dict(model, optimizer, scheduler, iteration, consumed, strategy, meta, False,
                     optim_meta=optim_meta)
    dist_checkpointing.save(sd, tmp, validate_access_integrity=True)
    if _rank0():
        for name, data in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
    dist.barrier()
    ckpt_guard.write_manifest(tmp, iteration=iteration, scalevec=strategy)
    dist.barrier()
    if _rank0():
        for name, data in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = os.path.join(root, ".latest.tmp")
        with open(pointer, "w") as f:
            f.write(f"{iteration}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(root, "latest"))
    dist.barrier()


def strategy_difference(saved: str, wanted: str) -> str:
    """What differs between two strategy strings, in words."""
    a, b = set(saved.split("+")), set(wanted.split("+"))
    if a ^ b == {"iwd"}:
        return ("only IWD differs (which vectors get weight decay; the parameters are the "
                "same, the optimizer's decay groups are not)")
    only_a = "+".join(sorted(a - b)) or "-"
    only_b = "+".join(sorted(b - a)) or "-"
    return f"the parameters differ ({only_a} only in the checkpoint, {only_b} only in this run)"


def conversion_advice(src: str, saved: str, wanted: str) -> str:
    """How to start ``wanted`` from the weights of a ``saved`` checkpoint: the converter, which
    reaches every strategy through the exact fold to stock, except from DNP (its V / gate / up
    norms fold into nothing: it refuses)."""
    from megatron_scalevec.config import ScaleVecConfig  # noqa: PLC0415

    if saved != "stock" and ScaleVecConfig.from_string(saved).dnp:
        return ("a checkpoint with DNP converts to no other strategy (its V / gate / up norms "
                "do not fold)")
    return (f"to train {wanted} from its weights: python tools/convert_checkpoint.py --load "
            f"{src} --to {wanted} --save DIR, then --pretrained-checkpoint DIR")


def _flag_text(key: str, value) -> str:
    """The flag that gives a model field ``value`` (``drop --x`` for a switch that is off)."""
    if key == "vocab_size":
        return f"the tokenizer of {value} pieces (--vocab-size {value} with --mock-data)"
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool) or value is None:
        return flag if value else f"drop {flag}"
    return f"{flag} {value}"


def model_mismatch(path: str, saved_meta: dict, meta: dict):
    """One line naming every model field in which this run differs from the checkpoint, and
    the flags that give the checkpoint's; None when they agree."""
    keys = [k for k, v in meta.items() if k in saved_meta and saved_meta[k] != v]
    if not keys:
        return None
    fields = ", ".join(f"{k} {saved_meta[k]!r} (this run {meta[k]!r})" for k in keys)
    texts = [_flag_text(k, saved_meta[k]) for k in keys]
    give = " ".join(t for t in texts if t.startswith("--"))
    other = [t for t in texts if not t.startswith("--")]
    todo = " and ".join(([f"pass {give}"] if give else []) + other)
    return f"{path} is another model than this run: in the checkpoint {fields}; to resume it {todo}"


def inspect_checkpoint(root, strategy, meta, verify=True):
    """Everything about ``root``'s latest checkpoint that can be checked before the model is
    built: the pointer, the manifest (files, sizes, checksums), the writer's megatron-core,
    the strategy and the model sizes. Returns (path, manifest, common state: iteration,
    schedule), or None when ``root`` holds no checkpoint yet. Raises CheckpointError with one
    line naming the file or the mismatch."""
    iteration = read_latest(root)
    if iteration is None:
        return None
    path = iter_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"{root}/latest points to iteration {iteration} but {path} is "
                              f"missing")
    manifest = ckpt_guard.verify_checkpoint(path, hashes=verify)
    ckpt_guard.check_readable_version(path, manifest)
    try:
        with ckpt_guard.no_code_on_load():
            common = dist_checkpointing.load_common_state_dict(path)
    except LOAD_ERRORS as e:
        raise CheckpointError(f"{path}: not a readable dist_checkpointing checkpoint "
                              f"(corrupt or incomplete){ckpt_guard.version_note(manifest)}: "
                              f"{first_line(e)}") from None
    if common.get("checkpoint_version") != CHECKPOINT_VERSION or "scalevec" not in common:
        raise CheckpointError(f"{path}: not written by megatron_scalevec's trainer")
    if common["scalevec"] != strategy:
        raise CheckpointError(
            f"{path} was trained with scale-vector strategy {common['scalevec']!r}, this run "
            f"asks for {strategy!r}: {strategy_difference(common['scalevec'], strategy)}; "
            f"pass --scalevec {common['scalevec']} to resume it; "
            f"{conversion_advice(root, common['scalevec'], strategy)}")
    mismatch = model_mismatch(path, common.get("model_meta", {}), meta)
    if mismatch:
        raise CheckpointError(mismatch)
    return path, manifest, common


def check_vector_lr(path: str, common: dict, wanted: float) -> None:
    """Refuse (one line) resuming optimizer state written at another vectors' LR multiplier:
    megatron-core 0.16.1 would keep the checkpoint's per-group LR silently, 0.19.2 fail on a
    param group it cannot pair. A checkpoint that records none trained its vectors at 1x."""
    saved = float(common.get("optim_meta", {}).get("vector_lr_mult", 1.0))
    if saved != wanted:
        raise CheckpointError(
            f"{path} trained its scale vectors at --vector-lr-mult {saved:g}, this run asks "
            f"for {wanted:g}: pass --vector-lr-mult {saved:g} to resume, or --no-load-optim to "
            f"start the optimizer afresh at {wanted:g}")


# megatron-core's OptimizerParamScheduler.state_dict() keys -> the flag that sets each
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--weight-decay", "wd_incr_steps": "--train-iters"}


def schedule_on_resume(path: str, saved, wanted: dict, override: bool, use_checkpoint: bool):
    """Megatron-LM's rule for the LR/WD schedule of a resumed run: with neither
    ``--override-opt_param-scheduler`` nor ``--use-checkpoint-opt_param-scheduler`` a schedule
    that differs from the checkpoint's is refused (Megatron-LM asserts); the first takes this
    run's flags, the second the checkpoint's. Checked before the model is built. Returns
    ``(use the checkpoint's values, line to log or None)``; raises CheckpointError."""
    if not saved:
        return True, None
    diffs = [f"{flag} {saved[key]} -> {wanted[key]}" for key, flag in _SCHEDULE_FLAGS.items()
             if key in saved and saved[key] != wanted[key]
             and not (key == "wd_incr_steps" and wanted["wd_incr_style"] == "constant")]
    if not diffs:
        return True, None
    if override:
        return False, (f"LR schedule: this run's flags (--override-opt_param-scheduler), not "
                       f"the checkpoint's: {', '.join(diffs)}")
    if use_checkpoint:
        return True, (f"LR schedule: the checkpoint's (--use-checkpoint-opt_param-scheduler); "
                      f"ignored: {', '.join(diffs)}")
    raise CheckpointError(
        f"{path}: this run changes the checkpoint's LR schedule ({', '.join(diffs)}; "
        f"--lr-decay-iters and --lr-warmup-iters follow --train-iters unless given): pass "
        f"--override-opt_param-scheduler to use this run's schedule or "
        f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def load_checkpoint(found, model, optimizer, scheduler, strategy, meta, load_optim=True):
    """Load the checkpoint ``inspect_checkpoint`` found into model/optimizer/scheduler and the
    RNGs (nothing in it can run code). Returns (iteration, consumed_samples)."""
    path, manifest = found[:2]
    with ckpt_guard.no_code_on_load():
        common = dist_checkpointing.load_common_state_dict(path)
    iteration = common["iteration"]
    same_layout = common.get("layout") == _layout()
    with_optim = load_optim and optimizer is not None
    if with_optim:
        prepare_optimizer_for_load(optimizer)
    sd = _state_dict(model, optimizer, scheduler, iteration, 0, strategy, meta, True,
                     with_rng=same_layout, with_optim=with_optim)
    try:
        with ckpt_guard.no_code_on_load():
            loaded = dist_checkpointing.load(sd, path)
    except LOAD_ERRORS as e:
        raise CheckpointError(f"{path}: loading failed (corrupt, incomplete, or a different "
                              f"model){ckpt_guard.version_note(manifest)}: "
                              f"{first_line(e)}") from None
    try:
        if len(model) == 1:
            _gpt(model[0]).load_state_dict(loaded["model"])
        else:
            for i, m in enumerate(model):
                _gpt(m).load_state_dict(loaded[f"model{i}"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: the model does not match the checkpoint: "
                              f"{first_line(e)}") from None
    if with_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
        finish_optimizer_load(optimizer)
    if same_layout:
        _set_rng(loaded["rng_state"])
    return loaded["iteration"], loaded["consumed_samples"]


# --- torch AdamW under megatron-core 0.16.1's distributed optimizer (CPU_NOTES.md) ---------
def _dist_opts(optimizer):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: PLC0415

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in opts if isinstance(o, DistributedOptimizer)]


def prepare_optimizer_for_load(optimizer) -> None:
    """Work around the distributed optimizer's torch-AdamW fallback before a load:

    * a fresh optimizer has no state, so ``state_dict()`` fails ``assert len(steps) == 1``:
      give it states first (``_init_optimizer_states_with_dummy_values``; the dummy values
      are overwritten by the load);
    * ``_set_main_param_and_optimizer_states`` copies every state key, ``step`` included,
      which the checkpoint's per-param tensors do not carry, into views of leaf params outside
      ``no_grad``: copy only the keys present, under ``no_grad``.
    """
    for opt in _dist_opts(optimizer):
        if len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()
        if getattr(opt, "_scalevec_patched", False):
            continue
        orig = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, _opt=opt, _orig=orig):
            if _opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return _orig(model_param, tensors)
            gi, order = _opt.model_param_group_index_map[model_param]
            main = _opt.optimizer.param_groups[gi]["params"][order]
            dst = {"param": main, **_opt.optimizer.state[main]}
            with torch.no_grad():
                for key, value in tensors.items():
                    if key in dst and key != "step":
                        dst[key].copy_(value)
            return None

        opt._set_main_param_and_optimizer_states = set_states
        opt._scalevec_patched = True


def finish_optimizer_load(optimizer) -> None:
    """After a load every AdamW state shares one ``step`` tensor, which the fallback path
    increments once per parameter per step: give each parameter its own copy."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    for opt in opts:
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()
