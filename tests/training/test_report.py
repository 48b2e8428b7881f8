"""How a run ends, through the real script: it keeps its model by default (also at
--exit-interval), its summary gives the final and best validation loss and commands that work
when pasted (resume, train on, convert, export), and Ctrl-C is one line naming the iteration
and the last checkpoint, exit 130, with the plot written."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from scalevec_testing.trainer_flags import TINY

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "pretrain_gpt.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
LOUD = [f for f in TINY if f != "--quiet"]  # the summary is console output


def _run(cmd, cwd, timeout=240):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=ENV,
                          timeout=timeout)


def _advice(stdout: str, what: str) -> list:
    """The command of the summary's ``what:`` line, with this Python for ``python``."""
    (line,) = [x for x in stdout.splitlines() if x.startswith(f"  {what}: ")]
    cmd = shlex.split(line.split(": ", 1)[1].split("   #")[0])
    assert cmd[0] == "python", line
    return [sys.executable, *cmd[1:]]


def test_run_keeps_its_model_and_its_summary_commands_work(tmp_path):
    run = tmp_path / "run"  # no --save: the run dir keeps the checkpoint
    p = _run([sys.executable, SCRIPT, *LOUD, "--scalevec", "hg+dp+or", "--train-iters", "2",
              "--exit-interval", "1", "--eval-interval", "1", "--run-dir", str(run)], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (run / "iter_0000001").is_dir() and (run / "latest").read_text().strip() == "1"
    resume = _advice(p.stdout, "resume")
    assert "--exit-interval" not in resume and resume[-2:] == ["--load", str(run)]
    p = _run(resume, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and (run / "latest").read_text().strip() == "2"
    # the summary: final and best validation loss as metrics.jsonl has them, and the files
    vals = [(r["iteration"], r["val_loss"]) for r in map(json.loads, open(run / "metrics.jsonl"))
            if "val_loss" in r]
    best = min(vals, key=lambda v: v[1])
    done = [x for x in p.stdout.splitlines() if x.startswith("done in ")]
    assert done and (f"validation loss {vals[-1][1]:.4f} at iteration 2, best {best[1]:.4f} at "
                     f"iteration {best[0]}") in done[0], p.stdout
    assert re.search(rf"wrote {re.escape(str(run))}/: config.json, metrics.jsonl; checkpoint "
                     rf"{re.escape(str(run / 'iter_0000002'))}", p.stdout), p.stdout
    follow = {what: _run(_advice(p.stdout, what), tmp_path, timeout=400)
              for what in ("train on", "convert", "export")}
    for what, q in follow.items():
        assert q.returncode == 0, (what, q.stderr[-3000:])
    assert (run / "latest").read_text().strip() == "4"  # trained on to twice the iterations
    assert (tmp_path / "run-stock" / "metadata.json").is_file()  # exact fold, dist format
    assert (tmp_path / "run-hf" / "config.json").is_file()


def test_summary_without_checkpoint_says_so(tmp_path):
    run = tmp_path / "run"
    p = _run([sys.executable, SCRIPT, *LOUD, "--train-iters", "1", "--run-dir", str(run),
              "--no-save"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "no checkpoint (--no-save)" in p.stdout and not (run / "latest").exists()
    assert "resume:" not in p.stdout and "export:" not in p.stdout


def _wait_for(path, pred, proc, timeout=180):
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path) and pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {path}")


@pytest.mark.parametrize("keep", ["--save-interval", "--no-save"])
def test_ctrl_c_is_one_line_naming_the_last_checkpoint(tmp_path, keep):
    run = tmp_path / "run"
    flags = ["--save-interval", "2"] if keep == "--save-interval" else ["--no-save"]
    no_plot = [f for f in TINY if f not in ("--no-plot", "--quiet")]
    # as from a terminal: a test run started in the background of a script inherits SIGINT
    # ignored, and an ignored signal stays ignored across exec (Python then installs no
    # KeyboardInterrupt); a handled one is reset to the default, which Python turns into one
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, SCRIPT, *no_plot, "--quiet", "--train-iters",
                                 "100000", "--log-interval", "1", "--run-dir", str(run), *flags],
                                cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        metrics = run / "metrics.jsonl"
        _wait_for(metrics, lambda: len(metrics.read_text().splitlines()) >= 3, proc)
        if keep == "--save-interval":
            _wait_for(run / "latest", lambda: True, proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-3000:]
    m = re.fullmatch(r"interrupted after iteration (\d+) of 100000; (.*)", err.strip())
    assert m and int(m.group(1)) >= 3, err
    if keep == "--save-interval":
        latest = int((run / "latest").read_text())
        assert m.group(2).startswith(f"last checkpoint {run / f'iter_{latest:07d}'} (resume: ")
        assert m.group(2).endswith(f"--load {run})"), err
    else:
        assert m.group(2) == "no checkpoint kept (--no-save)", err
    assert (run / "loss.png").stat().st_size > 0  # the plot of what was logged
    assert not list(run.glob(".tmp_iter_*"))
