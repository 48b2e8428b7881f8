"""Faults and bad input: divergence stops the run, corrupt or crafted checkpoints are
refused with one line, checkpoint writers die with a killed trainer, bad flags and checkpoints
of another model fail before the model is built."""

import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_scalevec.training.arguments import ArgumentError, parse_args
from scalevec_testing.distributed import RankError, run_on_ranks
from scalevec_testing.trainer_flags import CLI_ENV, OVR, ROOT, TINY, run_cli, run_trainer


def _run(*flags, run_dir, world=1):
    return run_on_ranks(run_trainer, world, TINY + ["--run-dir", str(run_dir)] + list(flags),
                        timeout=180)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-iteration run saved at iteration 2 (copied by each test that damages it)."""
    base = tmp_path_factory.mktemp("saved")
    _run("--train-iters", "2", "--save", str(base / "ck"), run_dir=base / "run")
    return base / "ck"


@pytest.fixture
def ck(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def test_divergence_stops_with_message_and_no_checkpoint(tmp_path):
    """--lr 1e3: exit 3 with the iteration and parameter names; latest stays on a finite
    checkpoint; metrics.jsonl is strict JSON and marks the step; the start-up summary and the
    progress line are there; the TE/Apex warnings are one line."""
    ck = tmp_path / "ck"
    p = run_cli(*[f for f in TINY if f != "--quiet"], "--lr", "1e3", "--train-iters", "40",
             "--save", str(ck), "--save-interval", "1", "--log-interval", "1",
             "--run-dir", str(tmp_path / "run"))
    assert p.returncode == 3, p.stderr[-3000:]
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    m = re.search(r"training diverged at iteration (\d+): loss (is nan|is inf|\S+); non-finite "
                  r"gradients in \S+", err[0])
    assert m, err[0]
    bad = int(m.group(1))
    latest = int((ck / "latest").read_text())
    assert latest == bad - 1 and not (ck / f"iter_{bad:07d}").exists()
    recs = [json.loads(x, parse_constant=lambda c: pytest.fail(f"bare {c} in JSONL"))
            for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert recs[-1]["iteration"] == bad and "diverged" in recs[-1]
    assert recs[-1]["nonfinite"] and recs[-1][recs[-1]["nonfinite"][0]] is None
    out = p.stdout
    assert "---- arguments ----" in out and re.search(r"parameters: [\d,]+ total, [\d,]+ in "
                                                      r"scale vectors", out)
    assert re.search(r"elapsed \d+:\d\d:\d\d \| \d+ ms/it", out) and "layout: world 1" in out
    assert (out + p.stderr).count("not installed") <= 1


def test_no_check_still_never_saves_nonfinite_params(tmp_path):
    with pytest.raises(RankError, match="parameters are non-finite at iteration"):
        _run("--lr", "1e3", "--train-iters", "40", "--no-check-for-nan-in-loss-and-grad",
             "--save", str(tmp_path / "ck"), "--save-interval", "1", run_dir=tmp_path / "r")
    latest = int((tmp_path / "ck" / "latest").read_text())
    assert latest >= 1 and max(int(d.name[5:]) for d in (tmp_path / "ck").glob("iter_*")) \
        == latest


def test_flipped_byte_is_refused_naming_the_file(ck, tmp_path):
    f = ck / "iter_0000002" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    p = run_cli(*TINY, "--train-iters", "4", OVR, "--load", str(ck), "--run-dir",
                str(tmp_path / "r"))
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert re.fullmatch(r"error: checkpoint verification failed: \S+__0_0\.distcp: checksum "
                        r"mismatch.*--no-verify-checkpoint skips this check",
                        p.stderr.strip().splitlines()[-1])


def test_truncated_and_deleted_files_give_one_line(ck, tmp_path):
    it = ck / "iter_0000002"
    victim = sorted(it.glob("__*.distcp"))[-1]  # 0.16 writes two per rank, 0.19 one
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(RankError, match=re.escape(victim.name) + r": 100 bytes, \d+ when written"):
        _run("--train-iters", "4", OVR, "--load", str(ck), "--no-verify-checkpoint",
             run_dir=tmp_path / "r1")
    (it / "scalevec_manifest.json").unlink()  # unverified: DCP's own error, as one line
    # 0.16 fails in the tensor load; 0.19 already reading the common state inside the files
    with pytest.raises(RankError, match=r"(loading failed \(corrupt, incomplete, or a "
                                        r"different model\)|not a readable dist_checkpointing "
                                        r"checkpoint \(corrupt or incomplete\)): rank 0: \w+"):
        _run("--train-iters", "4", OVR, "--load", str(ck), run_dir=tmp_path / "r2")
    (it / ".metadata").unlink()
    with pytest.raises(RankError, match=r"(loading failed|corrupt or incomplete).*rank 0"):
        _run("--train-iters", "4", OVR, "--load", str(ck), run_dir=tmp_path / "r3")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_cannot_run_code(ck, tmp_path):
    """A .metadata that would run a shell command (its manifest entry removed, as an attacker
    would) is refused by the data-only unpickler; the command never runs."""
    marker = tmp_path / "pwned"
    it = ck / "iter_0000002"
    (it / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    man = json.loads((it / "scalevec_manifest.json").read_text())
    del man["files"][".metadata"]
    (it / "scalevec_manifest.json").write_text(json.dumps(man))
    with pytest.raises(RankError, match="refusing to load posix.system"):
        _run("--train-iters", "4", OVR, "--load", str(ck), run_dir=tmp_path / "r")
    assert not marker.exists()


def test_no_code_on_load_forces_weights_only(tmp_path):
    """torch's DCP planner loads sharded objects with weights_only=False; inside the guard
    every torch.load is weights-only, and the old numpy RNG state still loads."""
    import numpy as np

    from megatron_scalevec.convert.safe_load import no_code_on_load

    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"x": _RunsCode(marker)}, buf)
    old = io.BytesIO()
    torch.save({"numpy": np.random.get_state()}, old)
    with no_code_on_load():
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        old.seek(0)
        assert torch.load(old, weights_only=False)["numpy"][0] == "MT19937"
    assert not marker.exists()


def test_the_guard_leaves_megatron_cores_allowed_globals(tmp_path):
    """megatron-core allow-lists its checkpoints' classes (argparse.Namespace, numpy's) at
    import; torch's safe_globals context removes what it names on exit, so a guard that named
    them would break Megatron-LM's next load of its own common.pt (seen in
    tests/megatron_lm/test_checkpoints.py's resume)."""
    import argparse

    import megatron.core  # noqa: F401 -- registers its safe globals

    from megatron_scalevec.convert.safe_load import allowed_globals, no_code_on_load

    before = set(torch.serialization.get_safe_globals())
    assert argparse.Namespace in before
    with no_code_on_load(), allowed_globals([argparse.Namespace, int]):
        pass
    assert set(torch.serialization.get_safe_globals()) == before
    buf = io.BytesIO()
    torch.save({"args": argparse.Namespace(a=1)}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["args"].a == 1


def test_other_model_is_refused_before_build(ck, tmp_path, monkeypatch):
    for flags, msg in ((["--ffn-hidden-size", "128"], "ffn_hidden_size 64 (this run 128)"),
                       (["--untie-embeddings-and-output-weights"],
                        "untie_embeddings_and_output_weights False (this run True)"),
                       (["--scalevec", "hg+dnp+or"], "only IWD differs")):
        with pytest.raises(RankError, match=re.escape(msg)):
            _run("--train-iters", "4", OVR, "--load", str(ck), *flags, run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_newer_megatron_checkpoint_names_both_versions(ck, tmp_path):
    """A checkpoint of megatron-core 0.19 (common state inside the torch_dist files, no
    common.pt) in a megatron-core that reads only common.pt."""
    from megatron.core.dist_checkpointing import serialization

    if hasattr(serialization, "_legacy_common_state_exists"):
        pytest.skip("this megatron-core reads both layouts")
    it = ck / "iter_0000002"
    (it / "common.pt").unlink()
    man = json.loads((it / "scalevec_manifest.json").read_text())
    man["megatron_core"] = "0.19.2"
    del man["files"]["common.pt"]
    (it / "scalevec_manifest.json").write_text(json.dumps(man))
    with pytest.raises(RankError, match=r"written by megatron-core 0\.19\.2, which stores the "
                                        r"common state .* installed megatron-core 0\.16\.1"):
        _run("--train-iters", "4", OVR, "--load", str(ck), run_dir=tmp_path / "r")


def test_train_iters_one(tmp_path):
    assert len(_run("--train-iters", "1", run_dir=tmp_path)) == 1


@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "64", "--max-position-embeddings", "32"],
     "--seq-length 64 > --max-position-embeddings 32"),
    (["--lr", "-1"], "--lr -1.0 must be > 0"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr 0.001 must be between 0 and --lr"),
    (["--expert-vectors", "shared"], "--expert-vectors shared applies to MoE experts"),
])
def test_more_bad_flags(tmp_path, flags, message):
    with pytest.raises(ArgumentError, match=re.escape(message)):
        parse_args(TINY + ["--run-dir", str(tmp_path / "r")] + flags)
    assert not (tmp_path / "r").exists()


def test_save_pointing_at_a_file_exits_2(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ArgumentError, match="is an existing file"):
        parse_args(TINY + ["--save", str(f)])


def test_run_dir_never_silently_reused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ArgumentError, match="holds another run"):
        parse_args(TINY + ["--run-dir", str(run)])
    parse_args(TINY + ["--run-dir", str(run), "--overwrite"])
    save = tmp_path / "save"
    save.mkdir()
    (save / "latest").write_text("2\n")
    with pytest.raises(ArgumentError, match="holds another run's checkpoints"):
        parse_args(TINY + ["--run-dir", str(tmp_path / "r2"), "--save", str(save)])
    parse_args(TINY + ["--run-dir", str(run), "--save", str(save), "--load", str(save)])
    a = parse_args([f for f in TINY if f != "--quiet"])
    b = parse_args([f for f in TINY if f != "--quiet"] + ["--scalevec", "hg+dp+er"])
    assert a.run_dir != b.run_dir and "hg_dp_er" in b.run_dir and "l2-h32" in b.run_dir


def test_writer_processes_die_with_a_killed_trainer(tmp_path):
    """kill -9 of the trainer while megatron's writer processes are saving: they are gone
    within 5 s (PR_SET_PDEATHSIG), not left holding the trainer's memory."""
    psutil = pytest.importorskip("psutil")
    flags = TINY + [  # many small tensors: the writers' results overfill their pipe
        "--num-layers", "24", "--train-iters", "200",
        "--save", str(tmp_path / "ck"), "--save-interval", "1", "--run-dir", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *flags],
                            cwd=ROOT, env=CLI_ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        parent = psutil.Process(proc.pid)
        deadline, kids = time.time() + 120, []
        while time.time() < deadline and not kids and proc.poll() is None:
            kids = parent.children(recursive=True)
            time.sleep(0.005)
        if not kids:  # from 0.19 (no common.pt) the save writes in-process, without writers
            saved = list((tmp_path / "ck").glob("iter_*"))
            assert saved and not (saved[0] / "common.pt").exists(), "no writer process seen"
            pytest.skip("this megatron-core's save starts no writer processes")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        _, alive = psutil.wait_procs(kids, timeout=5)
        assert not alive, [k.pid for k in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_metadata_guard_for_megatron_lm(tmp_path, monkeypatch):
    """What megatron_lm.install() puts into Megatron-LM's process: DCP's .metadata reader
    refuses pickled code."""
    import torch.distributed.checkpoint.filesystem as fs

    from megatron_scalevec.convert.safe_load import install_metadata_guard

    monkeypatch.setattr(fs, "pickle", fs.pickle)  # restored after the test
    install_metadata_guard()
    marker = tmp_path / "pwned"
    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        fs.pickle.load(io.BytesIO(pickle.dumps(_RunsCode(marker))))
    assert not marker.exists()


HELD = """
import os, signal, multiprocessing as mp
from megatron_scalevec.training import faults
done = []
try:
    with faults.interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        writer = mp.get_context("fork").Process(target=int)  # a fork, as the writer's
        writer.start()
        writer.join()
        done.append("published")
except KeyboardInterrupt:
    print("raised after", done)
try:
    with faults.interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        done.append("unreachable")
except KeyboardInterrupt:
    print("second raised", done, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_ctrl_c_during_a_save_is_raised_once_it_is_published():
    """The trainer's save holds Ctrl-C: raised inside megatron-core's writer forks, it could
    be swallowed in a fork hook and hang the next fork; a second Ctrl-C raises at once."""
    p = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, env=CLI_ENV,
                       timeout=120, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                     signal.SIG_DFL))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines() == ["raised after ['published']",
                                     "second raised ['published'] True"], p.stdout + p.stderr
