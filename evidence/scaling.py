"""Compute efficiency of ``unified`` over ``shared``: train both at several dense sizes on a
tokens-per-parameter budget through the real trainer, fit loss against compute and report the
compute multiplier (how much more compute ``shared`` needs to reach ``unified``'s loss).

Compute is ``C = 6 N D`` with ``N`` all parameters the trainer built (the tied embedding is also
the output layer, which dominates the FLOPs of models this small) and ``D`` the trained tokens.

Fits, per strategy, on the seed-mean final validation loss of each size:

* ``power``: ``L = a C^-b + c`` (grid over ``c``, linear least squares in log space); used only
  with at least 4 sizes, a finite ``c`` strictly inside its range and ``b > 0``;
* ``loglinear`` otherwise: ``L = alpha_s - beta ln C`` with one slope for both strategies, so the
  multiplier ``exp((alpha_shared - alpha_unified) / beta)`` does not depend on ``C``.

The power-law multiplier is taken at the largest compute measured. Uncertainty: a paired
bootstrap over seeds (the same resampled seeds for both strategies at each size), 95%
percentile interval.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random

from evidence import runner, stats, tuning

STRATEGIES = ("shared", "hg+dnp+or+iwd")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/scaling")
    p.add_argument("--sizes", nargs="+", default=["2x32", "2x48", "2x64", "3x80"],
                   help="LAYERSxHIDDEN; heads = hidden / --head-dim")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--tokens-per-param", type=float, default=1.0)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--strategies", nargs=2, default=list(STRATEGIES),
                   metavar=("BASELINE", "CANDIDATE"))
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="the tokenizer's vocabulary (embedded default: 4096), for the budget")
    p.add_argument("--fit", choices=("loglinear", "power", "auto"), default="loglinear",
                   help="primary fit; auto: power law when identified (>= 4 sizes), else "
                        "log-linear. The other fit is reported too.")
    p.add_argument("--bootstrap", type=int, default=2000)
    p.add_argument("--trainer-args", default="")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per run")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--fixed-lr", action="store_true",
                   help="every run at --lr (no tuning); default: tune the LR per strategy "
                        "and size on a grid around --lr, compare at each one's best")
    p.add_argument("--lr-points", type=int, default=3)
    p.add_argument("--lr-factor", type=float, default=2.0)
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="LR floor / peak LR")
    return p


def _size(s):
    layers, hidden = (int(x) for x in s.lower().split("x"))
    return layers, hidden


def approx_params(layers, hidden, vocab):
    """Tied embedding + per layer QKV/proj (4 h^2) and gated FFN of width 4h (12 h^2)."""
    return vocab * hidden + layers * 16 * hidden * hidden


def _iters_for(a, size):
    layers, hidden = _size(size)
    n = approx_params(layers, hidden, a.vocab_size)
    return max(20, math.ceil(a.tokens_per_param * n / (a.seq_length * a.micro_batch_size)))


def _run(a, s, size, seed, lr, key):
    layers, hidden = _size(size)
    iters = _iters_for(a, size)
    argv = ["--spec", "scalevec_dense", "--scalevec", s, *runner.VECTORS_AT_BASE_LR,
            "--num-layers", layers,
            "--hidden-size", hidden, "--num-attention-heads", hidden // a.head_dim,
            "--seq-length", a.seq_length, "--micro-batch-size", a.micro_batch_size,
            "--train-iters", iters, "--eval-interval", iters,
            "--eval-iters", a.eval_iters, "--lr", f"{lr:g}", "--min-lr",
            f"{lr * a.min_lr_ratio:g}", "--seed", seed, "--log-interval", 10, "--no-plot",
            "--quiet"]
    return runner.Run(key, [str(x) for x in argv] + a.trainer_args.split(), iters,
                      dict(strategy=s, size=size, seed=seed, iters=iters, lr=lr))


def tuning_runs(a) -> list:
    """Per (strategy, size): the LR grid on the tuning seed(s) (tuned mode only)."""
    grid = tuning.lr_grid(a.lr, a.lr_points, a.lr_factor)
    return [_run(a, s, size, seed, lr, f"{s}/{size}/lr{lr:g}/tune{seed}")
            for size in a.sizes for s in a.strategies for lr in grid
            for seed in range(tuning.TUNE_SEED0 + 1, tuning.TUNE_SEED0 + 1 + a.tune_seeds)]


def best_lrs(a, root) -> dict:
    """{(strategy, size): (best lr, edge)} for every finished grid."""
    by = {}
    for r in tuning_runs(a):
        d = os.path.join(root, r.key)
        done = runner.is_done(d, r.train_iters)
        by.setdefault((r.labels["strategy"], r.labels["size"]), {}).setdefault(
            r.labels["lr"], []).append(runner.val_curve(d)[-1][1] if done else None)
    return {k: tuning.best_lr(v) for k, v in by.items()
            if all(x is not None for xs in v.values() for x in xs)}


def runs_for(a, root=None) -> list:
    """The comparison runs: at ``--lr`` (``--fixed-lr``), else at each (strategy, size)'s best
    LR once its grid has finished (fresh seeds 1..N, disjoint from the tuning seeds)."""
    best = {} if a.fixed_lr else best_lrs(a, root)
    runs = []
    for seed in range(1, a.seeds + 1):
        for size in a.sizes:
            for s in a.strategies:
                if a.fixed_lr:
                    runs.append(_run(a, s, size, seed, a.lr, f"{s}/{size}/seed{seed}"))
                elif (s, size) in best:
                    lr = best[(s, size)][0]
                    runs.append(_run(a, s, size, seed, lr, f"{s}/{size}/lr{lr:g}/seed{seed}"))
    return runs


def collect(a, root) -> list:
    out = []
    for r in runs_for(a, root):
        d = os.path.join(root, r.key)
        if not runner.is_done(d, r.train_iters):
            continue
        n = runner.read_json(os.path.join(d, "params.json"), {}).get("total")
        tokens = r.train_iters * a.seq_length * a.micro_batch_size
        out.append(dict(r.labels, params=n, tokens=tokens, compute=6.0 * n * tokens,
                        val_loss=runner.val_curve(d)[-1][1]))
    return out


# ----------------------------------------------------------------------------- fits
def _linfit(xs, ys):
    mx, my = stats.mean(xs), stats.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def fit_power(cs, ls, grid=400):
    """(a, b, c, sse) of L = a C^-b + c, or None when the best c sits on the grid's edge or
    b <= 0 (the fit is then not identified by the data)."""
    best = None
    top = min(ls)
    for k in range(grid):
        c = top * k / grid
        xs, ys = [math.log(x) for x in cs], [math.log(y - c) for y in ls]
        icpt, slope = _linfit(xs, ys)
        a, b = math.exp(icpt), -slope
        sse = sum((a * x ** -b + c - y) ** 2 for x, y in zip(cs, ls))
        if best is None or sse < best[3]:
            best = (a, b, c, sse, k)
    a, b, c, sse, k = best
    return None if k in (0, grid - 1) or b <= 0 else (a, b, c, sse)


def fit_loglinear(points):
    """points: {strategy: [(C, L)]} -> ({strategy: alpha}, beta, rms) with one common slope."""
    names = list(points)
    xs = {s: [math.log(c) for c, _ in points[s]] for s in names}
    ys = {s: [loss for _, loss in points[s]] for s in names}
    mx = {s: stats.mean(xs[s]) for s in names}
    my = {s: stats.mean(ys[s]) for s in names}
    num = sum((x - mx[s]) * (y - my[s]) for s in names for x, y in zip(xs[s], ys[s]))
    den = sum((x - mx[s]) ** 2 for s in names for x in xs[s])
    beta = -num / den
    alpha = {s: my[s] + beta * mx[s] for s in names}
    res = [y - (alpha[s] - beta * x) for s in names for x, y in zip(xs[s], ys[s])]
    return alpha, beta, math.sqrt(stats.mean(r * r for r in res))


def multiplier(points, base, cand, allow_power=True):
    """(method, multiplier, detail) for ``base`` to reach ``cand``'s loss."""
    if allow_power and all(len(p) >= 4 for p in points.values()):
        fits = {s: fit_power(*zip(*sorted(points[s]))) for s in (base, cand)}
        if all(fits.values()):
            cmax = max(c for c, _ in points[cand])
            a, b, c, _ = fits[cand]
            target = a * cmax ** -b + c
            ab, bb, cb, _ = fits[base]
            if target <= cb:
                return "power", math.inf, fits
            return "power", ((target - cb) / ab) ** (-1 / bb) / cmax, fits
    alpha, beta, rms = fit_loglinear({s: points[s] for s in (base, cand)})
    if beta <= 0:
        return "loglinear", math.nan, (alpha, beta, rms)
    return "loglinear", math.exp((alpha[base] - alpha[cand]) / beta), (alpha, beta, rms)


def _points(rows, pick=None):
    """{strategy: [(C, mean L over the chosen seeds)]}; ``pick``: {size: [seed, ...]}."""
    out = {}
    for s in sorted({r["strategy"] for r in rows}):
        for size in sorted({r["size"] for r in rows}):
            rs = {r["seed"]: r for r in rows if r["strategy"] == s and r["size"] == size}
            seeds = pick[size] if pick else sorted(rs)
            if not rs or any(k not in rs for k in seeds):
                continue
            c = stats.mean(rs[k]["compute"] for k in seeds)
            out.setdefault(s, []).append((c, stats.mean(rs[k]["val_loss"] for k in seeds)))
    return out


def analyse(a, rows, seed=0):
    base, cand = a.strategies
    pts = _points(rows)
    method, mult, detail = multiplier(pts, base, cand, allow_power=a.fit != "loglinear")
    if a.fit == "power" and method != "power":
        print("power-law fit not identified by these points: using log-linear")
    alt = multiplier(pts, base, cand, allow_power=method != "power")
    alt = alt if alt[0] != method else None
    rng = random.Random(seed)
    sizes = sorted({r["size"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    boots = []
    for _ in range(a.bootstrap if len(seeds) > 1 else 0):
        pick = {z: [rng.choice(seeds) for _ in seeds] for z in sizes}
        _, m, _ = multiplier(_points(rows, pick), base, cand, allow_power=method == "power")
        if math.isfinite(m):
            boots.append(m)
    boots.sort()
    lo = boots[int(0.025 * len(boots))] if boots else math.nan
    hi = boots[min(len(boots) - 1, int(0.975 * len(boots)))] if boots else math.nan
    # residual view: each size's paired gap converted to a multiplier with the common slope;
    # a t-interval over sizes (in log space) shows how constant the multiplier really is
    ll = detail if method == "loglinear" else (alt[2] if alt else None)
    logs = []
    for z in sizes:
        by = {(r["strategy"], r["seed"]): r["val_loss"] for r in rows if r["size"] == z}
        d = [by[(cand, k)] - by[(base, k)] for k in seeds if (cand, k) in by and (base, k) in by]
        if d and ll and ll[1] > 0:
            logs.append(-stats.mean(d) / ll[1])
    m, h = stats.t_interval(logs) if len(logs) > 1 else (math.nan, math.nan)
    return dict(method=method, multiplier=mult, lo=lo, hi=hi, n_boot=len(boots),
                detail=detail, points=pts, alt=alt, size_mult=math.exp(m),
                size_lo=math.exp(m - h), size_hi=math.exp(m + h), n_sizes=len(logs))


def write_tables(a, rows, res, root):
    cols = ["strategy", "size", "seed", "params", "tokens", "compute", "val_loss"]
    with open(os.path.join(root, "scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: (r["strategy"], r["params"], r["seed"])))
    base, cand = a.strategies
    ll = res["detail"] if res["method"] == "loglinear" else (res["alt"] or (0, math.nan))[2]
    beta = ll[1] if isinstance(ll, tuple) else math.nan
    lines = [f"| size | params ({cand}) | tokens | compute (6ND) | {base} val | {cand} val | "
             "paired Δ (mean ± 95% CI half-width) | exp(-Δ/beta) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size in sorted({r["size"] for r in rows}, key=lambda z: _size(z)[::-1]):
        by = {(r["strategy"], r["seed"]): r for r in rows if r["size"] == size}
        b = [r for (s, _), r in by.items() if s == base]
        c = [r for (s, _), r in by.items() if s == cand]
        d = [by[(cand, k)]["val_loss"] - by[(base, k)]["val_loss"]
             for (s, k) in by if s == base and (cand, k) in by]
        m, h = stats.t_interval(d) if d else (math.nan, math.nan)
        ref = (c or b)[0]
        lines.append(f"| {size} | {ref['params']:,} | {ref['tokens']:,} | "
                     f"{ref['compute']:.3g} | "
                     f"{stats.mean(r['val_loss'] for r in b):.4f} ± "
                     f"{stats.std(r['val_loss'] for r in b):.4f} | "
                     f"{stats.mean(r['val_loss'] for r in c):.4f} ± "
                     f"{stats.std(r['val_loss'] for r in c):.4f} | {m:+.4f} ± {h:.4f} | "
                     f"{math.exp(-m / beta):.3f} |")
    fit = _describe(res["method"], res["detail"])
    lines += ["", f"Fit: {fit}.", "",
              f"Compute multiplier ({base} compute needed to reach {cand}'s loss): "
              f"**{res['multiplier']:.3f}x**, 95% paired-bootstrap interval over seeds "
              f"[{res['lo']:.3f}, {res['hi']:.3f}] ({res['n_boot']} resamples).",
              "", "exp(-Δ/beta): the multiplier one size alone implies under the fitted slope "
              "(log-linear fit only); its spread over sizes shows how well one constant "
              "multiplier describes the data, which the seed bootstrap does not. Over the "
              f"{res['n_sizes']} sizes: geometric mean {res['size_mult']:.3f}x, 95% t-interval "
              f"[{res['size_lo']:.3f}, {res['size_hi']:.3f}]."]
    if res["alt"]:
        m2, mult2, det2 = res["alt"]
        lines += ["", f"Other fit, for comparison: {_describe(m2, det2)}; multiplier "
                      f"{mult2:.3f}x (point estimate)."]
    if not a.fixed_lr:
        best = best_lrs(a, root)
        lines += ["", "Learning rate per strategy and size (grid "
                  + ", ".join(f"{x:g}" for x in tuning.lr_grid(a.lr, a.lr_points, a.lr_factor))
                  + f", tuning seed(s) {tuning.TUNE_SEED0 + 1}.., floor {a.min_lr_ratio:g} x "
                  "peak): " + "; ".join(
                      f"{s} {z} {lr:g}" + (f" ({tuning.edge_note(e)})" if e else "")
                      for (s, z), (lr, e) in sorted(best.items()))]
    else:
        lines += ["", f"Every run at LR {a.lr:g} (--fixed-lr)."]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(root, "scaling.md"), "w") as f:
        f.write("# Compute-efficiency fit\n\n" + md)
    return md


def _describe(method, detail):
    if method == "loglinear":
        alpha, beta, rms = detail
        return (f"log-linear, common slope: L = alpha - {beta:.4f} ln C; alpha "
                + ", ".join(f"{k} {v:.4f}" for k, v in alpha.items())
                + f"; residual RMS {rms:.4f}")
    return "power law L = a C^-b + c (multiplier at the largest C): " + "; ".join(
        f"{k}: a={v[0]:.4g}, b={v[1]:.4f}, c={v[2]:.4f}, SSE {v[3]:.2e}"
        for k, v in detail.items())


def plot(a, rows, res, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cs_all = [r["compute"] for r in rows]
    grid = [min(cs_all) * (max(cs_all) / min(cs_all)) ** (k / 50) for k in range(51)]
    for s, pts in res["points"].items():
        line, = ax.plot(*zip(*sorted(pts)), "o", label=f"{s} (seed mean)")
        ax.plot([r["compute"] for r in rows if r["strategy"] == s],
                [r["val_loss"] for r in rows if r["strategy"] == s], ".",
                color=line.get_color(), alpha=0.4)
        if res["method"] == "loglinear":
            alpha, beta, _ = res["detail"]
            ax.plot(grid, [alpha[s] - beta * math.log(c) for c in grid], "-",
                    color=line.get_color(), lw=1)
        else:
            fa, fb, fc, _ = res["detail"][s]
            ax.plot(grid, [fa * c ** -fb + fc for c in grid], "-", color=line.get_color(), lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("compute C = 6 N D (FLOPs)")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"{res['method']} fit; multiplier {res['multiplier']:.3f}x "
                 f"[{res['lo']:.3f}, {res['hi']:.3f}]")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if not a.report_only:
        if not a.fixed_lr:
            runner.execute(tuning_runs(a), a.out, threads=a.threads, jobs=a.jobs)
        runner.execute(runs_for(a, a.out), a.out, threads=a.threads, jobs=a.jobs)
    rows = collect(a, a.out)
    res = analyse(a, rows)
    md = write_tables(a, rows, res, a.out)
    plot(a, rows, res, os.path.join(a.out, "scaling.png"))
    print(md)
    return res
