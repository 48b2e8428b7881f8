"""Plots of a run's metrics: titled loss plot marking non-finite steps; gamma plot with axis
labels and legends for every run given, ER runs included, lines grouped when many."""

import json

import pytest

pytest.importorskip("matplotlib")

from megatron_scalevec.training.plotting import plot_gamma, plot_loss  # noqa: E402


def _run(path, strategy, layers, beta, diverge=False):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(
        spec="scalevec_dense", scalevec=strategy, num_layers=layers, hidden_size=32, lr=0.01,
        global_batch_size=8, seq_length=16)))
    recs = []
    for it in range(1, 6):
        r = dict(iteration=it, loss=5.0 - it * 0.1)
        for layer in range(layers):
            for br in ("scale_in.q", "scale_in.k", "scale_in.v"):
                key = f"sv/decoder.layers.{layer}.self_attention.linear_qkv.{br}"
                r[f"{key}/norm"] = 1.0 + 0.01 * it
                r[f"{key}/conservation"] = 0.1 * layer
                if beta:
                    r[f"{key}/beta"] = 1.0
        recs.append(r)
    if diverge:
        recs.append(dict(iteration=6, loss=None, nonfinite=["loss"], diverged="x"))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_loss_plot_title_and_nonfinite_marks(tmp_path):
    a = _run(tmp_path / "a", "hg+dnp+or+iwd", 2, True, diverge=True)
    fig = plot_loss([a], str(tmp_path / "loss.png"))
    ax = fig.axes[0]
    assert "hg+dnp+or+iwd" in ax.get_title() and "2x32" in ax.get_title()
    marks = [ln for ln in ax.lines if list(ln.get_xdata()) == [6, 6]]
    assert marks and "non-finite" in marks[0].get_label()
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_gamma_plot_every_run_er_included_grouped(tmp_path):
    runs = [_run(tmp_path / "or", "hg+dnp+or+iwd", 2, True),
            _run(tmp_path / "er", "hg+dp+er", 8, False)]
    fig = plot_gamma(runs, str(tmp_path / "gamma.png"))
    cons, norm, beta = fig.axes[:3]
    for ax in (cons, norm, beta):
        assert ax.get_xlabel() == "iteration" and ax.get_ylabel()
    labels = [t.get_text() for t in norm.get_legend().get_texts()]
    assert any(lab.startswith("or:") for lab in labels)
    assert any(lab.startswith("er:") for lab in labels)  # ER runs are shown
    er = [lab for lab in labels if lab.startswith("er:")]
    assert len(er) == 3 and all("mean over layers" in lab for lab in er)  # 24 -> 3 branches
    assert len(beta.lines) == 6  # OR only: 2 layers x 3 branches
