"""Tables, JSON and the figure of the vector-LR sweep (evidence/vector_lr.py).

Every difference is paired per comparison seed (same initial matrices and data order) with a
95% Student-t interval; the tuning losses (one run per point and tuning seed) only pick the
configurations and draw the figure's lines.
"""

from __future__ import annotations

import json
import math
import os

from evidence import stats
from evidence.tuned import paired

REF = "tuned LR, vectors x1"
BEST = "best pair"


def finals(a, plan, w, v, lr, m) -> list:
    """[{seed, final}] of the comparison seeds that finished."""
    out = []
    for seed in range(1, a.seeds + 1):
        got = plan.final_loss(w, v, lr, m, seed)
        if got is not None:
            out.append(dict(seed=seed, final=got))
    return out


def rows(a, plan, root) -> list:
    """One row per comparison configuration, with its paired differences."""
    table = []
    for w, v, label, lr, m in plan.comparison():
        table.append(dict(width=w, variant=v, label=label, lr=lr, mult=m,
                          infos=finals(a, plan, w, v, lr, m)))
    by = {(r["width"], r["variant"], r["label"]): r for r in table}
    for r in table:
        w = r["width"]
        for name, key in (("vs_shared_x1", (w, "shared", REF)),
                          ("vs_shared_best", (w, "shared", BEST)),
                          ("vs_own_x1", (w, r["variant"], REF)),
                          ("vs_reference", (w, a.reference, BEST))):
            ref = by.get(key)
            r[name] = paired(r["infos"], ref["infos"]) if ref and ref is not r else None
        fin = [i["final"] for i in r["infos"]]
        r["mean"], r["std"] = stats.mean(fin), stats.std(fin)
    return table


def _g(x, fmt):
    return "" if not isinstance(x, (int, float)) or not math.isfinite(x) else format(x, fmt)


def _delta(p) -> str:
    if not p or not p["n"]:
        return ""
    ci = f" [{_g(p['lo'], '+.3f')}, {_g(p['hi'], '+.3f')}]" if p["n"] > 1 else ""
    return f"{_g(p['mean'], '+.3f')}{ci}"


def _grid(losses: dict, fmt=lambda x: f"{x:g}") -> str:
    return ", ".join(f"{fmt(x)}: {stats.mean(ls):.3f}" for x, ls in sorted(losses.items()))


def tuning_markdown(a, plan) -> str:
    head = ("| width | variant | iters | base-LR grid (vectors x1): loss | lr0 | multiplier grid "
            "at lr0: loss | refinement at m* | best pair (LR, mult) |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for (w, v), st in plan.state.items():
        if "best" not in st:
            lines.append(f"| {w} | {v} | {plan.iters(w)} | (unfinished) |  |  |  |  |")
            continue
        refine = {k: ls for k, ls in st["pairs"].items() if k[0] != st["lr0"]}
        edge = {"low": " (low edge)", "high": " (high edge)"}
        lines.append(
            f"| {w} | {v} | {plan.iters(w)} | {_grid(st['lr_losses'])} | {st['lr0']:g}"
            f"{edge.get(st['lr_edge'], '')} | {_grid(st['m_losses'])}"
            f"{edge.get(st['m_edge'], '')} | "
            f"{_grid(refine, fmt=lambda k: f'LR {k[0]:g}')} | "
            f"{st['best'][0]:g}, x{st['best'][1]:g} |")
    return "\n".join(lines) + "\n"


def comparison_markdown(table, reference=None) -> str:
    deltas = [("Δ vs shared (tuned LR, x1)", "vs_shared_x1"),
              ("Δ vs shared (best pair)", "vs_shared_best"), ("Δ vs own tuned LR x1", "vs_own_x1")]
    if reference:
        deltas.append((f"Δ vs {reference} (best pair)", "vs_reference"))
    head = ("| width | variant | configuration | LR | vector mult | seeds | final val (mean ± sd) "
            + "".join(f"| {h} " for h, _ in deltas) + "|")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in table:
        lines.append(
            f"| {r['width']} | {r['variant']} | {r['label']} | {r['lr']:g} | {r['mult']:g} | "
            f"{len(r['infos'])} | {_g(r['mean'], '.4f')} ± {_g(r['std'], '.4f')} | "
            + " | ".join(_delta(r[k]) for _, k in deltas) + " |")
    return "\n".join(lines) + "\n"


def plot(records: list, path: str) -> str:
    """Per width: tuning loss against the multiplier at each variant's tuned base LR (lines),
    and the comparison seeds' mean with its 95% t-interval at x1 and at the best pair
    (markers). ``records``: the ``vector_lr*.json`` contents of one or more sweeps."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    state = {k: v for r in records for k, v in r["state"].items()}
    table = [row for r in records for row in r["comparison"]]
    widths = sorted({int(k.split("/")[0][1:]) for k in state})
    variants = list(dict.fromkeys(k.split("/", 1)[1] for k in state))
    fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 4.2), squeeze=False)
    for ax, w in zip(axes[0], widths):
        for k, v in enumerate(variants):
            st = state.get(f"h{w}/{v}", {})
            if "m_losses" not in st:
                continue
            c = plt.get_cmap("tab10")(k)
            ms = sorted(st["m_losses"], key=float)
            ax.plot([float(m) for m in ms], [stats.mean(st["m_losses"][m]) for m in ms], "o-",
                    color=c, alpha=0.6, label=f"{v} (LR {st['lr0']:g}, tuning seed)")
            for r in table:
                if (r["width"], r["variant"]) == (w, v) and r["label"] in (REF, BEST) \
                        and len(r["infos"]) > 1:
                    m, h = stats.t_interval(i["final"] for i in r["infos"])
                    ax.errorbar([r["mult"] * (1.06 if r["label"] == BEST else 0.94)], [m],
                                yerr=[h], fmt="s" if r["label"] == BEST else "D", color=c,
                                capsize=3, ms=5)
        ax.set_xscale("log")
        ticks = sorted({float(m) for k, st in state.items() if k.startswith(f"h{w}/")
                        for m in st.get("m_losses", {})})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("vector LR multiplier (--vector-lr-mult)")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"hidden {w}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="lines: tuning seed; markers: comparison seeds, mean and "
                  "95% CI\n(diamond: tuned LR x1, square: best pair, at its LR)",
                  title_fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(a, plan, root, log=print) -> list:
    """``<name>.md`` (tables), ``<name>.json`` (everything) and ``<name>.png`` under ``root``."""
    table = rows(a, plan, root)
    md = ("# The scale vectors' learning rate\n\n## Tuning (tuning seeds)\n\n"
          + tuning_markdown(a, plan) + "\n## Comparison (paired seeds 1.."
          + f"{a.seeds}; Δ: paired mean [95% t-interval])\n\n"
          + comparison_markdown(table, a.reference))
    os.makedirs(root, exist_ok=True)
    base = os.path.join(root, a.report_name)
    with open(base + ".md", "w") as f:
        f.write(md)
    state = {f"h{w}/{v}": {k: ({str(x): y for x, y in v_.items()} if isinstance(v_, dict)
                               else v_) for k, v_ in st.items()}
             for (w, v), st in plan.state.items()}
    record = dict(state=state, comparison=table)
    with open(base + ".json", "w") as f:
        json.dump(record, f, indent=1, default=str)
    if any(r["infos"] for r in table):
        plot([json.loads(json.dumps(record, default=str))], base + ".png")
    log(md)
    return table


def combine(paths: list, out: str) -> str:
    """One figure from several sweeps' ``.json`` (e.g. one per width)."""
    records = []
    for p in paths:
        with open(p) as f:
            records.append(json.load(f))
    return plot(records, out)
