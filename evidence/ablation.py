"""The paper's ablation ladder and its controls, through the real trainer, with paired seeds.

For a given ``--seed`` every strategy starts from the same initial matrices and sees the same
data in the same order: the trainer seeds torch before building the model, scale vectors draw
no random numbers (they start at gamma = 1), and the data order depends on the seed only. The
iteration-1 training loss is an end-to-end check of this: strategies that compute the same
function at init as ``shared`` (all but the DNP ones and ``none``) must match it exactly; the
table reports the largest deviation.

Controls: ``none`` at other learning rates (``--lr-sweep``, multipliers of ``--lr``) and a
width-matched stock model (megatron-core's own spec, FFN widened until its parameter count
reaches the unified strategy's). The widened model has other matrix shapes, so it shares only
the data order with the ladder, not the initial matrices.
"""

from __future__ import annotations

import argparse
import csv
import math
import os

from evidence import runner, stats, tuned

LADDER = ["none", "shared", "hg", "hg+dp", "hg+dnp", "hg+dnp+or", "hg+dnp+er", "hg+dnp+or+iwd"]
FAMILIES = ("dense", "moe")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/ablation", help="sweep directory (resumable)")
    p.add_argument("--families", nargs="+", default=None, choices=FAMILIES,
                   help="default: dense (tuned), dense moe (--fixed-lr)")
    p.add_argument("--strategies", nargs="+", default=LADDER, help="dense ladder")
    p.add_argument("--moe-strategies", nargs="+", default=None,
                   help="MoE ladder (default: --strategies)")
    p.add_argument("--seeds", type=int, default=3, help="paired seeds 1..N")
    p.add_argument("--moe-seeds", type=int, default=None, help="default: --seeds")
    p.add_argument("--train-iters", type=int, default=None,
                   help="default: 2.5 tokens/param (tuned), 250 (--fixed-lr)")
    p.add_argument("--moe-train-iters", type=int, default=150,
                   help="MoE runs (each step costs more); 0: --train-iters")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--lr-sweep", nargs="*", type=float, default=[0.5, 2.0],
                   help="LR multipliers for the 'none' control (empty: no LR sweep)")
    p.add_argument("--no-width-matched", action="store_true")
    p.add_argument("--control-families", nargs="*", default=None,
                   help="families that get the controls (default: --families)")
    p.add_argument("--trainer-args", default="", help="extra trainer flags, one string")
    p.add_argument("--report-only", action="store_true", help="tables and plots only")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per run")
    p.add_argument("--jobs", type=int, default=2,
                   help="runs at a time (two 1-thread runs beat one 2-thread run on 2 cores)")
    tuned.add_arguments(p)
    return p


def finish_args(a):
    """Mode-dependent defaults: the tuned comparison is dense at 2.5 tokens per parameter; the
    fixed-LR ladder keeps its historical budget (250 steps, dense and MoE)."""
    from evidence.scaling import approx_params  # noqa: PLC0415

    a.families = a.families or (["dense", "moe"] if a.fixed_lr else ["dense"])
    if a.train_iters is None:
        tpp = a.tokens_per_param or (None if a.fixed_lr else 2.5)
        a.train_iters = 250 if tpp is None else max(
            a.eval_interval, math.ceil(tpp * approx_params(a.num_layers, a.hidden_size, 4096)
                                       / (a.seq_length * a.micro_batch_size)))
    return a


def _base_argv(a, family: str, seed: int) -> list:
    ffn = a.ffn_hidden_size or 4 * a.hidden_size
    iters = runner.train_iters(a, family)
    argv = ["--num-layers", a.num_layers, "--hidden-size", a.hidden_size,
            "--num-attention-heads", a.num_attention_heads, "--ffn-hidden-size", ffn,
            "--seq-length", a.seq_length, "--micro-batch-size", a.micro_batch_size,
            "--train-iters", iters, "--eval-interval", a.eval_interval,
            "--eval-iters", a.eval_iters, "--seed", seed, "--log-interval", 10,
            "--no-plot", "--quiet"]
    if family == "moe":
        argv += ["--num-experts", a.num_experts]
    return [str(x) for x in argv] + a.trainer_args.split()


def _spec(family):
    return "scalevec_moe" if family == "moe" else "scalevec_dense"


def ladder_runs(a, family: str) -> list:
    strategies = a.moe_strategies if family == "moe" and a.moe_strategies else a.strategies
    if "shared" not in strategies:
        strategies = ["shared", *strategies]  # the reference of every paired difference
    seeds = a.moe_seeds if family == "moe" and a.moe_seeds else a.seeds
    runs = []
    for seed in range(1, seeds + 1):  # seed-major: an interrupted sweep keeps whole seeds
        for s in strategies:
            argv = ["--spec", _spec(family), "--scalevec", s, "--lr", str(a.lr),
                    *runner.VECTORS_AT_BASE_LR, *_base_argv(a, family, seed)]
            runs.append(runner.Run(f"{family}/{s}/seed{seed}", argv, runner.train_iters(a, family),
                                   dict(family=family, variant=s, strategy=s, lr=a.lr,
                                        seed=seed)))
    return runs


def lr_runs(a, family: str) -> list:
    seeds = a.moe_seeds if family == "moe" and a.moe_seeds else a.seeds
    runs = []
    for mult in a.lr_sweep if family in _control_families(a) else []:
        lr = a.lr * mult
        for seed in range(1, seeds + 1):
            argv = ["--spec", _spec(family), "--scalevec", "none", "--lr", f"{lr:g}",
                    *_base_argv(a, family, seed)]
            runs.append(runner.Run(f"{family}/none@lr{lr:g}/seed{seed}", argv,
                                   runner.train_iters(a, family),
                                   dict(family=family, variant=f"none@lr{lr:g}",
                                        strategy="none", lr=lr, seed=seed)))
    return runs


def _control_families(a):
    return a.families if a.control_families is None else a.control_families


def matched_width(a, family: str, root: str):
    """(ffn width, params) of the stock model whose count first reaches unified's, from the
    parameter counts the seed-1 runs recorded; None until both exist."""
    pu = runner.read_json(os.path.join(root, family, "hg+dnp+or+iwd", "seed1", "params.json"))
    ps_ = runner.read_json(os.path.join(root, family, "shared", "seed1", "params.json"))
    if not pu or not ps_:
        return None
    ffn = a.ffn_hidden_size or 4 * a.hidden_size
    # one FFN column = gate + up rows and a down column (h each) per layer (per expert for MoE)
    per_col = 3 * a.hidden_size * a.num_layers * (a.num_experts if family == "moe" else 1)
    extra = pu["total"] - ps_["total"]
    return ffn + max(1, math.ceil(extra / per_col)), pu["total"]


def width_runs(a, family: str, root: str) -> list:
    got = matched_width(a, family, root)
    if got is None or a.no_width_matched or family not in _control_families(a):
        return []
    width, _ = got
    seeds = a.moe_seeds if family == "moe" and a.moe_seeds else a.seeds
    runs = []
    for seed in range(1, seeds + 1):
        argv = ["--spec", "baseline", "--lr", str(a.lr), *_base_argv(a, family, seed)]
        flag = "--moe-ffn-hidden-size" if family == "moe" else "--ffn-hidden-size"
        if family == "moe":
            argv += [flag, str(width)]
        else:
            argv[argv.index(flag) + 1] = str(width)
        runs.append(runner.Run(f"{family}/width{width}/seed{seed}", argv,
                               runner.train_iters(a, family),
                               dict(family=family, variant=f"stock ffn={width}",
                                    strategy="stock", lr=a.lr, seed=seed, width=width)))
    return runs


def all_runs(a, root) -> list:
    """Ladders first, then the LR sweep, then the width-matched runs (which need the ladder's
    parameter counts): an interrupted sweep has the most important runs."""
    runs = [r for f in a.families for r in ladder_runs(a, f)]
    runs += [r for f in a.families for r in lr_runs(a, f)]
    return runs + [r for f in a.families for r in width_runs(a, f, root)]


# ----------------------------------------------------------------------------- summary
CSV_COLUMNS = ["family", "variant", "strategy", "lr", "seeds", "val_mean", "val_std",
               "diff_mean", "diff_lo", "diff_hi", "diff_sd", "seeds_needed", "step_from",
               "step_mean", "step_lo", "step_hi", "step_seeds_needed", "params",
               "extra_params", "overhead_frac", "iter1_dev", "wall_s"]


def parent(variant: str):
    """The rung a ladder step is measured from: drop the last component (``hg+dnp+or`` ->
    ``hg+dnp``); single components and ``none`` are measured from ``shared``."""
    if variant == "shared" or "@" in variant or variant.startswith("stock"):
        return None
    return variant.rsplit("+", 1)[0] if "+" in variant else "shared"


def _paired(infos, ref_infos):
    """(mean, lo, hi, sd, seeds needed) of the per-seed difference infos - ref_infos."""
    ref = {i["seed"]: i["final"] for i in ref_infos}
    d = [i["final"] - ref[i["seed"]] for i in infos if i["seed"] in ref]
    if not d:
        return (math.nan,) * 5
    m, h = stats.t_interval(d)
    sd = stats.std(d)
    return m, m - h, m + h, sd, stats.seeds_needed(m, sd)


def summarize(runs: list, root: str) -> list:
    """One row per (family, variant): final validation loss over seeds, the paired difference
    to ``shared`` of the same family and seed, and the paired ladder step from its parent."""
    by = {}
    for r in runs:
        d = os.path.join(root, r.key)
        if not runner.is_done(d, r.train_iters):
            continue
        curve = runner.val_curve(d)
        recs = runner.read_metrics(d)
        it1 = next((x["loss_last"] for x in recs if x.get("iteration") == 1), math.nan)
        info = dict(r.labels, curve=curve, final=curve[-1][1], it1=it1,
                    params=runner.read_json(os.path.join(d, "params.json"), {}),
                    wall=runner.read_json(os.path.join(d, "wall.json"), {}).get("wall_s"))
        by.setdefault((r.labels["family"], r.labels["variant"]), []).append(info)
    rows = []
    for (family, variant), infos in by.items():
        shared = by.get((family, "shared"), [])
        ref = {i["seed"]: i for i in shared}
        dmean, dlo, dhi, dsd, need = _paired(infos, shared)
        up = parent(variant)
        step = _paired(infos, by[(family, up)]) if (family, up) in by else (math.nan,) * 5
        p = infos[0]["params"].get("total", math.nan)
        pref = shared[0]["params"].get("total", math.nan) if shared else math.nan
        walls = [i["wall"] for i in infos if i["wall"]]
        it1 = [abs(i["it1"] - ref[i["seed"]]["it1"]) for i in infos if i["seed"] in ref]
        rows.append(dict(
            family=family, variant=variant, strategy=infos[0]["strategy"], lr=infos[0]["lr"],
            seeds=len(infos), val_mean=stats.mean(i["final"] for i in infos),
            val_std=stats.std(i["final"] for i in infos), diff_mean=dmean, diff_lo=dlo,
            diff_hi=dhi, diff_sd=dsd, seeds_needed=need if variant != "shared" else math.nan,
            step_from=up or "", step_mean=step[0], step_lo=step[1], step_hi=step[2],
            step_seeds_needed=step[4], params=p, extra_params=p - pref,
            overhead_frac=(p - pref) / pref, iter1_dev=max(it1, default=math.nan),
            wall_s=stats.mean(walls) if walls else math.nan, _infos=infos, _ref=ref))
    order = {v: k for k, v in enumerate(LADDER)}
    rows.sort(key=lambda r: (r["family"], order.get(r["variant"], 99), r["variant"]))
    return rows


def _g(x, fmt):
    return "" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (_g(v, ".6g") if isinstance(v, float) else v)
                        for k, v in r.items() if k in CSV_COLUMNS})


MD_HEADER = ("| family | variant | lr | seeds | final val loss (mean ± std) | Δ vs shared "
             "(paired) | 95% CI | seeds to resolve | params | extra params vs shared | "
             "iter-1 loss dev. | s/run |")
STEP_HEADER = "| family | step | Δ val loss (paired) | 95% CI | seeds to resolve |"


def _ci(lo, hi):
    return f"[{_g(lo, '+.4f')}, {_g(hi, '+.4f')}]" if math.isfinite(lo) else ""


def markdown(rows) -> str:
    """The main table, then the ladder steps (each rung against the rung below it)."""
    lines = [MD_HEADER, "|" + " --- |" * (MD_HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['variant']} | {r['lr']:g} | {r['seeds']} | "
            f"{r['val_mean']:.4f} ± {_g(r['val_std'], '.4f')} | "
            f"{_g(r['diff_mean'], '+.4f') if r['variant'] != 'shared' else '0'} | "
            f"{_ci(r['diff_lo'], r['diff_hi']) if r['variant'] != 'shared' else ''} | "
            f"{_g(r['seeds_needed'], '')} | {_g(r['params'], ',')} | "
            f"{_g(r['extra_params'], '+,')} ({_g(r['overhead_frac'], '+.2e')}) | "
            f"{_g(r['iter1_dev'], '.1e')} | {_g(r['wall_s'], '.0f')} |")
    lines += ["", STEP_HEADER, "|" + " --- |" * (STEP_HEADER.count("|") - 1)]
    for r in rows:
        if r["step_from"] and math.isfinite(r["step_mean"]):
            lines.append(f"| {r['family']} | {r['step_from']} → {r['variant']} | "
                         f"{r['step_mean']:+.4f} | {_ci(r['step_lo'], r['step_hi'])} | "
                         f"{_g(r['step_seeds_needed'], '')} |")
    return "\n".join(lines) + "\n"


def plot(rows, out_dir: str, prefix: str = "ablation") -> list:
    """Per family: mean validation curve per variant, and the paired difference to shared
    over training (mean and 95% t-band over seeds). Returns the PNG paths."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    paths = []
    for family in sorted({r["family"] for r in rows}):
        fam = [r for r in rows if r["family"] == family]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        cmap = plt.get_cmap("tab20")
        for k, r in enumerate(fam):
            style = dict(color=cmap(k % 20), marker=".", label=r["variant"],
                         ls="-" if r["variant"] in LADDER else "--")  # controls dashed
            curves = [dict(i["curve"]) for i in r["_infos"]]
            its = sorted(set.intersection(*(set(c) for c in curves)))
            ax1.plot(its, [stats.mean(c[t] for c in curves) for t in its], **style)
            if r["variant"] == "shared":
                continue
            per_it = []
            for t in its:
                ds = [dict(i["curve"])[t] - dict(r["_ref"][i["seed"]]["curve"])[t]
                      for i in r["_infos"] if i["seed"] in r["_ref"]
                      and t in dict(r["_ref"][i["seed"]]["curve"])]
                per_it.append(stats.t_interval(ds) if ds else (math.nan, math.nan))
            m = [x[0] for x in per_it]
            h = [x[1] if math.isfinite(x[1]) else 0.0 for x in per_it]
            ax2.plot(its, m, **style)
            ax2.fill_between(its, [a - b for a, b in zip(m, h)], [a + b for a, b in zip(m, h)],
                             color=style["color"], alpha=0.08)
        ax2.axhline(0, color="k", lw=0.8)
        ax1.set_title(f"{family}: validation loss (mean over seeds)")
        ax2.set_title(f"{family}: paired Δ val loss vs shared (95% t-band)")
        paths.append(tuned.save_panels(plt, fig, (ax1, ax2),
                                       os.path.join(out_dir, f"{prefix}_{family}.png")))
    return paths


def report(a, root: str, log=print) -> tuple:
    runs = all_runs(a, root)
    rows = summarize(runs, root)
    write_csv(rows, os.path.join(root, "results.csv"))
    md = markdown(rows)
    notes = []
    for f in a.families:
        got = matched_width(a, f, root)
        if got and f in _control_families(a) and not a.no_width_matched:
            notes.append(f"- {f}: width-matched stock model FFN width {got[0]} (unified has "
                         f"{got[1]:,} parameters)")
    with open(os.path.join(root, "results.md"), "w") as fh:
        fh.write("# Ablation results\n\n" + md + "\n" + "\n".join(notes) + "\n")
    pngs = plot(rows, root)
    log(md + "\n".join(notes))
    return rows, pngs


def main(argv=None) -> list:
    a = finish_args(build_parser().parse_args(argv))
    root = a.out
    os.makedirs(root, exist_ok=True)
    if not a.fixed_lr:
        grids = tuned.tuning_plan(a, _base_argv, root)[1] if a.report_only else \
            tuned.execute(a, _base_argv, root)
        return tuned.report(a, _base_argv, root, grids)
    if not a.report_only:
        first = [r for f in a.families for r in ladder_runs(a, f)]
        first += [r for f in a.families for r in lr_runs(a, f)]
        runner.execute(first, root, threads=a.threads, jobs=a.jobs)
        runner.execute(all_runs(a, root), root, threads=a.threads, jobs=a.jobs)  # + width
    rows, _ = report(a, root)
    return rows
