"""Quick comparison anyone can run: ``shared`` vs ``unified``, each at its best LR of a small
grid, same seed(s), one plot with both validation curves and their difference.

Every run is the real trainer (one subprocess each, resumable like the sweeps). The LR of each
strategy is picked on seed 1 (a best on the grid's edge adds one point beyond it,
``--max-extend``); with ``--seeds 1`` that run is also the comparison (both sides get
the same best-of-grid advantage), with more seeds the comparison is paired over seeds 1..N at
the picked LRs. The interval of the difference: with several seeds, a 95% t-interval over
seeds (per eval point in the plot, at the end in the summary); with one seed, a t-interval over
the eval points of the second half of training, which are correlated, so it shows how steady
the gap is, not its significance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import textwrap
import time

from evidence import runner, stats, tuned, tuning


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/compare", help="run directory (resumable)")
    p.add_argument("--baseline", default="shared")
    p.add_argument("--candidate", default="unified")
    p.add_argument("--lrs", nargs="+", type=float, default=None,
                   help="LR grid (default: --lr-points around 6e-3, factor 2)")
    p.add_argument("--lr-points", type=int, default=3)
    p.add_argument("--max-extend", type=int, default=1,
                   help="grid points added beyond an edge best, per strategy")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="LR floor / peak LR")
    p.add_argument("--seeds", type=int, default=1, help="comparison seeds 1..N")
    p.add_argument("--train-iters", type=int, default=250)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--num-attention-heads", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--data-path", nargs="*", default=None,
                   help="your data (Megatron .bin/.idx prefixes, as the trainer takes them); "
                        "default: the embedded corpus")
    p.add_argument("--trainer-args", default="", help="extra trainer flags, one string")
    p.add_argument("--threads", type=int, default=1, help="threads per run")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    return p


def _run(a, strategy, lr, seed):
    argv = ["--spec", "scalevec_dense", "--scalevec", strategy, *runner.VECTORS_AT_BASE_LR,
            "--lr", f"{lr:g}",
            "--min-lr", f"{lr * a.min_lr_ratio:g}", "--num-layers", a.num_layers,
            "--hidden-size", a.hidden_size, "--num-attention-heads", a.num_attention_heads,
            "--seq-length", a.seq_length, "--micro-batch-size", a.micro_batch_size,
            "--train-iters", a.train_iters, "--eval-interval", a.eval_interval,
            "--eval-iters", a.eval_iters, "--seed", seed, "--log-interval", 10, "--no-plot",
            "--quiet"]
    argv = [str(x) for x in argv] + (["--data-path", *a.data_path] if a.data_path else [])
    return runner.Run(f"{strategy}/lr{lr:g}/seed{seed}", argv + a.trainer_args.split(),
                      a.train_iters, dict(strategy=strategy, lr=lr, seed=seed))


def _curve(a, run):
    return dict(runner.val_curve(os.path.join(a.out, run.key)))


def difference(cand: list, base: list) -> dict:
    """cand, base: per-seed {iteration: val loss}. Per eval point the paired mean and 95%
    half-width over seeds; the final value's interval over seeds, or with one seed over the
    eval points of the second half of training (``over`` says which)."""
    its = sorted(set.intersection(*(set(c) for c in cand + base)))
    per = [stats.t_interval([c[t] - b[t] for c, b in zip(cand, base)]) for t in its]
    if len(cand) > 1:
        m, h = per[-1]
        over = f"{len(cand)} paired seeds, final eval"
    else:
        late = [d for t, (d, _) in zip(its, per) if t > its[-1] / 2]
        m, h = stats.t_interval(late)
        over = (f"mean over the {len(late)} eval points of the second half, one seed; "
                "correlated points: steadiness, not significance")
    return dict(its=its, mean=[x[0] for x in per], half=[x[1] for x in per], final=m,
                lo=m - h, hi=m + h, over=over)


def plot(a, curves, best, diff, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in (a.baseline, a.candidate):
        cs = curves[s]
        its = sorted(set.intersection(*(set(c) for c in cs)))
        ax1.plot(its, [stats.mean(c[t] for c in cs) for t in its], ".-",
                 label=f"{s} @ lr {best[s]:g}")
    h = [x if math.isfinite(x) else 0.0 for x in diff["half"]]
    ax2.plot(diff["its"], diff["mean"], ".-", color="C2", label=f"{a.candidate} − {a.baseline}")
    if len(curves[a.candidate]) > 1:
        ax2.fill_between(diff["its"], [m - x for m, x in zip(diff["mean"], h)],
                         [m + x for m, x in zip(diff["mean"], h)], color="C2", alpha=0.15,
                         label="95% t-band over seeds")
    else:
        late = [t for t in diff["its"] if t > diff["its"][-1] / 2]
        ax2.fill_between(late, diff["lo"], diff["hi"], color="C2", alpha=0.15,
                         label="95% interval over these eval points")
    ax2.axhline(0, color="k", lw=0.8)
    ax1.set_title("validation loss, each at its best LR")
    ax2.set_title(f"difference: {diff['final']:+.4f} [{diff['lo']:+.4f}, {diff['hi']:+.4f}]\n"
                  + textwrap.fill(f"({diff['over']})", 80), fontsize=9)
    tuned.save_panels(plt, fig, (ax1, ax2), path, log_loss=False, legend_size=8)


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    if a.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    lrs = sorted(a.lrs) if a.lrs else tuning.lr_grid(6e-3, a.lr_points)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    pair = (a.baseline, a.candidate)
    grids = {s: list(lrs) for s in pair}
    for _ in range(a.max_extend + 1):  # a best on the grid's edge grows the grid that way
        runner.execute([_run(a, s, lr, 1) for s in pair for lr in grids[s]], a.out,
                       threads=a.threads, jobs=a.jobs)
        tune = {s: {lr: [_curve(a, _run(a, s, lr, 1))[a.train_iters]] for lr in grids[s]}
                for s in pair}
        got = {s: tuning.best_lr(tune[s]) for s in pair}
        best, edge = {s: g[0] for s, g in got.items()}, {s: g[1] for s, g in got.items()}
        grow = [s for s in pair if edge[s] in ("low", "high")
                and len(grids[s]) < len(lrs) + a.max_extend]
        if not grow:
            break
        for s in grow:
            grids[s] = tuning.extend(grids[s], edge[s])
    comp = [_run(a, s, best[s], k) for s in pair for k in range(1, a.seeds + 1)]
    runner.execute(comp, a.out, threads=a.threads, jobs=a.jobs)
    curves = {s: [_curve(a, _run(a, s, best[s], k)) for k in range(1, a.seeds + 1)]
              for s in pair}
    diff = difference(curves[a.candidate], curves[a.baseline])
    path = os.path.join(a.out, "compare.png")
    plot(a, curves, best, diff, path)
    res = dict(best_lr=best, edge=edge, tuning={s: {f"{k:g}": v[0] for k, v in t.items()}
                                                for s, t in tune.items()},
               final={s: stats.mean(c[a.train_iters] for c in curves[s]) for s in pair},
               diff=diff["final"], lo=diff["lo"], hi=diff["hi"], over=diff["over"],
               wall_s=time.time() - t0, plot=path)
    with open(os.path.join(a.out, "compare.json"), "w") as f:
        json.dump(res, f, indent=1)
    for s in pair:
        note = tuning.edge_note(edge[s])
        print(f"{s:>10}: best lr {best[s]:g}{' (' + note + ')' if note else ''}; final val "
              f"{res['final'][s]:.4f}; grid " + ", ".join(
                  f"{k}: {v:.4f}" for k, v in res["tuning"][s].items()))
    print(f"{a.candidate} - {a.baseline}: {diff['final']:+.4f} [{diff['lo']:+.4f}, "
          f"{diff['hi']:+.4f}] 95% over {diff['over']}; plot {path}; {res['wall_s']:.0f} s")
    return res
