"""The scale vectors' learning rate through Megatron-LM's own ``pretrain_gpt.py``
(``MEGATRON_SCALEVEC_VECTOR_LR_MULT``): every vector's optimizer group runs at the multiplied
LR, peak and floor, to the end of the schedule, everything else at Megatron-LM's, ``shared``
included (its TE layout's fused Pre-Norm gamma too); the decay table prints the vectors' LR; a
resume at another multiplier is refused in one line, or applied with ``--no-load-optim``.

Which parameters are vectors is written here by name (SPEC.md's placements), not read from the
attribute the optimizer rules read.
"""

import os
import re

import pytest

from scalevec_testing import megatron_lm as M
from scalevec_testing.markers import needs_megatron_lm, needs_te

pytestmark = needs_megatron_lm

LR, MIN_LR, MULT = 1e-3, 1e-4, 7.0
# LR schedule longer than the run: at its end every group is mid-cosine, vectors at MULT x
FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine",
         "--lr-decay-iters", "10", "--hidden-dropout", "0", "--attention-dropout", "0"]
VECTOR = re.compile(r"(scale_in\.|_norm\.|layernorm\.|layer_norm_)"
                    r"(\w+\.)?(weight|magnitude|direction|alpha|logit)$")


def _run(tmp_path, strategy, base, extra=(), env=None, name="run", mult=MULT):
    """``mult`` None: the variable unset (the strategy's default)."""
    var = {} if mult is None else {"MEGATRON_SCALEVEC_VECTOR_LR_MULT": f"{mult:g}"}
    return M.run([*M.TINY, *base, *FLAGS, *extra, *M.SPEC, "scalevec_dense"],
                 os.path.join(tmp_path, name),
                 env={"MEGATRON_SCALEVEC": strategy, **var, **(env or {})})


def _check_groups(groups: dict, mult: float) -> int:
    """Every parameter's group at its LR: returns how many vectors were checked."""
    assert groups, "no optimizer groups recorded"
    ref = next(g[3] for n, g in groups.items() if not VECTOR.search(n))
    vectors = 0
    for n, (peak, floor, lr_mult, lr) in groups.items():
        m = mult if VECTOR.search(n) else 1.0
        vectors += VECTOR.search(n) is not None
        assert peak == pytest.approx(LR * m) and floor == pytest.approx(MIN_LR * m), n
        assert lr == pytest.approx(ref * m, rel=1e-9), n  # the scheduler read them
        assert lr_mult == m, n  # a group of its own on load (0.16.1 pairs groups by it)
    return vectors


@pytest.mark.parametrize("strategy,base,mult,want", [
    ("shared", M.LOCAL, MULT, MULT),
    ("unified", M.LOCAL, None, 30.0),  # the variable unset: unified's default
    pytest.param("shared", M.TE, MULT, MULT, marks=needs_te),  # TE's fused layer_norm_weight
])
def test_vectors_train_at_the_multiplied_lr(tmp_path, strategy, base, mult, want):
    out = _run(tmp_path, strategy, base, mult=mult).check()
    assert _check_groups(out.ranks[0]["groups"], want) >= 5
    table = out.output[out.output.index("weight decay groups"):].splitlines()
    row = next(ln for ln in table if ln.split()[:1] in (["vectors"], ["input_vectors"]))
    assert float(row.split()[2]) == pytest.approx(LR * want), row


def test_resume_at_another_multiplier_is_refused_or_applied_deliberately(tmp_path):
    save = os.path.join(tmp_path, "ckpt")
    _run(tmp_path, "shared", M.LOCAL, ("--train-iters", "4", "--save", save, "--save-interval",
                                       "1000", "--exit-interval", "2"), name="first").check()
    resume = ("--train-iters", "4", "--load", save, "--save", save, "--save-interval", "1000")
    before = sorted(os.listdir(save))
    out = _run(tmp_path, "shared", M.LOCAL, resume,
               env={"MEGATRON_SCALEVEC_VECTOR_LR_MULT": "3"}, name="refused")
    lines = [ln for ln in out.output.splitlines() if ln.startswith("megatron_scalevec:")]
    assert out.returncode == 2 and len(lines) == 1, out.output[-3000:]
    assert "shared (vector_lr_mult=7.0) in the checkpoint" in lines[0], lines
    assert "MEGATRON_SCALEVEC_VECTOR_LR_MULT=7" in lines[0] and "--no-load-optim" in lines[0]
    assert sorted(os.listdir(save)) == before  # nothing written
    fresh = _run(tmp_path, "shared", M.LOCAL, (*resume, "--no-load-optim", "--no-load-rng"),
                 env={"MEGATRON_SCALEVEC_VECTOR_LR_MULT": "3"}, name="fresh").check()
    assert sorted(fresh.losses()) == [3, 4]
    _check_groups(fresh.ranks[0]["groups"], 3.0)
