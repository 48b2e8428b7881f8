"""What a run reports agrees with itself: the parameter counts are the model's at
every layout, the decay table states the decay each rule applies, and after a resume
``metrics.jsonl`` continues from the checkpoint's iteration without the stopped run's rows."""

import json
import os
import shutil

import pytest

from scalevec_testing import run_on_ranks
from scalevec_testing.trainer_flags import TINY, run_trainer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root

MOE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
       "--num-attention-heads", "4", "--seq-length", "16", "--sequence-parallel"]


def _counts(rank, world, tp, ep, extra, run_dir):
    from megatron_scalevec.training import build, summary
    from megatron_scalevec.training.arguments import parse_args
    from scalevec_testing.distributed import init_model_parallel

    a = parse_args(MOE + ["--tensor-model-parallel-size", str(tp),
                          "--expert-model-parallel-size", str(ep), "--run-dir", run_dir,
                          *extra], world_size=world)
    init_model_parallel(tp=tp, ep=ep)
    model = build.build_model(a, build.transformer_config(a, 64), 64)
    return summary.parameter_counts(model if isinstance(model, list) else [model], "cpu")


@pytest.mark.parametrize("extra", [[], ["--expert-vectors", "shared"]])
def test_parameter_counts_do_not_depend_on_the_layout(extra, tmp_path):
    """Replicated vectors (expert vectors over expert-TP) are counted once, not per rank."""
    run = str(tmp_path / "r")
    one = run_on_ranks(_counts, 1, 1, 1, extra, run)[0]
    assert run_on_ranks(_counts, 2, 2, 1, extra, run)[0] == one, "TP=2"
    assert run_on_ranks(_counts, 2, 1, 2, extra, run)[0] == one, "EP=2"


def _table(rank, world, strategy, svwd):
    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.optim import decay_rules, decay_summary
    from scalevec_testing.distributed import init_model_parallel
    from scalevec_testing.models import build_gpt, tiny_config

    init_model_parallel()
    cfg = ScaleVecConfig.from_string(strategy, scale_vector_weight_decay=svwd)
    model = build_gpt(tiny_config(), cfg)
    return decay_summary(decay_rules(cfg, 0.1), [model], 0.1, cfg)


def _rows(table: str) -> dict:
    return {line.split()[0]: float(line.split()[1]) for line in table.splitlines()[2:]}


def test_decay_table_states_what_each_rule_applies():
    plain = run_on_ranks(_table, 1, "hg+dp+er", None)[0]  # no IWD: vectors never decay
    assert "scale-vector wd" not in plain.splitlines()[0], plain
    # megatron-core's own default (other_1d, matrices) after the vectors' own rule (their LR)
    assert _rows(plain) == {"vectors": 0.0, "other_1d": 0.0, "matrices": 0.1}, plain
    iwd = _rows(run_on_ranks(_table, 1, "unified", 0.05)[0])
    assert iwd["input_vectors"] == 0.05 and iwd["matrices"] == 0.1, iwd
    assert iwd["output_vectors"] == iwd["input_directions"] == 0.0, iwd


def _iterations(run) -> list:
    with open(run / "metrics.jsonl") as f:
        return [r["iteration"] for r in map(json.loads, f) if "loss" in r]


def test_metrics_continue_from_the_checkpoint_after_a_resume(tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    flags = TINY + ["--log-interval", "1", "--run-dir", str(run), "--save", str(ck),
                    "--train-iters", "4"]
    run_on_ranks(run_trainer, 1, flags + ["--save-interval", "2"], timeout=180)
    assert _iterations(run) == [1, 2, 3, 4]
    (ck / "latest").write_text("2")  # as if killed after the checkpoint of iteration 2
    shutil.rmtree(ck / "iter_0000004")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 5, "lo')  # and mid-write
    run_on_ranks(run_trainer, 1, flags + ["--load", str(ck)], timeout=180)
    assert _iterations(run) == [1, 2, 3, 4], _iterations(run)


def _stats(rank, world):
    import math

    from benchmarks.host_syncs import count_host_syncs
    from megatron_scalevec.training.monitor import scale_vector_stats
    from megatron_scalevec.vectors import ScaleVector
    from scalevec_testing import init_model_parallel
    from scalevec_testing import models as M

    init_model_parallel()
    model = M.build_gpt(M.tiny_config(num_moe_experts=4, moe_router_topk=2,
                                      moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.0),
                        "hg+dnp+or")
    M.perturb_vectors(model)
    got = count_host_syncs(lambda: scale_vector_stats([model]))
    want = {}  # each vector's norm and OR magnitude, read directly
    for name, vec in model.named_modules():
        if isinstance(vec, ScaleVector) and vec.enabled:
            want[f"sv/{name}/norm"] = math.sqrt(float(vec().double().pow(2).sum()))
            if vec.parameterization == "or":
                want[f"sv/{name}/beta"] = float(vec.magnitude)
    return got["counts"], got["result"], want


def test_vector_statistics_read_the_host_once():
    """Every --log-interval's scale-vector statistics (hundreds of vectors with many experts)
    are one host read, not one per vector, and equal each vector's own values."""
    counts, stats, want = run_on_ranks(_stats, 1)[0]
    host_reads = sum(n for kind, n in counts.items() if kind in ("download", "sync"))
    assert host_reads == 1, counts
    assert len(want) > 20 and set(want) <= set(stats), sorted(set(want) - set(stats))
    assert all(abs(stats[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in want.items())
    assert any(k.endswith("/conservation") for k in stats)


def test_tensorboard_dir_writes_the_scalars(tmp_path):
    """The extra ``.[tensorboard]`` (in the test extra) makes --tensorboard-dir write events."""
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    run_on_ranks(run_trainer, 1, TINY + ["--train-iters", "2", "--run-dir", str(tmp_path / "r"),
                                         "--no-save", "--tensorboard-dir", str(tb)],
                 timeout=180)
    events = list(tb.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 100


def test_tensorboard_dir_without_tensorboard_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    from megatron_scalevec.training import arguments

    real = importlib.util.find_spec
    monkeypatch.setattr(arguments.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(arguments.ArgumentError, match=r"megatron_scalevec\[tensorboard\]"):
        arguments.parse_args(TINY + ["--run-dir", str(tmp_path / "r"), "--tensorboard-dir",
                                     str(tmp_path / "tb")])
    assert not (tmp_path / "r").exists()
