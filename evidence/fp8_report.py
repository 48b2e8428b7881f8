"""``tools/fp8_numerics.py``: FP8 GEMM errors of every vector placement on trained checkpoints,
and a short FP8-emulated training comparison; writes CSV, a markdown report and one plot.

Default: train ``shared``, ``hg``, ``hg+dp``, ``unified`` with the embedded trainer
(``pretrain_gpt.py --scalevec X --save DIR --train-iters 60 --spec scalevec_dense
--num-layers 2 --micro-batch-size 4 --seq-length 64``: the default width, tokenizer and
corpus, dense, 2 layers and short sequences to keep it to minutes on two cores; pass
``--trainer-args ''`` for the default MoE), reused when present; measure them; then train
``shared`` and ``unified`` (folded) in fp32 and FP8 on the same small dense model.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import time

from evidence import fp8, fp8_run, runner

SMALL = "--spec scalevec_dense --num-layers 2 --micro-batch-size 4 --seq-length 64"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/fp8", help="checkpoints, CSV, report (resumable)")
    p.add_argument("--variants", nargs="*", default=list(fp8_run.VARIANTS))
    p.add_argument("--load", nargs="*", default=[],
                   help="also measure these trainer checkpoints (strategy read from them)")
    p.add_argument("--train-iters", type=int, default=60, help="checkpoint training length")
    p.add_argument("--trainer-args", default=SMALL,
                   help="model flags of the checkpoint runs ('': the embedded default MoE)")
    p.add_argument("--batches", type=int, default=1, help="validation micro-batches hooked")
    p.add_argument("--sigmas", nargs="*", type=float, default=[0.0, 1.0, 2.0, 3.0],
                   help="stress: gamma times exp(sigma z) per channel (0 = as trained)")
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "blockwise"])
    p.add_argument("--train-compare", nargs="*", default=["shared", "unified"],
                   help="strategies of the FP8 training comparison (empty: skip it)")
    p.add_argument("--mean-kept", action="store_true",
                   help="also train unified with the mean-kept fold (the mitigation)")
    p.add_argument("--compare-iters", type=int, default=60)
    p.add_argument("--compare-args", default=SMALL + " --seed 1 --eval-interval 1000",
                   help="trainer flags of the comparison runs")
    p.add_argument("--figure", default=None, help="also copy the plot here")
    return p


def _ratios(rows: list) -> dict:
    """(variant, sigma, recipe, branch) -> stock errors and each placement's error / stock's,
    per metric: mean over the layers (and experts), plus ``*_worst``: the largest ratio."""
    by = collections.defaultdict(dict)
    for r in rows:
        by[(r["variant"], r["sigma"], r["recipe"], r["branch"], r["module"])][r["placement"]] = r
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for (v, s, rec, b, _), per in by.items():
        key = (v, s, rec, b)
        st = per["stock"]
        for m in ("fwd", "dgrad", "wgrad"):
            out[key][f"stock_{m}"].append(st[m])
            for p in ("branch", "folded", "mean_kept"):
                out[key][f"{p}_{m}"].append(per[p][m] / st[m] if st[m] > 0 else 1.0)
    res = {}
    for k, d in out.items():
        res[k] = {m: sum(x) / len(x) for m, x in d.items()}
        for p in ("branch", "folded", "mean_kept"):
            res[k][f"{p}_worst"] = max(max(d[f"{p}_{m}"]) for m in ("fwd", "dgrad", "wgrad"))
            res[k][f"{p}_max"] = max(res[k][f"{p}_{m}"] for m in ("fwd", "dgrad", "wgrad"))
    return res


def _md_table(header: list, lines: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in ln) + " |" for ln in lines])


def report(rows: list, gammas: dict, compare: dict, args) -> tuple[str, bool]:
    """(markdown, whether folding raised any branch's error > 1.5x or the FP8 gap grew)."""
    rat = _ratios(rows)
    parts = ["### Trained input vectors (all distinct branch / pre-norm vectors)", "",
             _md_table(["variant", "entries std", "min", "max"],
                       [[v, f"{g['std']:.3f}", f"{g['min']:.3f}", f"{g['max']:.3f}"]
                        for v, g in gammas.items()])]
    summary = collections.defaultdict(list)
    for (v, s, rec, _b), d in rat.items():
        summary[(v, rec, s)].append(d)
    lines = []
    for (v, rec, s), ds in sorted(summary.items()):
        worst_b = max(ds, key=lambda d: d["folded_max"])
        lines.append([v, rec, f"{s:g}",
                      f"{sum(d['stock_fwd'] for d in ds) / len(ds):.4f}",
                      f"{worst_b['folded_max']:.2f}",
                      f"{max(d['folded_worst'] for d in ds):.2f}",
                      f"{max(d['branch_max'] for d in ds):.2f}",
                      f"{max(d['mean_kept_max'] for d in ds):.2f}"])
    parts += ["", "### Summary: error ratio to stock placement, worst branch", "",
              _md_table(["variant", "recipe", "stress sigma", "stock fwd error (mean)",
                         "folded÷stock", "folded, worst layer", "branch÷stock",
                         "mean_kept÷stock"], lines)]
    flag = False
    for sigma in sorted({k[1] for k in rat}):
        lines = []
        for (v, s, rec, b), d in sorted(rat.items(), key=lambda kv: kv[0]):
            if s != sigma:
                continue
            flag |= sigma == 0 and d["folded_max"] > 1.5
            lines.append([v, rec, b, f"{d['stock_fwd']:.4f}", f"{d['stock_dgrad']:.4f}",
                          f"{d['stock_wgrad']:.4f}", f"{d['folded_fwd']:.2f}",
                          f"{d['folded_dgrad']:.2f}", f"{d['folded_wgrad']:.2f}",
                          f"{d['folded_worst']:.2f}", f"{d['branch_max']:.2f}",
                          f"{d['mean_kept_max']:.2f} / {d['mean_kept_worst']:.2f}"])
        title = "as trained" if sigma == 0 else f"stress: gamma x exp({sigma:g} z)"
        parts += ["", f"### GEMM relative error vs fp32, {title}", "",
                  _md_table(["variant", "recipe", "branch", "stock fwd", "stock dgrad",
                             "stock wgrad", "folded÷stock fwd", "dgrad", "wgrad",
                             "folded worst layer", "branch÷stock", "mean_kept÷stock / worst"],
                            lines)]
    if compare:
        lines = []
        for name, c in compare.items():
            if "fp8" in c and "fp32" in c:
                early, late = fp8_run.loss_gap(c["fp8"], c["fp32"], 20)
                grew = late > early + 0.01
                flag |= grew and name != "shared"
                lines.append([name, f"{c['fp32'][-1]:.4f}", f"{c['fp8'][-1]:.4f}",
                              f"{early:+.4f}", f"{late:+.4f}"])
        parts += ["", "### FP8-emulated training (tensorwise, HYBRID), loss vs fp32", "",
                  _md_table(["run", "fp32 final loss", "FP8 final loss",
                             "gap, first 20 it.", "gap, last 20 it."], lines)]
    return "\n".join(parts) + "\n", flag


def plot(rows: list, compare: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    rat = _ratios([r for r in rows if r["recipe"] == "tensorwise"])
    for v in sorted({k[0] for k in rat}):
        pts = sorted((k[1], d["folded_max"]) for k, d in rat.items() if k[0] == v)
        by_sigma = collections.defaultdict(list)
        for s, x in pts:
            by_sigma[s].append(x)
        xs = sorted(by_sigma)
        ax0.plot(xs, [max(by_sigma[s]) for s in xs], marker="o", label=v)
    ax0.axhline(1.5, color="grey", ls="--", lw=0.8)
    ax0.set_xlabel("stress sigma (gamma x exp(sigma z))")
    ax0.set_ylabel("folded / stock error (layer mean), worst branch")
    ax0.set_title("QKV / fc1 GEMM, per-tensor current scaling")
    ax0.legend(fontsize=8)
    for name, c in compare.items():
        if "fp8" in c and "fp32" in c:
            d = [a - b for a, b in zip(c["fp8"], c["fp32"])]
            k = 10
            sm = [sum(d[max(0, i - k + 1):i + 1]) / len(d[max(0, i - k + 1):i + 1])
                  for i in range(len(d))]
            ax1.plot(range(1, len(d) + 1), sm, label=name)
    ax1.axhline(0, color="grey", lw=0.8)
    ax1.set_xlabel("iteration")
    ax1.set_ylabel("FP8 - fp32 training loss (10-it. mean)")
    ax1.set_title("FP8-emulated training, same seed and data")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _measure(ckpt: str, args, recipes, log) -> tuple[str, list, dict]:
    """(strategy, error rows, gamma stats) of one checkpoint; cached beside its measurement
    run, keyed by the checkpoint's iteration and the measuring flags."""
    variant, argv = fp8_run.checkpoint_argv(ckpt)
    run_dir = os.path.join(args.out, "measure", os.path.basename(os.path.normpath(ckpt)))
    from megatron_scalevec.training.checkpointing import read_latest  # noqa: PLC0415

    key = dict(ckpt=os.path.abspath(ckpt), iteration=read_latest(ckpt), batches=args.batches,
               sigmas=list(args.sigmas), recipes=list(args.recipes))
    cache = os.path.join(run_dir, "fp8_rows.json")
    got = runner.read_json(cache)
    if got and got.get("key") == key:
        log(f"[fp8] {variant}: measurement of {ckpt} reused ({cache})")
        return variant, got["rows"], got["gammas"]

    def fn(trainer):
        found = fp8_run.capture(trainer, args.batches)
        return fp8_run.gamma_stats(found), fp8_run.measure_model(
            found, variant, recipes, args.sigmas, log)

    gam, rows = fp8_run.in_trainer(
        [*argv, "--scalevec", variant, "--load", ckpt, "--no-load-optim", "--run-dir",
         run_dir], fn)
    with open(cache, "w") as f:
        json.dump(dict(key=key, rows=rows, gammas=gam), f)
    return variant, rows, gam


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    recipes = [fp8.recipe(r) for r in args.recipes]
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    ckpts = [fp8_run.train_checkpoint(
        v, os.path.join(args.out, "ckpt"),
        ["--train-iters", str(args.train_iters), *args.trainer_args.split()]) for v in
        args.variants]
    rows, gammas = [], {}
    for ckpt in ckpts + list(args.load):
        variant, got, gam = _measure(ckpt, args, recipes, print)
        name = variant if ckpt in ckpts else f"{variant} ({ckpt})"
        for r in got:
            r["variant"] = name
        rows += got
        gammas[name] = gam
    compare = {}
    names = [(s, False) for s in args.train_compare]
    if args.mean_kept and "unified" in args.train_compare:
        names.append(("unified", True))
    base = ["--train-iters", str(args.compare_iters), *args.compare_args.split()]
    for s, kept in names:
        key = s + (" mean_kept" if kept else "")
        t1 = time.time()
        c = compare[key] = {}
        for mode, rec in (("fp32", None), ("fp8", fp8.recipe("tensorwise"))):
            if kept and mode == "fp32":
                c["fp32"] = compare[s]["fp32"]
                continue
            d = os.path.join(args.out, "compare", key.replace(" ", "_").replace("+", "_"), mode)
            argv = [*base, "--scalevec", s, *runner.VECTORS_AT_BASE_LR]
            c[mode] = fp8_run.train_run(argv, d, rec, mean_kept=kept)
        c["seconds"] = time.time() - t1
        print(f"[fp8] {key}: fp32 {c['fp32'][-1]:.4f}, fp8 {c['fp8'][-1]:.4f}")
    if not rows:
        print("[fp8] no checkpoint measured (empty --variants and --load): no report")
        return
    with open(os.path.join(args.out, "gemm_errors.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    md, flag = report(rows, gammas, compare, args)
    md += (f"\nMitigation indicated (folded > 1.5x stock as trained, or a growing FP8 gap): "
           f"{'yes' if flag else 'no'}. Total {time.time() - t0:.0f} s.\n")
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(md)
    png = os.path.join(args.out, "fp8_numerics.png")
    plot(rows, compare, png)
    if args.figure:
        import shutil  # noqa: PLC0415

        shutil.copyfile(png, args.figure)
    print(md)
    print(f"[fp8] wrote {args.out}/report.md, gemm_errors.csv, {png}")
