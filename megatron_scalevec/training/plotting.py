"""Loss curves and gamma evolution from ``metrics.jsonl`` (no TensorBoard needed).

The loss plot is titled with each run's configuration (``config.json`` beside the metrics) and
marks iterations whose loss or gradient norm was non-finite. The gamma plot shows, for every run
given (ER, OR and plain alike), the conservation quantity, the vector norms and (OR) the
magnitude beta; with many lines they are averaged by branch over the layers.
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


def read_config(run_dir: str) -> dict:
    path = os.path.join(os.path.dirname(run_dir) if run_dir.endswith(".jsonl") else run_dir,
                        "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


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


_PANELS = (("conservation", "mean_j gamma_j^2 - ||w_j||^2"), ("norm", "||gamma||"),
           ("beta", "OR magnitude beta"))


def plot_gamma(run_dirs, out_png: str):
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    styles = ("-", "--", ":", "-.")
    for ri, run in enumerate(run_dirs):
        recs = read_metrics(run)
        name = os.path.basename(os.path.normpath(run))
        for ax, (stat, _) in zip(axes, _PANELS):
            raw = gamma_series(recs, stat, grouped=False)
            per_run_budget = max(1, MAX_LINES // len(run_dirs))
            grouped = len(raw) > per_run_budget
            series = gamma_series(recs, stat, grouped=True) if grouped else raw
            for lab, pts in series.items():
                ax.plot(*zip(*pts), ls=styles[ri % len(styles)], lw=0.9,
                        label=f"{name}: {lab}" + (" (mean over layers)" if grouped else ""))
    for ax, (stat, title) in zip(axes, _PANELS):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.set_ylabel(stat)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=5, ncol=1 + len(ax.lines) // 16)
        else:
            ax.text(0.5, 0.5, f"no {stat} logged", ha="center", transform=ax.transAxes)
    fig.suptitle("\n".join(describe(r) for r in run_dirs), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return fig


def plot_runs(run_dirs, out_png: str, gamma_png=None) -> None:
    """Train/val loss of every run in one figure; optionally the scale-vector statistics of
    every run in a second one."""
    plot_loss(run_dirs, out_png)
    if gamma_png:
        plot_gamma(run_dirs, gamma_png)
