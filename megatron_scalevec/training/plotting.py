"""Loss curves and gamma evolution from ``metrics.jsonl`` (no TensorBoard needed).

The loss plot is titled with each run's configuration (``config.json`` beside the metrics) and
marks iterations whose loss or gradient norm was non-finite. The gamma plot shows, for every run
given (ER, OR and plain alike), one row per kind of vector (attention / MLP input and output,
router, Pre-Norm, final norm) with the vector norms, (OR) the magnitude beta and the
conservation quantity, each branch averaged over layers and experts with their range shaded,
legends outside the panels.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

MAX_LINES = 12
_LAYER = re.compile(r"layers\.\d+\.")


def read_metrics(run_dir: str) -> list:
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _beside(run_dir: str, name: str) -> dict:
    """JSON file ``name`` beside the run's metrics; {} when missing or unreadable."""
    path = os.path.join(os.path.dirname(run_dir) if run_dir.endswith(".jsonl") else run_dir,
                        name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def read_config(run_dir: str) -> dict:
    return _beside(run_dir, "config.json")


def describe(run_dir: str) -> str:
    """'name: spec strategy, L layers x h, E experts, lr, batch' (what is known)."""
    c = read_config(run_dir)
    name = os.path.basename(os.path.normpath(run_dir)).removesuffix(".jsonl")
    if not c:
        return name
    moe = f", {c['num_experts']} experts" if c.get("num_experts") else ""
    return (f"{name}: {c.get('spec')} {c.get('scalevec')}, {c.get('num_layers')}x"
            f"{c.get('hidden_size')}{moe}, lr {c.get('lr')}, batch "
            f"{c.get('global_batch_size')}x{c.get('seq_length')}")


def nonfinite_iterations(recs: list) -> list:
    return [r["iteration"] for r in recs if r.get("nonfinite") or "diverged" in r]


def _plt():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot_loss(run_dirs, out_png: str):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in run_dirs:
        recs = read_metrics(run)
        label = os.path.basename(os.path.normpath(run))
        tr = [(r["iteration"], r["loss"]) for r in recs if r.get("loss") is not None]
        va = [(r["iteration"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if tr:
            ax.plot(*zip(*tr), label=f"{label} train")
        if va:
            ax.plot(*zip(*va), "o--", label=f"{label} val")
        for i, it in enumerate(nonfinite_iterations(recs)):
            ax.axvline(it, color="red", ls=":", lw=1,
                       label=f"{label}: non-finite" if i == 0 else None)
    ax.set_title("\n".join(describe(r) for r in run_dirs), fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return fig


def gamma_series(recs: list, stat: str, grouped: bool) -> dict:
    """{label: [(iteration, value)]} of one statistic ('conservation', 'norm', 'beta');
    ``grouped`` averages each branch over the layers (``layers.N.`` removed from the name)."""
    keys = sorted({k for r in recs for k in r if k.startswith("sv/") and
                   k.endswith("/" + stat)})
    out = defaultdict(lambda: defaultdict(list))
    for k in keys:
        label = k[3:].rsplit("/", 1)[0]
        if grouped:
            label = _LAYER.sub("", label)
        for r in recs:
            if r.get(k) is not None:
                out[label][r["iteration"]].append(r[k])
    return {lab: sorted((it, sum(v) / len(v)) for it, v in pts.items())
            for lab, pts in out.items()}


# Vector kinds, one row of panels each, from (site, side) in vectors.json (declared.sites)
_KINDS = {
    ("attention", "in"): "attention input (HG)",
    ("attention", "out"): "attention output (DP / DNP)",
    ("attention", "norm"): "attention output (DP / DNP)",
    ("router", "in"): "router input (HG)",
    ("mlp", "in"): "MLP / expert input (HG)",
    ("mlp", "out"): "MLP / expert output (DP / DNP)",
    ("mlp", "norm"): "MLP / expert output (DP / DNP)",
    ("pre", "pre"): "Pre-Norm (shared)",
    ("final", "pre"): "final norm",
}
_STATS = (("norm", "||gamma||"), ("beta", "OR magnitude beta"),
          ("conservation", "mean_j gamma_j^2 - ||w_j||^2"))


def read_sites(run_dir: str) -> dict:
    """vectors.json beside the metrics ({"sv/<path>": [site, side, branch]}); {} for a run
    that has none (its vectors plot as "other")."""
    return _beside(run_dir, "vectors.json")


def vector_kind(key: str, sites: dict):
    """(kind, branch) of a logged vector ``sv/<path>``, e.g. ('attention input (HG)', 'q')."""
    site, side, branch = sites.get(key, (None, None, None))
    kind = _KINDS.get((site, side), "other")
    return kind, branch or (site if kind != "other" else key.rsplit(".", 1)[-1])


def gamma_panels(recs: list, stat: str, sites: dict) -> dict:
    """{kind: {branch: [(iteration, mean, min, max)]}}: each branch's statistic over its layers
    and experts (the mean, and the spread as a band)."""
    out = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in recs:
        for k, v in r.items():
            if k.startswith("sv/") and k.endswith("/" + stat) and v is not None:
                kind, branch = vector_kind(k.rsplit("/", 1)[0], sites)
                out[kind][branch][r["iteration"]].append(v)
    return {kind: {b: [(it, sum(v) / len(v), min(v), max(v)) for it, v in sorted(pts.items())]
                   for b, pts in branches.items()} for kind, branches in out.items()}


def plot_gamma(run_dirs, out_png: str):
    """One row of panels per vector kind, one column per statistic; a line per branch (mean
    over layers and experts, their spread shaded), a line style per run; each row's legend
    outside its panels."""
    plt = _plt()
    runs = [(os.path.basename(os.path.normpath(r)), read_metrics(r), read_sites(r))
            for r in run_dirs]
    # a parameterization's own statistics (Parameterization.statistics) after the known ones
    found = {k.rsplit("/", 1)[1] for _, recs, _ in runs for r in recs for k in r
             if k.startswith("sv/")}
    every = list(_STATS) + [(s, s) for s in sorted(found - {s for s, _ in _STATS})]
    data = [(name, {s: gamma_panels(recs, s, sites) for s, _ in every})
            for name, recs, sites in runs]
    order = [*dict.fromkeys(_KINDS.values()), "other"]
    kinds = [k for k in order if any(k in p[s] for _, p in data for s, _ in every)]
    stats = [(s, t) for s, t in every if any(p[s] for _, p in data)]
    if not kinds:
        kinds, stats = ["no scale-vector statistics logged"], _STATS[:1]
    fig, axes = plt.subplots(len(kinds), len(stats), squeeze=False, layout="constrained",
                             figsize=(4.2 * len(stats) + 2.2, 2.3 * len(kinds) + 0.8))
    styles = ("-", "--", ":", "-.")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, kind in zip(axes, kinds):
        legend = {}
        for ax, (stat, title) in zip(row, stats):
            for ri, (name, panels) in enumerate(data):
                for bi, (branch, pts) in enumerate(sorted(panels[stat].get(kind, {}).items())):
                    it, mean, lo, hi = zip(*pts)
                    color = colors[bi % len(colors)]
                    (line,) = ax.plot(it, mean, ls=styles[ri % len(styles)], color=color,
                                      lw=1.0)
                    if lo != hi:
                        ax.fill_between(it, lo, hi, color=color, alpha=0.15, lw=0)
                    legend.setdefault(f"{name}: {branch}" if len(data) > 1 else branch, line)
            ax.set_title(f"{kind}: {title}", fontsize=8)
            ax.set_xlabel("iteration", fontsize=7)
            ax.set_ylabel(stat, fontsize=7)
            ax.tick_params(labelsize=6)
            ax.grid(alpha=0.3)
            if not ax.lines:
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{kind}: no {stat} logged", ha="center", va="center",
                        fontsize=7, transform=ax.transAxes)
        if legend:
            row[-1].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left",
                           bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.suptitle("\n".join([*(describe(r) for r in run_dirs), "lines: mean over layers and "
                            "experts; shading: their range; line style: run"]), fontsize=8)
    fig.savefig(out_png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return fig


def plot_runs(run_dirs, out_png: str, gamma_png=None) -> None:
    """Train/val loss of every run in one figure; optionally the scale-vector statistics of
    every run in a second one."""
    plot_loss(run_dirs, out_png)
    if gamma_png:
        plot_gamma(run_dirs, gamma_png)
