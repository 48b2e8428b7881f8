"""The scale vectors' learning rate (``ScaleVecConfig.vector_lr_mult``) in megatron-core's
optimizer: one SGD step (whose update shows the LR) moves every vector by mult x LR x its
gradient and everything else by its own LR (the matrices' LR, ``--decoupled-lr`` for the
embedding and output layer); the schedule's floor is scaled too; decay is untouched; every
group keeps its LR through a save and resume, and a resume at another multiplier is refused.

Which parameters are vectors is written here by *name* (SPEC.md's placements), not read from
the attribute optim.py reads, so a wrong attribute or rule shows up as a mismatch.
"""

import re

import pytest

from megatron_scalevec.config import ScaleVecConfig
from scalevec_testing.distributed import RankError, init_model_parallel, run_on_ranks
from scalevec_testing.trainer_flags import OVR, TINY, run_trainer

LR, MULT, DECOUPLED = 0.05, 7.0, 0.02
EPS32 = 2.0 ** -23
VECTOR = re.compile(r"(scale_in\.|scale_out\.|_norm\.|layernorm\.)"
                    r"(\w+\.)?(weight|magnitude|direction|alpha|logit)$")
EMBEDDING_OR_OUTPUT = re.compile(r"(word_embeddings|output_layer)\.weight$")


def expected_lr(name: str, mult: float) -> float:
    if VECTOR.search(name):
        return LR * mult
    return DECOUPLED if EMBEDDING_OR_OUTPUT.search(name) else LR


def _build(strategy, mult, normalization="RMSNorm", dist_opt=False, weight_decay=0.0):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_scalevec.optim import build_optimizer
    from scalevec_testing.models import LINEAR_ADAM_EPS, build_gpt, tiny_config, wrap_ddp

    init_model_parallel()
    cfg = ScaleVecConfig.from_string(strategy, vector_lr_mult=mult)
    config = tiny_config(normalization=normalization)
    ddp = wrap_ddp(build_gpt(config, cfg), config, dist_opt)
    # the distributed optimizer takes Adam only: beta1 = 0 and eps >> |g| make it SGD at
    # lr / eps (scalevec_testing.models.make_optimizer)
    scale = LINEAR_ADAM_EPS if dist_opt else 1.0
    kw = dict(optimizer="adam", adam_beta1=0.0, adam_eps=LINEAR_ADAM_EPS) if dist_opt else \
        dict(optimizer="sgd", sgd_momentum=0.0)
    opt_cfg = OptimizerConfig(lr=LR * scale, min_lr=LR * scale / 10, decoupled_lr=DECOUPLED *
                              scale, decoupled_min_lr=DECOUPLED * scale / 10,
                              weight_decay=weight_decay, clip_grad=0.0,
                              use_distributed_optimizer=dist_opt, **kw)
    lines = []
    opt = build_optimizer(opt_cfg, [ddp], cfg, log=lines.append)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=LR * scale, min_lr=LR * scale / 10, lr_warmup_steps=0,
        lr_decay_steps=10, lr_decay_style="cosine", start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=10, wd_incr_style="constant")
    return config, ddp, opt, sched, scale, lines


def _step(rank, world, strategy, mult, normalization="RMSNorm", dist_opt=False):
    """Per parameter the LR its first step used (-<delta, g> / <g, g>), the floor its group
    reaches at the schedule's end (non-distributed optimizer), and the decay table."""
    from scalevec_testing.models import batches, train_steps

    config, ddp, opt, sched, _, lines = _build(strategy, mult, normalization, dist_opt)
    train_steps(ddp, config, batches(2, 2), 1)  # gradients only (no optimizer)
    named = list(ddp.named_parameters())
    before = {n: p.detach().clone() for n, p in named}
    grads = {n: p.main_grad.detach().clone() for n, p in named}
    opt.step()
    used, bad = {}, []
    for n, p in named:
        g, d = grads[n], before[n] - p.detach()
        if float((g * g).sum()) == 0:
            continue
        used[n] = float((d * g).sum()) / float((g * g).sum())
        # elementwise, relative to scale: fp32 rounding of p (a few ulp) and of lr * g
        want = expected_lr(n, mult) * g
        err = (d - want).abs() / (4 * EPS32 * before[n].abs() + 1e-4 * want.abs() + 1e-30)
        if float(err.max()) > 1.0:
            bad.append(f"{n}: step at LR {used[n]:.6g}, expected {expected_lr(n, mult):.6g}")
    floors = {}
    if not dist_opt:
        sched.step(10)
        names = {id(p): n for n, p in named}
        floors = {names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}
    return used, bad, floors, "\n".join(lines)


@pytest.mark.parametrize("strategy,normalization,dist_opt", [
    ("shared", "RMSNorm", False),
    ("unified", "RMSNorm", False),
    ("hg+dp+er+iwd", "LayerNorm", False),  # ER parts; LayerNorm biases stay at the base LR
    ("unified", "RMSNorm", True),          # the distributed optimizer's own param groups
])
def test_each_vector_steps_at_the_multiplied_lr(strategy, normalization, dist_opt):
    used, bad, floors, table = run_on_ranks(_step, 1, strategy, MULT, normalization,
                                            dist_opt)[0]
    assert not bad, "\n".join(bad)
    assert sum(bool(VECTOR.search(n)) for n in used) >= 5, sorted(used)
    assert any(EMBEDDING_OR_OUTPUT.search(n) for n in used)
    for n, floor in floors.items():  # the schedule's floor is scaled with the peak
        assert floor == pytest.approx(expected_lr(n, MULT) / 10, rel=1e-6), n
    if normalization == "LayerNorm":
        assert any(n.endswith("layernorm.bias") for n in used)
    from scalevec_testing.models import LINEAR_ADAM_EPS

    base = LR * (LINEAR_ADAM_EPS if dist_opt else 1.0)  # the table prints the configured LR
    rows = {ln.split()[0]: float(ln.split()[2]) for ln in table.splitlines()[2:]}
    assert all(rows[r] == pytest.approx(base * MULT, rel=1e-3) for r in rows if "vectors" in r
               or r == "input_directions"), table
    assert rows["matrices"] == pytest.approx(base, rel=1e-3), table


def test_multiplier_one_is_megatron_cores_groups():
    """At 1 nothing changes: the same steps as without the option, no group of its own."""
    used, bad, _, table = run_on_ranks(_step, 1, "unified", 1.0)[0]
    assert used and not bad, "\n".join(bad)


def _groups(rank, world, strategy, mult, weight_decay):
    _, ddp, opt, _, _, _ = _build(strategy, mult, "LayerNorm", weight_decay=weight_decay)
    names = {id(p): n for n, p in ddp.named_parameters()}
    return {names[id(p)]: (g["weight_decay"], g["wd_mult"], g["lr_mult"])
            for g in opt.param_groups for p in g["params"]}


def test_decay_is_untouched_and_vector_groups_stay_apart():
    """IWD's decay per parameter is the same at x1 and x7; every vector group has an
    ``lr_mult`` no other group has (megatron-core 0.16.1 pairs groups on load by (wd_mult,
    lr_mult, expert, decoupled) only)."""
    one = run_on_ranks(_groups, 1, "unified", 1.0, 0.1)[0]
    seven = run_on_ranks(_groups, 1, "unified", MULT, 0.1)[0]
    assert {n: v[:2] for n, v in one.items()} == {n: v[:2] for n, v in seven.items()}
    vec = {v[2] for n, v in seven.items() if VECTOR.search(n)}
    other = {v[2] for n, v in seven.items() if not VECTOR.search(n)}
    assert vec == {MULT} and other == {1.0}


def _resumed_groups(rank, world, argv):
    """The trainer built on ``argv`` (a resume when it names --load): each parameter's
    (max_lr, min_lr) after the checkpoint is loaded."""
    from megatron_scalevec.training.arguments import parse_args
    from megatron_scalevec.training.trainer import Trainer

    t = Trainer(parse_args(argv, world_size=world))
    names = {id(p): n for m in t.model for n, p in m.named_parameters()}
    out = {names[id(p)]: (g["max_lr"], g["min_lr"]) for g in t.optimizer.param_groups
           for p in g["params"]}
    t.log.close()
    return out


def test_save_and_resume_keep_every_groups_lr(tmp_path):
    """LayerNorm (biases: a no-decay group beside the vectors'); after the resume every
    parameter's group has the LR it had when it was saved."""
    ck = tmp_path / "ck"
    base = TINY + ["--normalization", "LayerNorm", "--scalevec", "hg+dp+er+iwd", "--lr",
                   f"{LR}", "--min-lr", f"{LR / 10}"]

    def flags(mult, iters, run, *extra):
        return [*base, "--vector-lr-mult", mult, "--train-iters", iters, "--run-dir",
                str(tmp_path / run), *extra]

    run_on_ranks(run_trainer, 1, flags("7", "2", "a", "--save", str(ck)))
    fresh = run_on_ranks(_resumed_groups, 1, flags("7", "4", "b"))[0]
    resumed = run_on_ranks(_resumed_groups, 1, flags("7", "4", "c", OVR, "--load", str(ck)))[0]
    assert resumed == fresh
    for n, (peak, floor) in resumed.items():
        want = LR * 7 if VECTOR.search(n) else LR
        assert peak == pytest.approx(want) and floor == pytest.approx(want / 10), n
    with pytest.raises(RankError, match="trained its scale vectors at --vector-lr-mult 7, "
                                        "this run asks for 3: pass --vector-lr-mult 7"):
        run_on_ranks(run_trainer, 1, flags("3", "4", "d", OVR, "--load", str(ck)))
    # no flag: the strategy's default (x30), which is not the checkpoint's either
    no_flag = [*base, "--train-iters", "4", "--run-dir", str(tmp_path / "f"), OVR, "--load",
               str(ck)]
    with pytest.raises(RankError, match="this run asks for 30: pass --vector-lr-mult 7"):
        run_on_ranks(run_trainer, 1, no_flag)
    # deliberately: a fresh optimizer at the new multiplier
    assert len(run_on_ranks(run_trainer, 1, flags("3", "4", "e", OVR, "--load", str(ck),
                                                  "--no-load-optim"))[0]) == 2


def test_trainer_default_is_x30_beyond_shared(tmp_path):
    """Without the flag: x30 for every strategy that changes the model, 1 for ``shared``
    (stock megatron-core) and under --spec baseline."""
    from megatron_scalevec.training.arguments import parse_args

    for argv, want in ((["--scalevec", "unified"], 30.0), (["--scalevec", "hg+dp+er"], 30.0),
                       (["--scalevec", "shared"], 1.0), (["--spec", "baseline"], 1.0),
                       (["--scalevec", "unified", "--vector-lr-mult", "1"], 1.0)):
        a = parse_args(TINY + argv + ["--run-dir", str(tmp_path / "r")])
        assert a.scalevec_config.vector_lr_mult == want, argv


def test_start_up_summary_prints_the_vectors_lr(tmp_path):
    """pretrain_gpt.py, unified at its default: the decay table's vector rows and the
    scale-invariant magnitudes' epsilon horizon are at 30 x --lr (1e-2), the matrices at --lr."""
    from scalevec_testing.trainer_flags import run_cli

    p = run_cli(*[f for f in TINY if f != "--quiet"], "--train-iters", "1", "--run-dir",
                str(tmp_path / "r"), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {ln.split()[0]: ln.split() for ln in p.stdout.splitlines()
            if ln.startswith("  ") and len(ln.split()) == 5}
    assert float(rows["input_vectors"][2]) == pytest.approx(0.3), rows
    assert float(rows["output_vectors"][2]) == pytest.approx(0.3), rows
    assert float(rows["matrices"][2]) == pytest.approx(1e-2), rows
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("scale-invariant"))
    assert "steps at lr 0.3," in line, line


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_bad_multiplier_is_one_line(value, tmp_path):
    from megatron_scalevec.training.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match="--vector-lr-mult: .*must be a number > 0"):
        parse_args(TINY + ["--vector-lr-mult", value, "--run-dir", str(tmp_path / "r")])
    with pytest.raises(ArgumentError, match="--spec baseline is megatron-core's own"):
        parse_args(TINY + ["--spec", "baseline", "--vector-lr-mult", "7"])
