"""Tuned comparison (the default of ``tools/ablation.py``): each variant at its own best LR.

1. Tuning: every variant on a log-spaced LR grid (``--lr-points`` around ``--lr``, factor
   ``--lr-factor``) with the tuning seeds (``TUNE_SEED0 + 1..``); the floor of the cosine (or
   WSD) schedule is ``--min-lr-ratio`` of each run's peak. When the best LR is on the grid's
   edge the grid grows one point that way (up to ``--max-extend`` times); a best still on the
   edge is flagged in the table.
2. Comparison: every variant at its best LR on fresh paired seeds 1..``--seeds``; each
   candidate against the strongest baseline (lowest mean loss among ``--baselines``), paired
   per seed, with a 95% t-interval and the seeds an effect of 0.02 / 0.03 would need.

Variants: a strategy string (``shared``, ``hg+dnp``, ``unified``, ...), ``shared+qknorm``
(``shared`` with megatron-core's ``qk_layernorm``) and ``stock`` (megatron-core's own spec, FFN
widened to unified's parameter count). Settings ``OPT-SCHED`` (``adam-cosine``, ``adam-wsd``,
``muon-cosine``, ...) repeat the whole comparison under another optimizer / schedule; Muon rows
need emerging-optimizers (Python >= 3.12) and are skipped with a note otherwise.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys

from evidence import runner, stats, tuning

BASELINES = ["shared", "shared+qknorm", "stock", "none"]
CANDIDATES = ["unified"]
SCHEDULES = {"cosine": "cosine", "wsd": "WSD", "linear": "linear"}


def add_arguments(p) -> None:
    g = p.add_argument_group("tuned comparison (default; --fixed-lr for the one-LR ladder)")
    g.add_argument("--fixed-lr", action="store_true",
                   help="the ladder at one LR (--lr) with the old controls, no tuning")
    g.add_argument("--baselines", nargs="+", default=BASELINES)
    g.add_argument("--candidates", nargs="+", default=CANDIDATES)
    g.add_argument("--settings", nargs="+", default=["adam-cosine"],
                   help="OPTIMIZER-SCHEDULE: adam|muon x cosine|wsd|linear")
    g.add_argument("--muon-lr", type=float, default=None,
                   help="grid centre for the muon-* settings (default: --lr): one run can "
                        "centre Muon where an Adam tuning of the same model ended")
    g.add_argument("--lr-points", type=int, default=5, help="initial grid size per variant")
    g.add_argument("--lr-factor", type=float, default=2.0, help="grid spacing (ratio)")
    g.add_argument("--max-extend", type=int, default=2,
                   help="grid points added beyond an edge best, per variant")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="LR floor / peak LR")
    g.add_argument("--tune-seeds", type=int, default=1, help="tuning seeds per grid point")
    g.add_argument("--tokens-per-param", type=float, default=None,
                   help="set --train-iters from this budget (approx. parameter count)")


def muon_available() -> str:
    """'' when Muon can run here, else the reason."""
    if sys.version_info < (3, 12):
        return (f"Muon rows skipped: --optimizer muon needs emerging-optimizers, which needs "
                f"Python >= 3.12 (this is {sys.version_info.major}.{sys.version_info.minor})")
    if importlib.util.find_spec("emerging_optimizers") is None:
        return "Muon rows skipped: emerging-optimizers is not installed"
    return ""


def parse_setting(s: str) -> tuple:
    opt, _, sched = s.partition("-")
    if opt not in ("adam", "muon") or sched not in SCHEDULES:
        raise SystemExit(f"--settings {s!r}: expected OPTIMIZER-SCHEDULE with OPTIMIZER adam or "
                         f"muon and SCHEDULE one of {', '.join(SCHEDULES)}")
    return opt, sched


def centre_lr(a, setting: str) -> float:
    """The LR grid's centre for one setting: ``--muon-lr`` for Muon when given, else ``--lr``."""
    muon = parse_setting(setting)[0] == "muon" and getattr(a, "muon_lr", None)
    return a.muon_lr if muon else a.lr


def settings(a, log=print) -> list:
    out = []
    for s in a.settings:
        opt, _ = parse_setting(s)
        why = muon_available() if opt == "muon" else ""
        if why:
            log(f"[tuned] {s}: {why}")
            continue
        out.append(s)
    return out


def _variant_argv(a, family, variant, width):
    spec = "scalevec_moe" if family == "moe" else "scalevec_dense"
    if variant == "stock":
        return ["--spec", "baseline"] + (
            ["--moe-ffn-hidden-size", str(width)] if family == "moe" else [])
    if variant == "shared+qknorm":
        return ["--spec", spec, "--scalevec", "shared", "--qk-layernorm"]
    return ["--spec", spec, "--scalevec", variant, *runner.VECTORS_AT_BASE_LR]


def make_run(a, base_argv, family, setting, variant, lr, seed, width=None, phase="tune"):
    """One trainer invocation; ``base_argv(a, family, seed)`` gives the model and budget."""
    opt, sched = parse_setting(setting)
    argv = _variant_argv(a, family, variant, width) + [
        "--lr", f"{lr:g}", "--min-lr", f"{lr * a.min_lr_ratio:g}", "--optimizer", opt,
        "--lr-decay-style", SCHEDULES[sched]] + base_argv(a, family, seed)
    if variant == "stock" and family != "moe":
        k = argv.index("--ffn-hidden-size")
        argv[k + 1] = str(width)
    iters = runner.train_iters(a, family)
    return runner.Run(f"{family}/{setting}/{variant}/lr{lr:g}/seed{seed}", argv, iters,
                      dict(family=family, setting=setting, variant=variant, lr=lr, seed=seed,
                           phase=phase))


def _final(root, run):
    d = os.path.join(root, run.key)
    return runner.val_curve(d)[-1][1] if runner.is_done(d, run.train_iters) else None


def stock_width(a, root, family, setting):
    """FFN width of the stock model whose parameter count first reaches unified's, from any
    finished tuning run of unified and shared (same model flags); None until both exist."""
    def params(variant):
        d = os.path.join(root, family, setting, variant)
        for lr_dir in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            for s in sorted(os.listdir(os.path.join(d, lr_dir))):
                got = runner.read_json(os.path.join(d, lr_dir, s, "params.json"))
                if got:
                    return got["total"]
        return None

    pu, ps_ = params("unified"), params("shared")
    if pu is None or ps_ is None:
        return None
    ffn = a.ffn_hidden_size or 4 * a.hidden_size
    per_col = 3 * a.hidden_size * a.num_layers * (a.num_experts if family == "moe" else 1)
    return ffn + max(1, math.ceil((pu - ps_) / per_col))


def variants(a) -> list:
    out = list(dict.fromkeys(a.baselines + a.candidates))
    if "stock" in out and "unified" not in out:
        out.append("unified")  # the width to match
    return out


def tuning_plan(a, base_argv, root):
    """(runs, grids): every tuning run the results on disk call for, and per (family, setting,
    variant) the grid and its best (lr, edge, losses) so far (None until all points ran)."""
    runs, grids = [], {}
    for family in a.families:
        for setting in settings(a, log=lambda _: None):
            width = stock_width(a, root, family, setting)
            for v in variants(a):
                if v == "stock" and width is None:
                    grids[(family, setting, v)] = (None, None)
                    continue
                grid = tuning.lr_grid(centre_lr(a, setting), a.lr_points, a.lr_factor)
                for _ in range(a.max_extend + 1):
                    rs = [make_run(a, base_argv, family, setting, v, lr,
                                   tuning.TUNE_SEED0 + k, width)
                          for lr in grid for k in range(1, a.tune_seeds + 1)]
                    runs += [r for r in rs if r.key not in {x.key for x in runs}]
                    finals = {r.key: _final(root, r) for r in rs}
                    if any(f is None for f in finals.values()):
                        grids[(family, setting, v)] = (grid, None)
                        break
                    losses = {lr: [finals[r.key] for r in rs if r.labels["lr"] == lr]
                              for lr in grid}
                    best, edge = tuning.best_lr(losses)
                    grids[(family, setting, v)] = (grid, (best, edge, losses))
                    if edge not in ("low", "high") or len(grid) >= a.lr_points + a.max_extend:
                        break
                    grid = tuning.extend(grid, edge, a.lr_factor)
    return runs, grids


def comparison_runs(a, base_argv, root, grids) -> list:
    runs = []
    for (family, setting, v), (_, got) in grids.items():
        if got is None:
            continue
        width = stock_width(a, root, family, setting) if v == "stock" else None
        runs += [make_run(a, base_argv, family, setting, v, got[0], seed, width, "compare")
                 for seed in range(1, a.seeds + 1)]
    return runs


def execute(a, base_argv, root, log=print) -> dict:
    """Tune until every grid is settled (each pass runs what the last one asked for), then run
    the comparison seeds. Everything is derived from the run directories: re-running resumes."""
    settings(a, log)
    for _ in range(a.max_extend + 3):
        runs, grids = tuning_plan(a, base_argv, root)
        todo = [r for r in runs if _final(root, r) is None]
        if not todo:
            break
        runner.execute(runs, root, log=log, threads=a.threads, jobs=a.jobs)
    _, grids = tuning_plan(a, base_argv, root)
    runner.execute(comparison_runs(a, base_argv, root, grids), root, log=log,
                   threads=a.threads, jobs=a.jobs)
    return grids


# ----------------------------------------------------------------------------- summary
def _infos(a, base_argv, root, family, setting, v, lr):
    out = []
    for seed in range(1, a.seeds + 1):
        r = make_run(a, base_argv, family, setting, v, lr, seed,
                     stock_width(a, root, family, setting) if v == "stock" else None)
        d = os.path.join(root, r.key)
        if runner.is_done(d, r.train_iters):
            out.append(dict(seed=seed, curve=runner.val_curve(d),
                            final=runner.val_curve(d)[-1][1],
                            params=runner.read_json(os.path.join(d, "params.json"), {}),
                            wall=runner.read_json(os.path.join(d, "wall.json"), {})
                            .get("wall_s")))
    return out


def paired(infos, ref) -> dict:
    """Per-seed paired difference infos - ref: mean, 95% CI, sd, seeds for 0.02 / 0.03."""
    r = {i["seed"]: i["final"] for i in ref}
    d = [i["final"] - r[i["seed"]] for i in infos if i["seed"] in r]
    m, h = stats.t_interval(d) if d else (math.nan, math.nan)
    sd = stats.std(d)
    return dict(n=len(d), mean=m, lo=m - h, hi=m + h, sd=sd,
                need=tuning.seeds_for_effects(sd), resolved=math.isfinite(h) and
                (m - h > 0 or m + h < 0))


def summarize(a, base_argv, root, grids) -> list:
    """One row per (family, setting, variant) with its grid, best LR and comparison; the
    candidates and every baseline get their paired difference to the strongest baseline."""
    rows = []
    for family in a.families:
        for setting in settings(a, log=lambda _: None):
            fam = {}
            for v in variants(a):
                grid, got = grids.get((family, setting, v), (None, None))
                if got is None:
                    continue
                infos = _infos(a, base_argv, root, family, setting, v, got[0])
                fam[v] = dict(family=family, setting=setting, variant=v, grid=grid,
                              best_lr=got[0], edge=got[1], tune_losses=got[2], infos=infos,
                              val_mean=stats.mean(i["final"] for i in infos),
                              val_std=stats.std(i["final"] for i in infos))
            base = {v: fam[v]["val_mean"] for v in a.baselines if v in fam and fam[v]["infos"]}
            top = tuning.strongest(base) if base else None
            for v, row in fam.items():
                row["strongest"] = top
                row["role"] = "baseline" if v in a.baselines else "candidate"
                ref = fam[top]["infos"] if top else []
                row["vs_strongest"] = paired(row["infos"], ref) if v != top else None
                row["vs_shared"] = (paired(row["infos"], fam["shared"]["infos"])
                                    if "shared" in fam and v != "shared" else None)
                p = [i["params"].get("total") for i in row["infos"] if i["params"]]
                row["params"] = p[0] if p else math.nan
                iters = runner.train_iters(a, family)
                row["tokens_per_param"] = (iters * a.seq_length * a.micro_batch_size
                                           / row["params"] if p else math.nan)
                walls = [i["wall"] for i in row["infos"] if i["wall"]]
                row["wall_s"] = stats.mean(walls) if walls else math.nan
                rows.append(row)
    return rows


def _g(x, fmt):
    return "" if not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, fmt)


def _ci(p):
    return f"[{_g(p['lo'], '+.4f')}, {_g(p['hi'], '+.4f')}]" if p and p["n"] > 1 else ""


TUNED_HEADER = ("| family | setting | variant | LR grid: tuning loss | best LR | seeds | "
                "final val (mean ± std) | Δ vs strongest baseline (paired) | 95% CI | resolved | "
                "paired sd | seeds for 0.02 / 0.03 | Δ vs shared | params | tokens/param | s/run |")


def markdown(rows) -> str:
    lines = [TUNED_HEADER, "|" + " --- |" * (TUNED_HEADER.count("|") - 1)]
    for r in rows:
        grid = ", ".join(f"{lr:g}: {stats.mean(r['tune_losses'][lr]):.3f}"
                         for lr in sorted(r["tune_losses"]))
        edge = tuning.edge_note(r["edge"])
        p, q = r["vs_strongest"], r["vs_shared"]
        name = r["variant"] + (" (strongest baseline)" if r["variant"] == r["strongest"] else "")
        need = f"{_g(p['need'][0.02], '')} / {_g(p['need'][0.03], '')}" if p else ""
        lines.append(
            f"| {r['family']} | {r['setting']} | {name} | {grid} | {r['best_lr']:g}"
            f"{' **(' + edge + ')**' if edge else ''} | {len(r['infos'])} | "
            f"{_g(r['val_mean'], '.4f')} ± {_g(r['val_std'], '.4f')} | "
            f"{_g(p['mean'], '+.4f') if p else '0'} | {_ci(p)} | "
            f"{('yes' if p['resolved'] else 'no') if p and p['n'] > 1 else ''} | "
            f"{_g(p['sd'], '.4f') if p else ''} | {need} | "
            f"{_g(q['mean'], '+.4f') + ' ' + _ci(q) if q else ''} | {_g(r['params'], ',')} | "
            f"{_g(r['tokens_per_param'], '.2f')} | {_g(r['wall_s'], '.0f')} |")
    return "\n".join(lines) + "\n"


def plot(rows, out_dir) -> list:
    """Per (family, setting): mean validation curve of each variant at its best LR, and the
    paired difference of each candidate to the strongest baseline (95% t-band over seeds)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    paths = []
    for key in sorted({(r["family"], r["setting"]) for r in rows}):
        grp = [r for r in rows if (r["family"], r["setting"]) == key and r["infos"]]
        if not grp:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        ref = next((r for r in grp if r["variant"] == r["strongest"]), None)
        for k, r in enumerate(grp):
            c = plt.get_cmap("tab10")(k % 10)
            curves = [dict(i["curve"]) for i in r["infos"]]
            its = sorted(set.intersection(*(set(x) for x in curves)))
            ax1.plot(its, [stats.mean(x[t] for x in curves) for t in its], ".-", color=c,
                     label=f"{r['variant']} @ {r['best_lr']:g}")
            if ref is None or r is ref:
                continue
            rc = {i["seed"]: dict(i["curve"]) for i in ref["infos"]}
            band = [stats.t_interval([dict(i["curve"])[t] - rc[i["seed"]][t]
                                      for i in r["infos"] if i["seed"] in rc])
                    for t in its]
            m = [b[0] for b in band]
            h = [b[1] if math.isfinite(b[1]) else 0.0 for b in band]
            ax2.plot(its, m, ".-", color=c, label=f"{r['variant']} − {ref['variant']}")
            ax2.fill_between(its, [x - y for x, y in zip(m, h)],
                             [x + y for x, y in zip(m, h)], color=c, alpha=0.12)
        ax2.axhline(0, color="k", lw=0.8)
        ax1.set_title(f"{key[0]} {key[1]}: val loss at each variant's best LR (seed mean)")
        ax2.set_title("paired Δ vs strongest baseline (95% t-band over seeds)")
        paths.append(save_panels(plt, fig, (ax1, ax2),
                                 os.path.join(out_dir, f"tuned_{key[0]}_{key[1]}.png")))
    return paths


def save_panels(plt, fig, axes, path: str, log_loss: bool = True, legend_size: int = 7) -> str:
    """Finish a (loss, paired delta) figure the same way for every evidence plot: iteration
    axes, grid, legends, log loss axis (``log_loss``); write it and return its path."""
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    if log_loss:
        axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(a, base_argv, root, grids, log=print) -> list:
    rows = summarize(a, base_argv, root, grids)
    md = markdown(rows)
    notes = [f"- {s}: {muon_available()}" for s in a.settings
             if parse_setting(s)[0] == "muon" and muon_available()]
    for (family, setting, v), (_, got) in grids.items():
        if got is None:
            notes.append(f"- {family} {setting} {v}: tuning unfinished")
        elif v == "stock":
            notes.append(f"- {family} {setting}: stock = megatron-core spec, FFN "
                         f"{stock_width(a, root, family, setting)} (width-matched to unified)")
    for r in rows:
        p = r["vs_strongest"]
        if r["role"] == "candidate" and p and math.isfinite(p["sd"]):
            n2, n3 = p["need"][0.02], p["need"][0.03]
            notes.append(f"- {r['family']} {r['setting']} {r['variant']} vs {r['strongest']}: "
                         f"paired sd {p['sd']:.4f} over {p['n']} seeds; resolving an effect "
                         f"of 0.02 needs {n2} paired seeds, of 0.03 {n3}; this one is "
                         f"{'resolved' if p['resolved'] else 'not resolved'}")
    text = "# Tuned comparison\n\n" + md + "\n" + "\n".join(notes) + "\n"
    with open(os.path.join(root, "tuned.md"), "w") as f:
        f.write(text)
    plot(rows, root)
    log(md + "\n".join(notes))
    return rows
