"""The vector-LR sweep's planning on recorded results (a known loss surface written as the
runs' metrics, no training): the base-LR grid grows past an edge best, the multiplier grid
likewise, the refinement tries the LR's neighbours at the best multiplier, tuning and
comparison seeds stay apart; the report's tables and figure. And one tiny sweep through the
real trainer, which must pass ``--vector-lr-mult`` on (its recorded config says so)."""

import json
import math
import os

from evidence import runner, tuning, vector_lr, vector_lr_report


def _args(*extra):
    return vector_lr.build_parser().parse_args(
        ["--widths", "64", "--variants", "shared", "unified", "--lr", "3e-3", *extra])


def loss(variant, lr, mult):
    """Best at LR 6e-3 (both) and multiplier 30 (shared) / 7 (unified); unified lower."""
    best_m = 30.0 if variant == "shared" else 7.0
    return (5.0 - 0.2 * (variant == "unified") + 0.3 * math.log(lr / 6e-3) ** 2
            + 0.05 * math.log(mult / best_m) ** 2)


def _record(root, run):
    d = os.path.join(root, run.key)
    os.makedirs(d, exist_ok=True)
    lab = run.labels
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"iteration": run.train_iters, "val_loss": loss(
            lab["variant"], lab["lr"], lab["mult"]) + 1e-3 * (lab["seed"] % 7)}) + "\n")


def _settle(a, root):
    for _ in range(20):  # each pass "runs" what the last one asked for
        plan = vector_lr.Plan(a, root).settle()
        todo = [r for r in plan.runs.values() if vector_lr.final(root, r) is None]
        if not todo:
            return plan
        for r in todo:
            _record(root, r)
    raise AssertionError("did not settle")


def test_plan_finds_the_best_pair_and_keeps_seeds_apart(tmp_path):
    a = _args("--mults", "1", "3", "7", "--max-extend", "3")
    plan = _settle(a, str(tmp_path))
    shared, unified = plan.state[(64, "shared")], plan.state[(64, "unified")]
    assert shared["lr0"] == unified["lr0"] == 6e-3 and shared["lr_edge"] == ""
    # shared's best (30) lies past the grid's high edge: the grid grew to it (and one beyond)
    assert shared["best"] == (6e-3, 28.0), shared["best"]
    assert sorted(shared["m_losses"])[-1] > 7 and unified["m"] == 7.0
    assert (tuning._round(6e-3 / 2), 7.0) in unified["pairs"]  # the refinement ran
    tune = {r.labels["seed"] for r in plan.runs.values()}
    comp = {r.labels["seed"] for r in plan.comparison_runs()}
    assert tune == {tuning.TUNE_SEED0 + 1} and comp == {1, 2, 3}
    labels = [c[2] for c in plan.comparison() if c[1] == "unified"]
    assert labels == ["tuned LR, vectors x1", "best pair"]  # shared's LR = its own: no row


def test_report_tables_and_figure(tmp_path):
    a = _args("--mults", "1", "3", "7", "30", "--user-mults", "1", "7", "--reference", "unified")
    root = str(tmp_path)
    plan = _settle(a, root)
    for r in plan.comparison_runs():
        _record(root, r)
    table = vector_lr_report.report(a, plan, root, log=lambda _: None)
    md = open(os.path.join(root, "vector_lr.md")).read()
    assert "| 64 | unified | best pair | 0.006 | 7 | 3 |" in md, md
    best = next(r for r in table if r["variant"] == "unified" and r["label"] == "best pair")
    assert best["vs_shared_best"]["mean"] < 0 and best["vs_own_x1"]["n"] == 3
    # the ablation's column: shared's best pair against unified's (0.2 worse by construction)
    ref = next(r for r in table if r["variant"] == "shared" and r["label"] == "best pair")
    assert abs(ref["vs_reference"]["mean"] - 0.2) < 0.01 and best["vs_reference"] is None
    assert "| Δ vs unified (best pair) |" in md and md.count("+0.2") >= 1, md
    png = os.path.join(root, "vector_lr.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    out = vector_lr_report.combine([os.path.join(root, "vector_lr.json")],
                                   str(tmp_path / "c.png"))
    assert os.path.getsize(out) > 1000


def test_tiny_sweep_through_the_trainer(tmp_path):
    root = str(tmp_path / "s")
    a = vector_lr.build_parser().parse_args([
        "--out", root, "--widths", "32", "--num-layers", "1", "--variants", "shared",
        "--mults", "1", "4", "--lr-points", "1", "--no-refine", "--tokens-per-param", "0.01",
        "--seq-length", "16", "--micro-batch-size", "2", "--eval-iters", "1", "--seeds", "1"])
    plan = vector_lr.execute(a, root, log=lambda _: None)
    assert plan.settled
    run = vector_lr.make_run(a, 32, "shared", 3e-3, 4.0, tuning.TUNE_SEED0 + 1)
    with open(os.path.join(root, run.key, "config.json")) as f:
        assert json.load(f)["vector_lr_mult"] == 4.0  # what the trainer ran with
    assert runner.is_done(os.path.join(root, run.key), run.train_iters)
