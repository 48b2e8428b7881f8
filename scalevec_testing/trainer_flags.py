"""Trainer command lines shared by the end-to-end tests (test_trainer.py, test_faults.py,
test_first_hour.py and test_run_reports.py in tests/training/, and
tests/convert/test_convert_trainer.py), here because a test file never imports another
(tests/test_import_cycles.py checks it).

``TINY``: the smallest dense run of pretrain_gpt.py / the trainer on mock data (2 layers, hidden
32, 16 tokens, 8 sequences a step), quiet and without plots; tests append the iterations,
directories and flags they check. ``OVR``: resuming with a longer ``--train-iters`` changes the
LR schedule, this flag says which applies. :func:`run_trainer`: the trainer's ``main`` as a rank
function of ``run_on_ranks``; :func:`run_cli`: ``pretrain_gpt.py`` as a user runs it (a
subprocess, one thread); :func:`run_convert` and :func:`run_converter_cli` likewise for the
converter's API and its command line (tools/convert_checkpoint.py).
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)

TINY = ["--mock-data", "--spec", "scalevec_dense", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--vocab-size", "64", "--lr", "1e-2", "--min-lr", "1e-3", "--log-interval", "2",
        "--eval-interval", "0", "--quiet", "--no-plot"]
OVR = "--override-opt_param-scheduler"


def run_trainer(rank, world, argv):
    """``run_on_ranks(run_trainer, world, argv)``: the trainer on ``argv`` in each forked rank."""
    from megatron_scalevec.training.trainer import main

    return main(argv)


def run_cli(*flags, timeout=150):
    """``python pretrain_gpt.py FLAGS`` from the repository root: the CompletedProcess."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags],
                          capture_output=True, text=True, cwd=ROOT, env=CLI_ENV, timeout=timeout)


def run_convert(rank, world, *args, **kw):
    """``run_on_ranks(run_convert, world, load, save, to, ...)``: ``convert.api.convert``."""
    from megatron_scalevec.convert.api import convert

    return convert(*args, **kw)


def run_converter_cli(rank, world, argv):
    """tools/convert_checkpoint.py's ``main(argv)`` in a rank: (exit code, its stdout)."""
    import contextlib
    import importlib.util as iu
    import io

    spec = iu.spec_from_file_location("cc", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    cli = iu.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    return rc, out.getvalue()
