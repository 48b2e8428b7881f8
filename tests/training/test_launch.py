"""Multi-node launches simulated on one machine: examples/torchrun.sh as two torchrun
agents ("nodes") on loopback, one process each, with a checkpoint saved on one launch and
resumed on the next; a node killed mid-run ends the other with a clear message; the SLURM
script's launch command."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from scalevec_testing.distributed import free_port

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root
BIN = os.path.dirname(sys.executable)
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "torchrun")),
                                reason="no torchrun beside this python")


def _nodes(run_dir, port, *extra, iters=8):
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, NNODES="2", NODE_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GPUS_PER_NODE="1", MODEL="tiny", ITERS=str(iters),
                   RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   PATH=BIN + os.pathsep + os.environ["PATH"])
        procs.append(subprocess.Popen(
            ["bash", "examples/torchrun.sh", "--distributed-timeout-minutes", "1", *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
    return procs


def _kill_tree(p):
    """The agent and its workers (torchrun starts each worker in a session of its own)."""
    import psutil

    try:
        tree = psutil.Process(p.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for q in [p, *tree]:
        try:
            os.kill(q.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(procs, timeout=240):
    out = []
    try:
        for p in procs:
            out.append((p.wait(timeout),) + p.communicate())
    finally:
        for p in procs:
            _kill_tree(p)
    return out


def test_two_nodes_save_then_resume(tmp_path):
    first = _wait(_nodes(tmp_path, free_port(), "--exit-interval", "4"))
    assert [rc for rc, *_ in first] == [0, 0], first[0][2][-3000:] + first[1][2][-3000:]
    ck = tmp_path / "checkpoints"
    assert (ck / "latest").read_text().strip() == "4"
    second = _wait(_nodes(tmp_path, free_port()))
    assert [rc for rc, *_ in second] == [0, 0], second[0][2][-3000:]
    assert "resumed from" in second[0][1] and "at iteration 4" in second[0][1]
    recs = [json.loads(x) for x in open(ck / "metrics.jsonl")]
    assert [r["iteration"] for r in recs][-1] == 8
    assert (ck / "latest").read_text().strip() == "8"
    assert "layout: world 2" in second[0][1]


def test_dead_node_ends_the_job_with_a_message(tmp_path):
    procs = _nodes(tmp_path, free_port(), iters=100000)
    try:
        metrics = tmp_path / "checkpoints" / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and procs[0].poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        assert metrics.exists(), "the two-node run did not start"
        _kill_tree(procs[1])  # node 1: its agent and its worker
        t0 = time.time()
        rc = procs[0].wait(120)
        _, err = procs[0].communicate()
        assert rc != 0 and time.time() - t0 < 120
        assert "lost contact with another rank" in err, err[-3000:]
    finally:
        for p in procs:
            _kill_tree(p)


def test_slurm_launch_command(tmp_path):
    """SLURM variables in, one srun + torchrun line out, and the trainer accepts its flags."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nprintf 'node-a\\nnode-b\\n'\n")
    (fake / "srun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/srun.args\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_NUM_NODES="2", SLURM_JOB_ID="77",
               SLURM_GPUS_PER_NODE="8", SLURM_SUBMIT_DIR=ROOT, MODEL="dense-1b",
               DATA_PATH="/data/corpus_text_document", TOKENIZER_MODEL="/data/spm.model",
               RUN_DIR=str(tmp_path / "run"))
    p = subprocess.run(["bash", "examples/slurm.sbatch", "--seed", "7"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    line = shlex.join(args)
    assert args[:2] == ["--kill-on-bad-exit=1", "torchrun"]
    for part in ("--nproc-per-node 8", "--nnodes 2", "--rdzv-id 77", "--rdzv-backend c10d",
                 "--rdzv-endpoint node-a:6000", "pretrain_gpt.py"):
        assert part in line, line
    from megatron_scalevec.training.arguments import parse_args

    trainer_args = args[args.index("pretrain_gpt.py") + 1:]
    assert trainer_args[-2:] == ["--seed", "7"]
    a = parse_args(trainer_args, world_size=16)
    assert a.tensor_model_parallel_size == 2 and a.data_parallel_size == 8 and a.seed == 7


def test_two_nodes_with_their_own_home_directories(tmp_path, small_corpus, spm_model):
    """Nodes that share no home directory (two torchrun agents, HOME apart): the index cache is
    built beside the data (a directory both see), never under ~/.cache, and the run trains."""
    from megatron_scalevec.training.preprocess import preprocess

    data = tmp_path / "data"
    data.mkdir()
    preprocess([small_corpus], str(data / "corpus"), spm_model, progress=False)
    port, procs = free_port(), []
    for rank in (0, 1):
        home = tmp_path / f"home{rank}"
        home.mkdir()
        env = dict(os.environ, HOME=str(home), OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
                   MEGATRON_SCALEVEC_TINY="1", PATH=BIN + os.pathsep + os.environ["PATH"])
        procs.append(subprocess.Popen(
            [os.path.join(BIN, "torchrun"), "--nnodes", "2", "--node-rank", str(rank),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "pretrain_gpt.py", "--spec", "scalevec_dense", "--data-path",
             str(data / "corpus_text_document"), "--tokenizer-model", spm_model,
             "--run-dir", str(tmp_path / "run"), "--distributed-timeout-minutes", "1"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = _wait(procs)
    assert [rc for rc, *_ in out] == [0, 0], out[0][2][-3000:] + out[1][2][-3000:]
    assert list((data / "corpus_text_document" / "cache").glob("GPTDataset_indices/*.npy"))
    for rank in (0, 1):
        assert not (tmp_path / f"home{rank}" / ".cache" / "megatron_scalevec").exists()
