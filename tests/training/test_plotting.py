"""Plots of a run's metrics: titled loss plot marking non-finite steps; gamma plot with one row
of panels per kind of vector, a line per branch for every run given (ER included), legends
outside the panels."""

import json

import pytest

pytest.importorskip("matplotlib")

from megatron_scalevec.training.plotting import plot_gamma, plot_loss  # noqa: E402


def _run(path, strategy, layers, beta, diverge=False):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        spec="scalevec_dense", scalevec=strategy, num_layers=layers, hidden_size=32, lr=0.01,
        global_batch_size=8, seq_length=16)))
    recs, sites = [], {}
    for it in range(1, 6):
        r = dict(iteration=it, loss=5.0 - it * 0.1)
        for layer in range(layers):
            for br in ("scale_in.q", "scale_in.k", "scale_in.v"):
                key = f"sv/decoder.layers.{layer}.self_attention.linear_qkv.{br}"
                sites[key] = ["attention", "in", br[-1]]
                r[f"{key}/norm"] = 1.0 + 0.01 * it
                r[f"{key}/conservation"] = 0.1 * layer
                if beta:
                    r[f"{key}/beta"] = 1.0
        recs.append(r)
    if diverge:
        recs.append(dict(iteration=6, loss=None, nonfinite=["loss"], diverged="x"))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "vectors.json").write_text(json.dumps(sites))
    return str(path)


def test_loss_plot_title_and_nonfinite_marks(tmp_path):
    a = _run(tmp_path / "a", "hg+dnp+or+iwd", 2, True, diverge=True)
    fig = plot_loss([a], str(tmp_path / "loss.png"))
    ax = fig.axes[0]
    assert "hg+dnp+or+iwd" in ax.get_title() and "2x32" in ax.get_title()
    marks = [ln for ln in ax.lines if list(ln.get_xdata()) == [6, 6]]
    assert marks and "non-finite" in marks[0].get_label()
    assert (tmp_path / "loss.png").stat().st_size > 0


def _moe_unified(path, layers=4, experts=8):
    """The vector statistics a unified MoE run logs (names as the trainer writes them)."""
    path.mkdir()
    recs, sites = [], {"sv/decoder.final_layernorm": ["final", "pre", None]}
    for it in range(1, 6):
        r = dict(iteration=it, loss=5.0 - it * 0.1)
        for layer in range(layers):
            head = f"sv/decoder.layers.{layer}."
            names = {f"self_attention.linear_qkv.scale_in.{b}": ["attention", "in", b]
                     for b in "qkv"}
            names.update({f"self_attention.{b}_norm": ["attention", "norm", b] for b in "qkv"})
            names["mlp.router.scale_in"] = ["router", "in", None]
            for e in range(experts):
                ex = f"mlp.experts.local_experts.{e}."
                for b in ("gate", "up"):
                    names[f"{ex}linear_fc1.scale_in.{b}"] = ["mlp", "in", b]
                    names[f"{ex}{b}_norm"] = ["mlp", "norm", b]
            sites.update({head + n: where for n, where in names.items()})
            for n in names:
                r[f"{head}{n}/norm"] = 8.0 + 0.01 * it * (layer + 1)
                r[f"{head}{n}/beta"] = 1.0 + 0.001 * it
                if ".scale_in." in n:
                    r[f"{head}{n}/conservation"] = 0.9 - 0.01 * it
        r["sv/decoder.final_layernorm/norm"] = 8.0
        recs.append(r)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "vectors.json").write_text(json.dumps(sites))
    return str(path)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_gamma_plot_one_row_per_vector_kind_legends_outside(tmp_path, recwarn):
    """~450 logged vectors of a unified MoE run: one row per kind of vector, a line per branch
    (layers and experts averaged), no legend over any panel, nothing cut at the edges."""
    runs = [_moe_unified(tmp_path / "moe"), _run(tmp_path / "er", "hg+dp+er", 8, False)]
    out = tmp_path / "gamma.png"
    fig = plot_gamma(runs, str(out))
    titles = [ax.get_title().split(":")[0] for ax in fig.axes]
    kinds = list(dict.fromkeys(titles))
    assert kinds == ["attention input (HG)", "attention output (DP / DNP)", "router input (HG)",
                     "MLP / expert input (HG)", "MLP / expert output (DP / DNP)", "final norm"]
    assert len(fig.axes) == 3 * len(kinds)  # norm, beta, conservation for every kind
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == len(kinds)
    assert max(len(lg.get_texts()) for lg in legends) <= 6  # e.g. moe: q/k/v, er: q/k/v
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in fig.axes if ax.axison]
    for lg in legends:
        box = lg.get_window_extent(renderer)
        assert not any(_overlaps(box, ax) for ax in boxes), "a legend covers a panel"
    er_norm = fig.axes[2 * 0].lines  # attention input, norm: both runs' branches
    assert len(er_norm) == 6
    assert not [w for w in recwarn if "layout" in str(w.message).lower()]
    assert out.stat().st_size > 0
