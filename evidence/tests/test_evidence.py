"""Smoke tests of the evidence tools: the ablation sweep end to end through the real trainer
(two strategies, two seeds, a few steps), resume, table formats and plots; the scaling fit on
known curves and its report on recorded runs."""

import csv
import json
import math
import os

import pytest

from evidence import ablation, compare, runner, scaling, stats, tuned, tuning

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "32", "--micro-batch-size", "2", "--eval-iters", "1"]


def test_ablation_sweep_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "abl")
    argv = ["--out", out, "--fixed-lr", "--families", "dense", "--strategies", "shared", "hg",
            "--seeds", "2",
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
    argv = ["--out", out, "--sizes", "1x16", "2x32", "--seeds", "2", "--bootstrap", "50",
            "--fixed-lr"]
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


# ----------------------------------------------------------------------------- tuning logic
def test_lr_grid_and_extension():
    assert tuning.lr_grid(3e-3, 5) == [7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2]
    assert tuning.lr_grid(3e-3, 2) == [3e-3, 6e-3] and tuning.lr_grid(1e-3, 1) == [1e-3]
    assert tuning.lr_grid(6e-3, 3, factor=2) == [3e-3, 6e-3, 1.2e-2]
    assert tuning.extend([3e-3, 6e-3], "high") == [3e-3, 6e-3, 1.2e-2]
    assert tuning.extend([3e-3, 6e-3], "low") == [1.5e-3, 3e-3, 6e-3]
    with pytest.raises(ValueError, match="factor > 1"):
        tuning.lr_grid(3e-3, 3, factor=1.0)


def test_best_lr_and_edge():
    assert tuning.best_lr({1e-3: [5.0], 2e-3: [4.8, 4.9], 4e-3: [5.1]}) == (2e-3, "")
    assert tuning.best_lr({1e-3: [4.0], 2e-3: [4.8], 4e-3: [5.1]}) == (1e-3, "low")
    assert tuning.best_lr({1e-3: [5.0], 2e-3: [4.8], 4e-3: [4.1]}) == (4e-3, "high")
    # a diverged run (nan) never wins; ties go to the smaller LR
    assert tuning.best_lr({1e-3: [5.0], 2e-3: [4.8], 4e-3: [math.nan]}) == (2e-3, "")
    assert tuning.best_lr({1e-3: [math.nan], 2e-3: [4.8], 4e-3: [5.0]}) == (2e-3, "")
    assert tuning.best_lr({1e-3: [5.0], 2e-3: [4.8], 4e-3: [4.8]}) == (2e-3, "")
    assert tuning.best_lr({1e-3: [5.0]}) == (1e-3, "only")


def test_strongest_baseline_and_seeds_needed():
    assert tuning.strongest({"shared": 5.1, "shared+qknorm": 5.05, "stock": math.nan}) \
        == "shared+qknorm"
    with pytest.raises(ValueError, match="no baseline"):
        tuning.strongest({"stock": math.nan})
    need = tuning.seeds_for_effects(0.05)
    for e, n in need.items():  # the smallest n whose 95% half-width is below the effect
        assert stats.t975(n - 1) * 0.05 / math.sqrt(n) < e
        assert stats.t975(n - 2) * 0.05 / math.sqrt(n - 1) >= e
    assert need[0.02] > need[0.03] > 2
    assert math.isnan(tuning.seeds_for_effects(math.nan)[0.02])


def _tuned_args(out, *extra):
    return ablation.finish_args(ablation.build_parser().parse_args(
        ["--out", out, "--baselines", "shared", "shared+qknorm", "--candidates", "unified",
         "--lr-points", "3", "--max-extend", "1", "--seeds", "2", "--train-iters", "10",
         *extra]))


def test_tuned_plan_extends_edge_and_reports_strongest(tmp_path):
    """On recorded (fake) runs: an edge best grows the grid once, the comparison runs at the
    best LR on seeds 1..N with min-lr scaled, and the table measures against the strongest."""
    out = str(tmp_path / "t")
    a = _tuned_args(out)
    loss = {"shared": lambda lr: 5.0 + abs(math.log2(lr / 3e-3)) * 0.1,  # interior at 3e-3
            "shared+qknorm": lambda lr: 4.9 + abs(math.log2(lr / 6e-3)) * 0.1,  # interior
            "unified": lambda lr: 4.8 - lr}  # keeps improving: best at the high edge

    def fill(runs, bump=0.0):
        for r in runs:
            v = r.labels["variant"]
            _fake_run(os.path.join(out, r.key), r.train_iters,
                      loss[v](r.labels["lr"]) + bump * r.labels["seed"], 1000)

    runs, grids = tuned.tuning_plan(a, ablation._base_argv, out)
    assert {r.labels["lr"] for r in runs} == {1.5e-3, 3e-3, 6e-3}
    assert all(g[1] is None for g in grids.values())
    fill(runs)
    runs, grids = tuned.tuning_plan(a, ablation._base_argv, out)
    assert grids[("dense", "adam-cosine", "shared")][1][:2] == (3e-3, "")
    for v in ("shared+qknorm", "unified"):  # best at the high edge: one more point
        assert grids[("dense", "adam-cosine", v)][0] == [1.5e-3, 3e-3, 6e-3, 1.2e-2]
    fill([r for r in runs if not runner.is_done(os.path.join(out, r.key), r.train_iters)])
    _, grids = tuned.tuning_plan(a, ablation._base_argv, out)
    best = {k[2]: v[1][:2] for k, v in grids.items()}
    assert best == {"shared": (3e-3, ""), "shared+qknorm": (6e-3, ""),
                    "unified": (1.2e-2, "high")}  # still on the edge after --max-extend 1
    comp = tuned.comparison_runs(a, ablation._base_argv, out, grids)
    assert sorted(r.labels["seed"] for r in comp) == [1, 1, 1, 2, 2, 2]
    r = next(r for r in comp if r.labels["variant"] == "unified")
    assert r.argv[r.argv.index("--lr") + 1] == "0.012"
    assert r.argv[r.argv.index("--min-lr") + 1] == "0.0012"
    q = next(r for r in comp if r.labels["variant"] == "shared+qknorm")
    assert "--qk-layernorm" in q.argv and q.argv[q.argv.index("--scalevec") + 1] == "shared"
    fill(comp, bump=0.01)
    rows = tuned.report(a, ablation._base_argv, out, grids, log=lambda _: None)
    by = {r["variant"]: r for r in rows}
    assert by["unified"]["strongest"] == "shared+qknorm"
    d = by["unified"]["vs_strongest"]
    assert d["n"] == 2 and d["mean"] == pytest.approx(loss["unified"](1.2e-2) - 4.9)
    assert by["shared"]["vs_strongest"]["mean"] == pytest.approx(0.1)
    md = open(os.path.join(out, "tuned.md")).read()
    assert md.splitlines()[2] == tuned.TUNED_HEADER
    assert "| unified |" in md and "grid's high edge" in md
    assert "shared+qknorm (strongest baseline)" in md
    assert os.path.exists(os.path.join(out, "tuned_dense_adam-cosine.png"))


def test_tuned_settings_and_muon_note():
    a = _tuned_args("/nonexistent", "--settings", "adam-wsd", "muon-cosine")
    notes = []
    got = tuned.settings(a, log=notes.append)
    if tuned.muon_available():
        assert got == ["adam-wsd"] and "Muon rows skipped" in notes[0]
    else:
        assert got == ["adam-wsd", "muon-cosine"]
    r = tuned.make_run(a, ablation._base_argv, "dense", "adam-wsd", "shared", 3e-3, 1)
    assert r.argv[r.argv.index("--lr-decay-style") + 1] == "WSD"
    with pytest.raises(SystemExit, match="OPTIMIZER-SCHEDULE"):
        tuned.parse_setting("adamw-cosine")


def test_muon_lr_centres_only_the_muon_grids(tmp_path):
    a = _tuned_args(str(tmp_path), "--settings", "adam-wsd", "muon-wsd", "--muon-lr", "1.2e-2")
    assert tuned.centre_lr(a, "muon-wsd") == 1.2e-2 and tuned.centre_lr(a, "adam-wsd") == 3e-3
    assert tuned.centre_lr(_tuned_args(str(tmp_path)), "muon-cosine") == 3e-3  # default --lr
    runs, _ = tuned.tuning_plan(a, ablation._base_argv, str(tmp_path))
    lrs = {s: {r.labels["lr"] for r in runs if r.labels["setting"] == s} for s in a.settings}
    assert lrs["adam-wsd"] == {1.5e-3, 3e-3, 6e-3}
    if not tuned.muon_available():  # Muon rows run here (Python >= 3.12)
        assert lrs["muon-wsd"] == {6e-3, 1.2e-2, 2.4e-2}


def test_tuned_default_budget_is_2p5_tokens_per_param():
    a = ablation.finish_args(ablation.build_parser().parse_args([]))
    n = scaling.approx_params(a.num_layers, a.hidden_size, 4096)
    assert a.families == ["dense"] and not a.fixed_lr
    assert a.train_iters * a.seq_length * a.micro_batch_size >= 2.5 * n
    f = ablation.finish_args(ablation.build_parser().parse_args(["--fixed-lr"]))
    assert f.train_iters == 250 and f.families == ["dense", "moe"]


def test_compare_difference():
    base = [{10: 6.0, 20: 5.5, 30: 5.2, 40: 5.0}]
    cand = [{10: 5.9, 20: 5.4, 30: 5.1, 40: 4.95}]
    d = compare.difference(cand, base)  # one seed: over the second-half eval points
    assert d["its"] == [10, 20, 30, 40] and d["mean"][0] == pytest.approx(-0.1)
    assert d["final"] == pytest.approx(-0.075) and "one seed" in d["over"]
    m, h = stats.t_interval([-0.1, -0.05])
    assert (d["lo"], d["hi"]) == (pytest.approx(m - h), pytest.approx(m + h))
    d = compare.difference(cand + [{10: 6.0, 40: 5.0}], base + [{10: 6.1, 40: 5.2}])
    assert d["its"] == [10, 40] and "2 paired seeds" in d["over"]
    m, h = stats.t_interval([-0.05, -0.2])
    assert d["final"] == pytest.approx(m) and d["hi"] == pytest.approx(m + h)


def test_scaling_tuned_picks_lr_per_strategy_and_size(tmp_path):
    out = str(tmp_path / "sc")
    argv = ["--out", out, "--sizes", "1x16", "2x32", "--seeds", "2", "--bootstrap", "20"]
    a = scaling.build_parser().parse_args(argv)
    assert scaling.runs_for(a, out) == []  # nothing to compare before the grids finish
    tune = scaling.tuning_runs(a)
    assert {r.labels["lr"] for r in tune} == {1.5e-3, 3e-3, 6e-3}
    assert {r.labels["seed"] for r in tune} == {tuning.TUNE_SEED0 + 1}
    best_at = {"shared": 3e-3, "hg+dnp+or+iwd": 6e-3}  # unified's best on the high edge
    for r in tune:
        lab = r.labels
        _fake_run(os.path.join(out, r.key), r.train_iters,
                  5.0 + abs(math.log2(lab["lr"] / best_at[lab["strategy"]])), 100)
    comp = scaling.runs_for(a, out)
    assert sorted((r.labels["strategy"], r.labels["lr"]) for r in comp) == sorted(
        [("shared", 3e-3)] * 4 + [("hg+dnp+or+iwd", 6e-3)] * 4)
    for r in comp:
        n = scaling.approx_params(*scaling._size(r.labels["size"]), 4096)
        _fake_run(os.path.join(out, r.key), r.train_iters,
                  8.0 - 0.2 * math.log(n) - 0.01 * (r.labels["strategy"] != "shared"), n)
    scaling.main(argv + ["--report-only"])
    md = open(os.path.join(out, "scaling.md")).read()
    assert "shared 1x16 0.003;" in md
    assert "hg+dnp+or+iwd 2x32 0.006 (best at the grid's high edge)" in md


def test_recorded_sweeps_run_the_vectors_at_the_base_lr(tmp_path):
    """The sweeps RESULTS.md recorded before the x30 default (ablation, tuned, compare,
    scaling) still run every strategy's vectors at x1, as the trainer parses their argv."""
    from megatron_scalevec.training.arguments import parse_args

    a = _tuned_args(str(tmp_path / "t"), "--families", "dense")
    runs = ablation.all_runs(a, str(tmp_path / "t"))
    runs += tuned.tuning_plan(a, ablation._base_argv, str(tmp_path / "t"))[0]
    runs += scaling.tuning_runs(scaling.build_parser().parse_args(["--sizes", "1x16"]))
    runs.append(compare._run(compare.build_parser().parse_args([]), "unified", 3e-3, 1))
    seen = set()
    for r in runs:
        argv = [str(x) for x in r.argv]
        if "--spec" in argv and argv[argv.index("--spec") + 1] == "baseline":
            continue  # megatron-core's own spec: no vectors of ours
        cfg = parse_args(argv + ["--run-dir", str(tmp_path / "r")]).scalevec_config
        assert cfg.vector_lr_mult == 1.0, r.key
        seen.add(cfg.to_string())
    assert "hg+dnp+or+iwd" in seen  # unified, whose default is x30
