"""Smoke tests of the evidence tools: the ablation sweep end to end through the real trainer
(two strategies, two seeds, a few steps), resume, table formats and plots; the scaling fit on
known curves and its report on recorded runs."""

import csv
import json
import math
import os

import pytest

from megatron_scalevec.evidence import ablation, runner, scaling, stats

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "32", "--micro-batch-size", "2", "--eval-iters", "1"]


def test_ablation_sweep_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "abl")
    argv = ["--out", out, "--families", "dense", "--strategies", "shared", "hg", "--seeds", "2",
            "--train-iters", "4", "--eval-interval", "2", "--lr-sweep", "--no-width-matched",
            *TINY]
    rows = ablation.main(argv)
    assert [r["variant"] for r in rows] == ["shared", "hg"]
    with open(os.path.join(out, "results.csv")) as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ablation.CSV_COLUMNS
    assert [t["variant"] for t in table] == ["shared", "hg"]
    hg = table[1]
    assert int(hg["seeds"]) == 2 and float(hg["diff_lo"]) <= float(hg["diff_mean"]) \
        <= float(hg["diff_hi"])
    # paired seeds: hg computes shared's function at init, so the first loss is identical
    assert float(hg["iter1_dev"]) == 0.0
    assert int(hg["extra_params"]) > 0 and float(table[0]["diff_mean"]) == 0.0
    md = open(os.path.join(out, "results.md")).read().splitlines()
    assert md[2] == ablation.MD_HEADER and md[3].count("---") == md[2].count("|") - 1
    assert md[4].startswith("| dense | shared |") and md[5].startswith("| dense | hg |")
    png = os.path.join(out, "ablation_dense.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # resume: nothing is re-run once every metrics file has the final iteration
    stamp = {k: os.path.getmtime(os.path.join(out, "dense", k, "seed1", "metrics.jsonl"))
             for k in ("shared", "hg")}
    os.remove(os.path.join(out, "dense", "hg", "seed2", "metrics.jsonl"))
    ablation.main(argv)
    for k, t in stamp.items():
        assert os.path.getmtime(os.path.join(out, "dense", k, "seed1", "metrics.jsonl")) == t
    assert runner.is_done(os.path.join(out, "dense", "hg", "seed2"), 4)


def test_is_done_needs_final_eval(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"iteration": 10, "loss": 1.0}) + "\n"
                                     + '{"iteration": 20, "val')  # cut by a kill
    assert not runner.is_done(str(d), 20)
    (d / "metrics.jsonl").write_text(json.dumps({"iteration": 20, "val_loss": 1.0}) + "\n")
    assert runner.is_done(str(d), 20) and not runner.is_done(str(d), 30)


def test_stats():
    assert stats.t975(2) == pytest.approx(4.303)
    m, h = stats.t_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and h == pytest.approx(4.303 / math.sqrt(3))
    n = stats.seeds_needed(0.01, 0.02)
    assert stats.t975(n - 1) * 0.02 / math.sqrt(n) < 0.01
    assert stats.t975(n - 2) * 0.02 / math.sqrt(n - 1) >= 0.01


def test_fits_recover_known_multiplier():
    cs = [1e12 * 2 ** k for k in range(5)]
    # log-linear with a common slope: unified needs 1/1.3 of shared's compute
    pts = {"shared": [(c, 7.0 - 0.1 * math.log(c)) for c in cs],
           "u": [(c, 7.0 - 0.1 * math.log(c * 1.3)) for c in cs]}
    method, mult, _ = scaling.multiplier(pts, "shared", "u", allow_power=False)
    assert method == "loglinear" and mult == pytest.approx(1.3, rel=1e-6)
    pts = {"shared": [(c, 50 * c ** -0.1 + 2.0) for c in cs],
           "u": [(c, 50 * (1.25 * c) ** -0.1 + 2.0) for c in cs]}
    method, mult, _ = scaling.multiplier(pts, "shared", "u")
    assert method == "power" and mult == pytest.approx(1.25, rel=0.05)


def _fake_run(d, iters, loss, params):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"iteration": 1, "loss_last": 8.0}) + "\n")
        f.write(json.dumps({"iteration": iters, "val_loss": loss}) + "\n")
    with open(os.path.join(d, "params.json"), "w") as f:
        json.dump({"total": params, "scale_vectors": 0}, f)


def test_scaling_report_on_recorded_runs(tmp_path):
    out = str(tmp_path / "sc")
    argv = ["--out", out, "--sizes", "1x16", "2x32", "--seeds", "2", "--bootstrap", "50"]
    a = scaling.build_parser().parse_args(argv)
    for r in scaling.runs_for(a):
        n = scaling.approx_params(*scaling._size(r.labels["size"]), 4096)
        gain = 0.05 if r.labels["strategy"] != "shared" else 0.0
        _fake_run(os.path.join(out, r.key), r.train_iters,
                  8.0 - 0.2 * math.log(n) - gain + 0.01 * r.labels["seed"], n)
    res = scaling.main(argv + ["--report-only"])
    assert res["method"] == "loglinear" and res["multiplier"] > 1.0
    assert res["lo"] <= res["multiplier"] <= res["hi"]
    md = open(os.path.join(out, "scaling.md")).read()
    assert "| 2x32 |" in md and "Compute multiplier" in md
    with open(os.path.join(out, "scaling.csv")) as f:
        assert len(list(csv.DictReader(f))) == 8
    assert open(os.path.join(out, "scaling.png"), "rb").read(4) == b"\x89PNG"
