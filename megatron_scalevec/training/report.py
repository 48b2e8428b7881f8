"""What a run says when it ends: the loss plot, a summary (final and best validation loss, the
files written, the commands that resume, convert and export from here) and, on Ctrl-C, one
line naming the iteration and the last checkpoint kept.

Every command printed here is the run's own command line with only the flags that change, so
it works when pasted (``tests/training/test_report.py`` runs them).
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import sys

# flags a command built from the run's own replaces: valued ones drop their value too
_VALUED = ("--train-iters", "--exit-interval", "--load", "--save-interval",
           "--pretrained-checkpoint")
_SCHEDULE = ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")


class Interrupted(Exception):
    """Ctrl-C: the run stopped; the message is the one line to print (exit 130)."""

    collective = True  # every rank stops at once; rank 0 prints


def plot(args, log) -> None:
    """loss.png in the run dir from metrics.jsonl (rank 0); a missing matplotlib is a line."""
    if args.no_plot or not os.path.isfile(log.path) or os.path.getsize(log.path) == 0:
        return
    try:
        from megatron_scalevec.training.plotting import plot_runs  # noqa: PLC0415

        out = os.path.join(args.run_dir, "loss.png")
        plot_runs([args.run_dir], out)
        log.print(f"wrote {out}")
    except ImportError as e:
        log.print(f"no loss plot ({e}; pip install 'megatron_scalevec[plot]'); metrics are in "
                  f"{log.path}")


def launcher() -> str:
    """How this process was started, as a command a user can type again."""
    from megatron_scalevec.training.arguments import TINY_ENV  # noqa: PLC0415

    tiny = f"{TINY_ENV}=1 " if os.environ.get(TINY_ENV, "") not in ("", "0") else ""
    arg0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(arg0).startswith("megatron-scalevec"):  # the console script
        return f"{tiny}megatron-scalevec-pretrain"
    script = arg0 if arg0.endswith("pretrain_gpt.py") else "pretrain_gpt.py"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return f"{tiny}python {script}"
    if os.environ.get("LOCAL_WORLD_SIZE") == str(world):
        return f"{tiny}torchrun --standalone --nproc-per-node {world} {script}"
    return f"{tiny}torchrun <your launch flags> {script}"


def converter() -> str:
    """The converter beside the trainer that runs (the console script's, or tools/ of the
    checkout whose pretrain_gpt.py runs)."""
    arg0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(arg0).startswith("megatron-scalevec"):
        return "megatron-scalevec-convert"
    root = os.path.dirname(arg0) if arg0.endswith("pretrain_gpt.py") else ""
    return f"python {os.path.join(root, 'tools', 'convert_checkpoint.py')}"


def command(argv, drop=(), add=()) -> str:
    """The run's command line less ``--overwrite``, ``--exit-interval`` and the flags in
    ``drop`` (with their values), plus ``add``."""
    drop = {"--overwrite", "--exit-interval", *drop}
    keep, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        name = tok.split("=", 1)[0]
        if name in drop:
            skip = name in _VALUED and "=" not in tok
            continue
        keep.append(tok)
    return f"{launcher()} {shlex.join([*keep, *map(str, add)])}"


def latest_checkpoint(save):
    """The ``iter_N`` folder ``save/latest`` points to, or None."""
    if not save:
        return None
    pointer = os.path.join(save, "latest")
    try:
        text = open(pointer).read().strip()
    except OSError:
        return None
    path = os.path.join(save, f"iter_{int(text):07d}") if text.isdigit() else None
    return path if path and os.path.isdir(path) else None


def _val_losses(path: str) -> list:
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("val_loss") is not None:
                    rows.append((rec["iteration"], rec["val_loss"]))
    except OSError:
        pass
    return rows


def _loss_line(args, metrics_path: str, iteration: int, train_loss) -> str:
    vals = _val_losses(metrics_path)
    if vals:
        best = min(vals, key=lambda r: r[1])
        text = (f"validation loss {vals[-1][1]:.4f} at iteration {vals[-1][0]}, best "
                f"{best[1]:.4f} at iteration {best[0]}")
    else:
        text = "no validation loss (" + ("--eval-interval 0" if not args.eval_interval else
                                         "no validation split") + ")"
    train = f"; train loss {train_loss:.4f}" if train_loss is not None else ""
    return f"iteration {iteration} of {args.train_iters}: {text}{train}"


def _advice(args, argv, iteration: int, strategy: str) -> list:
    save = os.path.normpath(args.save)
    resume = ["--load", save]
    if iteration < args.train_iters:
        what, cmd = "resume", command(argv, ("--load", "--pretrained-checkpoint", "--finetune"),
                                      resume)
    else:  # this run's cosine over the longer run (the checkpoint's stays at --min-lr)
        what = "train on"
        cmd = command(argv, ("--load", "--pretrained-checkpoint", "--finetune", "--train-iters",
                             *_SCHEDULE),
                      [*resume, "--train-iters", 2 * args.train_iters, _SCHEDULE[0]])
    lines = [f"  {what}: {cmd}"]
    conv = f"{converter()} --load {shlex.quote(save)}"
    if strategy == "stock":
        lines.append(f"  convert: {conv} --to hg+dp+or --save {shlex.quote(save + '-hg_dp_or')}"
                     f"   # add scale vectors, same function")
    elif "dnp" not in strategy.split("+"):
        lines.append(f"  convert: {conv} --to stock --format dist --save "
                     f"{shlex.quote(save + '-stock')}   # megatron-core's own layers, exact")
    lines.append(f"  export: {conv} --to hf --save {shlex.quote(save + '-hf')}   # Hugging "
                 f"Face (pip install 'megatron_scalevec[convert]')")
    return lines


def end_summary(args, argv, log, iteration: int, train_loss, elapsed: float,
                strategy: str) -> str:
    """The lines printed when a run ends (finished or stopped by --exit-interval)."""
    files = [n for n in ("config.json", "metrics.jsonl", "loss.png")
             if os.path.isfile(os.path.join(args.run_dir, n))]
    ckpt = latest_checkpoint(args.save)
    where = f"checkpoint {ckpt}" if ckpt else "no checkpoint (--no-save)"
    tb = f"; TensorBoard {args.tensorboard_dir}" if getattr(log, "tb", None) else ""
    lines = [f"done in {elapsed:.1f} s, {_loss_line(args, log.path, iteration, train_loss)}",
             f"wrote {os.path.join(args.run_dir, '')}: {', '.join(files)}; {where}{tb}"]
    if ckpt:
        lines += _advice(args, argv, iteration, strategy)
    return "\n".join(lines)


def interrupted(args, argv, trainer, log) -> Interrupted:
    """After Ctrl-C: the plot of what was logged, no half-written checkpoint folder, and the
    line to print."""
    import torch.distributed as dist  # noqa: PLC0415

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if trainer is None:
        return Interrupted("interrupted before the first iteration: nothing trained, no "
                           "checkpoint kept")
    if rank0:
        for tmp in glob.glob(os.path.join(args.save or "", ".tmp_iter_*")) if args.save else []:
            shutil.rmtree(tmp, ignore_errors=True)  # a save cut short: never published
        plot(args, log)
    ckpt = latest_checkpoint(args.save)
    resume = command(argv, ("--load", "--pretrained-checkpoint", "--finetune"),
                     ["--load", os.path.normpath(args.save or ".")])
    where = (f"last checkpoint {ckpt} (resume: {resume})"
             if ckpt else "no checkpoint kept" +
             (" (--save-interval N saves during the run)" if args.save else " (--no-save)"))
    return Interrupted(f"interrupted after iteration {trainer.iteration} of {args.train_iters}; "
                       f"{where}")
