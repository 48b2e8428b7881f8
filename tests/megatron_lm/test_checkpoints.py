"""Checkpoints Megatron-LM's own ``pretrain_gpt.py`` writes with our ``--spec`` (torch_dist):

* a resume continues with the losses of an uninterrupted run (``shared``, ``unified``);
* the strategy is recorded in them: a resume with another one (or only another vector decay)
  is refused in one line naming both, before any tensor is read; ranks that read different
  strategies are refused at start-up;
* the converter reads Megatron-LM's save directory (tracker, ``iter_*``, ``common.pt`` args)
  without ``--arch``: to stock (exact), to another strategy (exact), to Hugging Face; stock
  Megatron-LM's own checkpoint to ours; a model it cannot build, and the legacy ``torch``
  format, are refused in one line.
"""

import functools
import json
import os
import subprocess
import sys

import pytest

from scalevec_testing import megatron_lm as M
from scalevec_testing.markers import needs_megatron_lm

pytestmark = needs_megatron_lm

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# LayerNorm (biases kept, moved through the conversions), SwiGLU, rope, no linear biases: a
# model the converter builds. No dropout: on CPU one generator stands in for the CPU and CUDA
# ones (compat/cpu.py), and stock Megatron-LM's own resume then draws other dropout masks.
FLAGS = [*M.TINY, *M.LOCAL, "--position-embedding-type", "rope", "--swiglu",
         "--disable-bias-linear", "--train-iters", "4", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron_lm_ckpt"))


@functools.cache
def _train(root, strategy, name, extra=()):
    """``strategy`` (None: stock) over FLAGS + ``extra``; its output directory is ``name``."""
    spec = [] if strategy is None else [*M.SPEC, "scalevec_dense"]
    env = {} if strategy is None else {"MEGATRON_SCALEVEC": strategy}
    return M.run([*FLAGS, *extra, *spec], os.path.join(root, name), env=env)


def _saved(root, strategy, extra=()):
    """A run stopped at iteration 2 (``--exit-interval``: saves, then exits): its save dir."""
    name = f"{strategy}{''.join(extra)}"
    save = os.path.join(root, f"ckpt-{name}")
    _train(root, strategy, f"first-{name}",
           ("--save", save, "--save-interval", "1000", "--exit-interval", "2", *extra)).check()
    return save


@pytest.mark.parametrize("strategy", ["shared", "unified"])
def test_resume_continues_as_an_uninterrupted_run(root, strategy):
    whole = _train(root, strategy, f"whole-{strategy}").check().losses()
    save = _saved(root, strategy)
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    resumed = _train(root, strategy, f"resume-{strategy}",
                     ("--load", save, "--save", save, "--save-interval", "1000")).check().losses()
    assert sorted(resumed) == [3, 4], resumed
    for it in (3, 4):
        assert resumed[it]["lm loss"] == pytest.approx(whole[it]["lm loss"], rel=1e-6), it


def _refusal(result):
    lines = [ln for ln in result.output.splitlines() if ln.startswith("megatron_scalevec:")]
    assert result.returncode == 2, result.output[-3000:]
    assert lines and len(set(lines)) == 1, lines  # one line (the same on every rank)
    return lines[0]


@pytest.mark.parametrize("env,named", [
    ({"MEGATRON_SCALEVEC": "hg+dp+er"}, "hg+dp+er in this run"),
    ({"MEGATRON_SCALEVEC_VECTOR_WD": "0.05"}, "scale_vector_weight_decay=0.05"),
])
def test_resume_with_another_strategy_is_refused(root, env, named):
    save = _saved(root, "unified")
    before = sorted(os.listdir(save))
    out = M.run([*FLAGS, *M.SPEC, "scalevec_dense", "--load", save, "--save", save,
                 "--save-interval", "1000"],
                os.path.join(root, f"mismatch-{len(env)}-{named[:5]}"), env=env)
    line = _refusal(out)
    assert "hg+dnp+or+iwd in the checkpoint" in line and named in line, line
    assert "MEGATRON_SCALEVEC=hg+dnp+or+iwd" in line  # the advice: resume with the recorded
    assert sorted(os.listdir(save)) == before  # nothing written


def test_ranks_reading_different_strategies_are_refused(root):
    out = M.run([*FLAGS, *M.SPEC, "scalevec_dense"], os.path.join(root, "ranks"), nproc=2,
                env={"MEGATRON_SCALEVEC": "unified"},
                rank_env={1: {"MEGATRON_SCALEVEC": "hg+dp"}})
    line = _refusal(out)
    assert "rank 0 hg+dnp+or+iwd" in line and "rank 1 hg+dp" in line, line


def _convert(*args):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
                           *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    return proc.returncode, proc.stdout, proc.stderr


RMS = ("--normalization", "RMSNorm")  # what a Hugging Face Llama export needs


@pytest.mark.parametrize("source,target,flags", [
    ("hg+dp+or", "stock", ()), ("hg+dp+or", "hg+er", ()), ("shared", "hf", RMS),
    (None, "unified", ("--allow-function-change",)), (None, "hg+or", ())])
def test_converter_reads_megatron_lm_save_directories(root, source, target, flags):
    """No --arch: the model comes from the checkpoint's own args (and strategy record)."""
    train = tuple(f for f in flags if f != "--allow-function-change")
    save = _saved(root, source, train)  # source None: stock Megatron-LM (no --spec)
    out = os.path.join(root, f"out-{source}-{target}")
    code, stdout, stderr = _convert("--load", save, "--to", target, "--save", out,
                                    *[f for f in flags if f == "--allow-function-change"])
    assert code == 0, stderr[-3000:]
    report = json.loads(stdout)
    assert report["source"] == ("stock" if source is None else
                                M.strategy_string(source)), report
    if "--allow-function-change" not in flags:
        assert report["max_logit_diff"] < 1e-5, report


def test_converter_refusals_name_the_problem(root):
    biased = os.path.join(root, "ckpt-biased")  # Megatron-LM's default linear biases
    M.run([*M.TINY, *M.LOCAL, "--train-iters", "1", "--save", biased, "--save-interval", "1"],
          os.path.join(root, "biased")).check()
    legacy = os.path.join(root, "ckpt-legacy")
    M.run([*FLAGS, "--train-iters", "1", "--save", legacy, "--save-interval", "1",
           "--ckpt-format", "torch"],
          os.path.join(root, "legacy")).check()
    dnp = _saved(root, "unified")  # DNP's V / gate / up norms have no stock equivalent
    for path, named in ((biased, "linear biases"), (legacy, "legacy 'torch' format"),
                        (dnp, "DNP normalizations")):
        out = os.path.join(root, f"refused-{os.path.basename(path)}")
        code, stdout, stderr = _convert("--load", path, "--to", "stock", "--save", out)
        lines = stderr.strip().splitlines()
        assert code == 2 and named in lines[-1] and lines[-1].startswith("convert_checkpoint:"), \
            stderr[-2000:]
        assert not os.path.exists(out)
