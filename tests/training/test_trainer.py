"""The trainer end to end on forked gloo ranks: loss goes down, exact resume, resume at another
layout, clear errors for bad flags and bad checkpoints, and one real torchrun launch."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_scalevec.training.arguments import ArgumentError, parse_args
from scalevec_testing.distributed import RankError, run_on_ranks
from scalevec_testing.trainer_flags import OVR, TINY, run_trainer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root


def _run(world, *flags, run_dir):
    return run_on_ranks(run_trainer, world, TINY + ["--run-dir", str(run_dir)] + list(flags),
                        timeout=180)[0]


def test_two_ranks_loss_decreases(tmp_path):
    """TP=2, distributed optimizer not needed: 16 steps lower the loss clearly; metrics.jsonl
    holds loss, lr, grad norm, tokens/s, ETA and scale-vector statistics."""
    losses = _run(2, "--train-iters", "16", "--tensor-model-parallel-size", "2",
                  "--eval-interval", "8", "--eval-iters", "1", run_dir=tmp_path)
    assert len(losses) == 16
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    last = recs[-1]
    for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "eta_s"):
        assert key in last, key
    assert any(k.endswith("/conservation") for k in last)
    assert any(k.endswith("/beta") for k in last)


def test_kill_and_resume_gives_identical_losses(tmp_path):
    """DP=2 with the distributed optimizer: 8 steps straight == 4 steps, exit, resume to 8."""
    common = ["--train-iters", "8", "--use-distributed-optimizer"]
    straight = _run(2, *common, run_dir=tmp_path / "a")
    ck = tmp_path / "ck"
    first = _run(2, *common, "--exit-interval", "4", "--save", str(ck), run_dir=tmp_path / "b")
    assert (ck / "latest").read_text().strip() == "4"
    second = _run(2, *common, "--load", str(ck), "--save", str(ck), run_dir=tmp_path / "b")
    assert first + second == straight


def test_resume_tp2_to_tp1_continues_from_same_loss(tmp_path):
    """Save at TP=2 (2 ranks) after 4 steps, resume at TP=1 (1 rank): the next losses match
    the straight TP=2 run up to reduction-order noise."""
    common = ["--train-iters", "6"]
    straight = _run(2, *common, "--tensor-model-parallel-size", "2", run_dir=tmp_path / "a")
    ck = tmp_path / "ck"
    _run(2, *common, "--tensor-model-parallel-size", "2", "--exit-interval", "4", "--save",
         str(ck), run_dir=tmp_path / "b")
    resumed = _run(1, *common, "--load", str(ck), run_dir=tmp_path / "c")
    assert len(resumed) == 2
    for a, b in zip(resumed, straight[4:]):
        assert abs(a - b) < 1e-4, (resumed, straight)


def test_grouped_gemm_experts_train_like_sequential(tmp_path, monkeypatch):
    """--moe-grouped-gemm: our grouped_mm experts run, and give the sequential experts' losses
    (same seed, same state-dict keys, so the same initial weights)."""
    from megatron_scalevec.layers.grouped import ScaleVecGroupedMLP

    marker, forward = tmp_path / "grouped_calls", ScaleVecGroupedMLP.forward

    def counted(self, *args):  # the ranks are forked: they inherit this patch
        with open(marker, "a") as f:
            f.write(".")
        return forward(self, *args)

    monkeypatch.setattr(ScaleVecGroupedMLP, "forward", counted)
    moe = ["--spec", "scalevec_moe", "--num-experts", "4", "--train-iters", "4"]
    seq = _run(1, *moe, run_dir=tmp_path / "seq")
    assert not marker.exists()
    grouped = _run(1, *moe, "--moe-grouped-gemm", run_dir=tmp_path / "grouped")
    assert marker.exists()
    assert len(grouped) == 4 and grouped[-1] < grouped[0]
    for a, b in zip(seq, grouped):
        assert abs(a - b) <= 1e-5 * abs(a), (seq, grouped)


def test_bad_checkpoints_fail_clearly(tmp_path):
    ck = tmp_path / "ck"
    _run(1, "--train-iters", "2", "--save", str(ck), run_dir=tmp_path / "r")
    with pytest.raises(RankError, match="trained with scale-vector strategy 'hg\\+dnp\\+or\\+iwd'"):
        _run(1, "--train-iters", "4", OVR, "--load", str(ck), "--scalevec", "hg+dp+er",
             run_dir=tmp_path / "r2")
    # an interrupted later save leaves a temp dir behind: the last good one still loads
    shutil.copytree(ck / "iter_0000002", ck / ".tmp_iter_0000004")
    (ck / ".tmp_iter_0000004" / "metadata.json").write_text("{broken")
    losses = _run(1, "--train-iters", "3", OVR, "--load", str(ck), run_dir=tmp_path / "r3")
    assert len(losses) == 1
    # common.pt on megatron-core 0.16; from 0.19 the common state is inside the torch_dist files
    name = "common.pt" if (ck / "iter_0000002" / "common.pt").exists() else "metadata.json"
    (ck / "iter_0000002" / name).write_bytes(b"garbage")
    with pytest.raises(RankError, match=f"{name}: 7 bytes, [0-9]+ when written"):
        _run(1, "--train-iters", "4", OVR, "--load", str(ck), run_dir=tmp_path / "r4")
    (ck / "iter_0000002" / "scalevec_manifest.json").unlink()  # an unverified checkpoint
    with pytest.raises(RankError, match="corrupt or incomplete"):
        _run(1, "--train-iters", "4", OVR, "--load", str(ck), run_dir=tmp_path / "r4")
    (ck / "latest").write_text("7\n")
    with pytest.raises(RankError, match="points to iteration 7"):
        _run(1, "--train-iters", "8", "--load", str(ck), run_dir=tmp_path / "r5")


# Megatron-LM's FP8 flags (core_v0.16.1 to core_v0.19.x megatron/training/arguments.py), read
# from its source: flag -> (default, choices)
MEGATRON_LM_FP8 = {
    "fp8_format": (None, ("e4m3", "hybrid")),
    "fp8_recipe": ("delayed", ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")),
    "fp8_margin": (0, None),
    "fp8_amax_history_len": (1, None),
    "fp8_amax_compute_algo": ("most_recent", ("most_recent", "max")),
}


def test_fp8_flags_are_megatron_lms_and_reach_the_config(tmp_path):
    """Our trainer's FP8 flags have Megatron-LM's names, defaults and choices, and become the
    TransformerConfig fields Megatron-LM sets from them (FP8 off: none set)."""
    from megatron_scalevec.training import arguments, build

    parser = arguments.build_parser()
    actions = {a.dest: a for a in parser._actions}
    for dest, (default, choices) in MEGATRON_LM_FP8.items():
        assert actions[dest].default == default, dest
        assert (tuple(actions[dest].choices) if actions[dest].choices else None) == choices, dest
    args = parse_args(TINY + ["--run-dir", str(tmp_path / "r"), "--transformer-impl", "local"])
    assert build._fp8(args) == {}
    args.fp8_format, args.fp8_amax_history_len, args.fp8_amax_compute_algo = "hybrid", 1024, "max"
    assert build._fp8(args) == dict(fp8_recipe="delayed", fp8_margin=0,
                                    fp8_amax_history_len=1024, fp8_amax_compute_algo="max")


@pytest.mark.parametrize("flags, world, message", [
    (["--spec", "llama"], 1, "--spec 'llama' is unknown"),
    (["--hidden-size", "30"], 1, "not divisible by --num-attention-heads"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     "--ffn-hidden-size 64 is not divisible|--num-query-groups 2 is not divisible"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6"),
    (["--load", "/nonexistent/ckpt"], 1, "no such directory"),
    (["--scalevec", "hg+banana"], 1, "unknown scale-vector variant 'banana'"),
    (["--spec", "baseline", "--scalevec", "unified"], 1, "--spec baseline"),
    (["--lr-decay-style", "step"], 1, "invalid choice"),
    (["--fp8-format", "hybrid", "--transformer-impl", "local"], 1, "--fp8-format needs"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"], 1,
     "--fp8-recipe blockwise is not supported"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "custom"], 1, "--fp8-recipe custom is not supp"),
    (["--fp8-amax-compute-algo", "mean"], 1, "invalid choice"),
    (["--moe-grouped-gemm"], 1, "--moe-grouped-gemm applies to MoE experts"),
    (["--fused-compile", "yes"], 1, "invalid choice"),
] + ([] if importlib.util.find_spec("transformer_engine") else [
    (["--transformer-impl", "transformer_engine"], 1, "needs Transformer Engine installed"),
]))
def test_bad_flags_fail_clearly_without_output(tmp_path, flags, world, message):
    run_dir = tmp_path / "run"
    with pytest.raises(ArgumentError, match=message):
        parse_args(TINY + ["--run-dir", str(run_dir)] + flags, world_size=world)
    assert not run_dir.exists()


def test_cli_exit_code_and_message(tmp_path):
    """The script itself: exit status 2, one clear line on stderr, nothing written."""
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--spec", "x",
                        "--run-dir", str(run_dir)], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2
    assert "--spec 'x' is unknown" in p.stderr and "Traceback" not in p.stderr
    assert not run_dir.exists()


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="no torchrun")
def test_torchrun_two_processes(tmp_path):
    """A real launch: torchrun --standalone, 2 processes (DP=2), loss goes down."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone",
           "--nproc-per-node", "2", os.path.join(ROOT, "pretrain_gpt.py"), *TINY,
           "--train-iters", "6", "--run-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=170)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert recs[-1]["iteration"] == 6 and recs[-1]["loss"] < recs[0]["loss"]


def test_virtual_pipeline_uses_unbatched_p2p(tmp_path):
    """Under VPP the trainer, as Megatron-LM, sends p2p unbatched: batched, interleaved PP2
    crosses an activation and a gradient on gloo (tests/parity/test_layouts.py shows the wrong
    loss); PP2 x VPP2 then trains, saves and resumes."""
    from megatron_scalevec.training.build import transformer_config

    pp = ["--num-layers", "4", "--pipeline-model-parallel-size", "2"]
    plain = parse_args(TINY + pp + ["--run-dir", str(tmp_path / "a")], world_size=2)
    vpp = parse_args(TINY + pp + ["--virtual-pipeline-model-parallel-size", "2",
                                  "--run-dir", str(tmp_path / "b")], world_size=2)
    assert transformer_config(plain, 64).batch_p2p_comm is True
    assert transformer_config(vpp, 64).batch_p2p_comm is False
    losses = _run(2, *pp, "--virtual-pipeline-model-parallel-size", "2", "--train-iters", "8",
                  run_dir=tmp_path / "run")
    assert len(losses) == 8 and losses[-1] < losses[0], losses
    # its checkpoint (the run dir's, by default) holds both chunks of each stage and resumes
    more = _run(2, *pp, "--virtual-pipeline-model-parallel-size", "2", "--train-iters", "9",
                OVR, "--load", str(tmp_path / "run"), run_dir=tmp_path / "run")
    assert len(more) == 1 and (tmp_path / "run" / "latest").read_text().strip() == "9"
