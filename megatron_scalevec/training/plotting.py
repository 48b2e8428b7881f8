"""Loss curves and gamma evolution from ``metrics.jsonl`` (no TensorBoard needed)."""

from __future__ import annotations

import json
import os


def read_metrics(run_dir: str) -> list:
    path = run_dir if run_dir.endswith(".jsonl") else os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_runs(run_dirs, out_png: str, gamma_png=None) -> None:
    """Train/val loss of every run in one figure; optionally the conservation quantity and
    vector norms of the first run over iterations in a second figure."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in run_dirs:
        recs = read_metrics(run)
        label = os.path.basename(os.path.normpath(run))
        tr = [(r["iteration"], r["loss"]) for r in recs if "loss" in r]
        va = [(r["iteration"], r["val_loss"]) for r in recs if "val_loss" in r]
        if tr:
            ax.plot(*zip(*tr), label=f"{label} train")
        if va:
            ax.plot(*zip(*va), "o--", label=f"{label} val")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    if gamma_png:
        recs = read_metrics(run_dirs[0])
        keys = sorted({k for r in recs for k in r if k.startswith("sv/")
                       and (k.endswith("/conservation") or k.endswith("/beta"))})
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for k in keys:
            pts = [(r["iteration"], r[k]) for r in recs if k in r]
            a = axes[0] if k.endswith("/conservation") else axes[1]
            a.plot(*zip(*pts), label=k[3:].rsplit("/", 1)[0], lw=0.8)
        axes[0].set_title("mean_j gamma_j^2 - ||w_j||^2")
        axes[1].set_title("OR magnitude beta")
        for a in axes:
            a.set_xlabel("iteration")
            if len(a.lines) <= 12:
                a.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(gamma_png, dpi=120)
        plt.close(fig)
