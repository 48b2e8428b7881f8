"""Start-up summary (arguments, layout, parameter counts) and the progress line's timing, as
Megatron-LM prints them; megatron-core's repeated "not installed" warnings folded into one."""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings

import torch
import torch.distributed as dist

_MISSING_BACKEND = re.compile(r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed")


@contextlib.contextmanager
def folded_backend_warnings(found: list):
    """Collect megatron-core's "Transformer Engine / Apex not installed" warnings (one per
    importing module, six per rank) into ``found``; every other warning is shown as usual."""
    with warnings.catch_warnings(record=True) as caught:
        yield
    for w in caught:
        if _MISSING_BACKEND.search(str(w.message)):
            found.append(str(w.message))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


# Deprecations raised inside torch.distributed / megatron-core on every rank, none of them
# actionable by a user of this trainer (checked with torch 2.13.0, megatron-core 0.16.1 and
# 0.19.2): megatron-core calls the collectives torch renamed (c10d's deprecation wrapper),
# DCP's ``load_state_dict`` and torch's ShardedTensor; TransformerConfig warns about a CUDA
# graph scope it sets itself.
_LIBRARY_DEPRECATIONS = (
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
    (FutureWarning, r"`(load|save)_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    (UserWarning, r"full scope is deprecated"),
    # 0.19: get_megatron_optimizer imports its MiMo model class, whose module warns on import
    (UserWarning, r"MimoModelConfig is experimental"),
)


@contextlib.contextmanager
def library_deprecations_silenced():
    """While the trainer runs: the library deprecations above are not shown (46 lines of
    them on a TP2+SP run), nor, without CUDA, megatron-core's CUDA_DEVICE_MAX_CONNECTIONS
    advice; every other warning is."""
    with warnings.catch_warnings():
        for category, message in _LIBRARY_DEPRECATIONS:
            warnings.filterwarnings("ignore", message=message, category=category)
        if not torch.cuda.is_available():  # advice for CUDA streams, on every SP layer
            warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS",
                                    category=UserWarning)
        yield


def backend_note(found: list):
    if not found:
        return None
    names = sorted({n for m in found for n in ("Transformer Engine", "Apex") if n in m})
    return (f"note: {' and '.join(names)} not installed: megatron-core uses its torch / local "
            f"fallbacks ({len(found)} warnings folded into this line)")


def arguments_block(args) -> str:
    """The arguments that are not at their flag's default (given, or derived from others);
    every argument is in the run dir's config.json."""
    from megatron_scalevec.training.arguments import build_parser  # noqa: PLC0415

    defaults = vars(build_parser().parse_args([]))
    skip = {"scalevec_config"}
    items = [(k, v) for k, v in sorted(vars(args).items()) if k not in skip]
    rows = [f"  {k} {'.' * max(1, 40 - len(k))} {v}" for k, v in items
            if k not in defaults or defaults[k] != v]
    return "\n".join(["------------------------ arguments ------------------------", *rows,
                      f"---- end of arguments ({len(items) - len(rows)} more at their "
                      f"defaults; all in {os.path.join(args.run_dir, 'config.json')}) ----"])


def layout_line(args) -> str:
    return (f"layout: world {dist.get_world_size()} = TP {args.tensor_model_parallel_size} x "
            f"PP {args.pipeline_model_parallel_size} x DP {args.data_parallel_size}; EP "
            f"{args.expert_model_parallel_size}, expert-TP {args.expert_tensor_parallel_size}, "
            f"VPP {args.virtual_pipeline_model_parallel_size or 1}, SP "
            f"{'on' if args.sequence_parallel else 'off'}, distributed optimizer "
            f"{'on' if args.use_distributed_optimizer else 'off'}; {args.num_microbatches} "
            f"micro-batches of {args.micro_batch_size} per step")


def parameter_counts(model, device) -> tuple:
    """(total, scale-vector) parameters of the whole model, each tensor counted once across
    the tensor-, pipeline-, expert- and data-parallel ranks (collective)."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    first_stage = ps.is_pipeline_first_stage(ignore_virtual=True)
    total = vectors = 0
    for chunk in model:
        for p in chunk.parameters():
            expert = not getattr(p, "allreduce", True)
            split = getattr(p, "tensor_model_parallel", False)
            if expert:
                owner = edp_rank == 0 and (split or etp_rank == 0)
            else:
                owner = dp_rank == 0 and (split or tp_rank == 0)
            if getattr(p, "shared_embedding", False) and not first_stage:
                owner = False  # the tied output layer repeats the embedding
            if getattr(p, "shared", False):
                owner = False  # a replica of another rank's copy (sharding.mark_expert)
            if owner:
                total += p.numel()
                vectors += p.numel() if hasattr(p, "scalevec_role") else 0
    buf = torch.tensor([total, vectors], dtype=torch.float64, device=device)
    dist.all_reduce(buf)
    return int(buf[0]), int(buf[1])


def parameter_line(total: int, vectors: int) -> str:
    return (f"parameters: {total:,} total, {vectors:,} in scale vectors "
            f"({100 * vectors / max(total, 1):.3f}%)")


class Throughput:
    """Elapsed time, ms/iteration, tokens/s and an ETA from an exponential moving average of
    the time per iteration; the first interval (start-up, first compilation) is not in the
    average, and a first interval of one iteration gives no ETA at all."""

    def __init__(self, tokens_per_iter: int, total_iters: int, start_iter: int,
                 alpha: float = 0.3):
        self.tokens_per_iter, self.total, self.alpha = tokens_per_iter, total_iters, alpha
        self.start = self.t0 = time.time()
        self.i0, self.first, self.avg = start_iter, start_iter, None
        self.intervals = 0

    def update(self, iteration: int) -> dict:
        now = time.time()
        dt, di = now - self.t0, max(iteration - self.i0, 1)
        self.t0, self.i0 = now, iteration
        per_iter = dt / di
        self.intervals += 1
        if self.avg is None or self.intervals == 2:  # replace the start-up interval
            self.avg = per_iter
        else:
            self.avg = self.alpha * per_iter + (1 - self.alpha) * self.avg
        out = {"tokens_per_s": self.tokens_per_iter / max(per_iter, 1e-9),
               "s_per_iter": per_iter, "ms_per_iter": 1000 * per_iter,
               "elapsed_s": now - self.start}
        if self.intervals > 1 or di > 1 or iteration >= self.total:
            out["eta_s"] = self.avg * (self.total - iteration)
        # else: a first iteration alone (start-up, compilation) would give an ETA ~20x off
        if torch.cuda.is_available():
            out["mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def format_line(rec: dict) -> str:
    def num(key, fmt):
        v = rec.get(key)
        return "nan" if v is None else format(v, fmt)

    parts = [f"iter {rec['iteration']:>6}/{rec['train_iters']}",
             f"elapsed {_fmt_s(rec['elapsed_s'])}", f"{rec['ms_per_iter']:.0f} ms/it",
             f"loss {num('loss', '.4f')}"]
    if "val_loss" in rec:
        parts.append(f"val {num('val_loss', '.4f')}")
    parts += [f"lr {rec['lr']:.3e}", f"gnorm {num('grad_norm', '.3f')}",
              f"{rec['tokens_per_s']:.0f} tok/s"]
    if "mem_gb" in rec:
        parts.append(f"mem {rec['mem_gb']:.1f} GB")
    parts.append(f"eta {_fmt_s(rec['eta_s'])}" if "eta_s" in rec else
                 "eta after the first iteration (start-up, compiling)")
    return " | ".join(parts)
