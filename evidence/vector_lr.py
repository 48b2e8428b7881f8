"""The scale vectors' learning rate (issue 51): how much of a strategy's gain is the vectors' LR?

For every width and variant, through the real trainer (one subprocess per run, ``runner``):

1. **Base LR**: a log-spaced grid (``--lr-points`` around ``--lr``, factor ``--lr-factor``) with
   the vectors at the base LR (multiplier 1), on the tuning seeds; a best on the grid's edge
   grows it that way (``--max-extend``). Best: ``lr0``.
2. **Vector multiplier** at ``lr0``: ``--mults`` (the trainer's ``--vector-lr-mult``); a best on
   an edge adds ``x2`` / ``/2`` beyond it (``--max-extend``). Best: ``m*``.
3. **Joint refinement** (``--refine``): ``lr0 x / lr-factor`` at ``m*``; the best of every
   (LR, multiplier) pair tried is the variant's best pair.
4. **Comparison** on fresh paired seeds 1..``--seeds`` (disjoint from the tuning seeds
   ``TUNE_SEED0 + 1..``, so the pick's noise does not favour it): each variant at (``lr0``, 1) and
   at its best pair, and at ``shared``'s ``lr0`` with each of ``--user-mults`` (a user switching
   the strategy on at the LR their baseline was tuned at).

Budget: ``--tokens-per-param`` tokens per (approximate) parameter at every width, so a wider
model trains longer; or ``--train-iters``, the same steps (tokens) at every width, as muP's
transfer experiments compare widths. Variants as ``evidence/tuned.py``: a strategy string or
``shared+qknorm``. Everything is derived from the run directories: re-running the command
resumes; the report (``<name>.md``, ``.json``, ``.png``) is evidence/vector_lr_report.py.
"""

from __future__ import annotations

import argparse
import math

from evidence import runner, tuning
from evidence.scaling import approx_params

VARIANTS = ["shared", "shared+qknorm", "unified"]
MULTS = [1.0, 3.0, 7.0, 15.0, 30.0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/evidence/vector_lr", help="sweep directory")
    p.add_argument("--widths", nargs="+", type=int, default=[64, 128])
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16, help="heads = width / head-dim")
    p.add_argument("--variants", nargs="+", default=VARIANTS)
    p.add_argument("--mults", nargs="+", type=float, default=MULTS)
    p.add_argument("--reference", default=None, metavar="VARIANT",
                   help="add a column: each row against this variant's best pair (ablations)")
    p.add_argument("--user-mults", nargs="*", type=float, default=[1.0],
                   help="multipliers run at shared's tuned LR for every variant")
    p.add_argument("--lr", type=float, default=3e-3, help="centre of the base-LR grid")
    p.add_argument("--lr-points", type=int, default=3)
    p.add_argument("--lr-factor", type=float, default=2.0)
    p.add_argument("--max-extend", type=int, default=2, help="points added past an edge best")
    p.add_argument("--no-refine", dest="refine", action="store_false")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="LR floor / peak LR")
    p.add_argument("--tokens-per-param", type=float, default=1.0)
    p.add_argument("--train-iters", type=int, default=None,
                   help="the same steps (tokens) at every width instead of --tokens-per-param")
    p.add_argument("--vocab-size", type=int, default=4096, help="for the budget only")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--evals", type=int, default=4, help="validations per run (the last: final)")
    p.add_argument("--eval-iters", type=int, default=16)
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--seeds", type=int, default=3, help="comparison seeds 1..N")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--report-name", default="vector_lr",
                   help="<out>/<name>.md, .json, .png (one per invocation's widths)")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="only draw one figure (--figure) from these sweeps' .json files")
    p.add_argument("--figure", default="vector_lr.png", help="--combine's output")
    return p


def iters(a, width: int) -> int:
    if a.train_iters:
        return a.train_iters
    n = approx_params(a.num_layers, width, a.vocab_size)
    return max(a.evals, math.ceil(a.tokens_per_param * n / (a.seq_length * a.micro_batch_size)))


def make_run(a, width: int, variant: str, lr: float, mult: float, seed: int) -> runner.Run:
    n = iters(a, width)
    spec = ["--spec", "scalevec_dense", "--scalevec",
            "shared" if variant == "shared+qknorm" else variant]
    if variant == "shared+qknorm":
        spec.append("--qk-layernorm")
    argv = [*spec, "--lr", f"{lr:g}", "--min-lr", f"{lr * a.min_lr_ratio:g}",
            "--vector-lr-mult", f"{mult:g}", "--num-layers", a.num_layers,
            "--hidden-size", width, "--num-attention-heads", width // a.head_dim,
            "--ffn-hidden-size", 4 * width, "--seq-length", a.seq_length,
            "--micro-batch-size", a.micro_batch_size, "--train-iters", n,
            "--eval-interval", max(1, n // a.evals), "--eval-iters", a.eval_iters,
            "--seed", seed, "--log-interval", 10, "--no-plot", "--quiet"]
    return runner.Run(f"h{width}/{variant}/lr{lr:g}/m{mult:g}/seed{seed}",
                      [str(x) for x in argv], n,
                      dict(width=width, variant=variant, lr=lr, mult=mult, seed=seed))


def final(root: str, run: runner.Run):
    d = f"{root}/{run.key}"
    return runner.val_curve(d)[-1][1] if runner.is_done(d, run.train_iters) else None


class Plan:
    """The runs the results on disk call for, and per (width, variant) what is settled."""

    def __init__(self, a, root: str):
        self.a, self.root = a, root
        self.runs: dict = {}  # key -> Run, in the order first asked for
        self.state: dict = {}

    def iters(self, width: int) -> int:
        return iters(self.a, width)

    def final_loss(self, w, v, lr, m, seed):
        """The final validation loss of that run, or None while it is unfinished."""
        return final(self.root, make_run(self.a, w, v, lr, m, seed))

    def _points(self, w, v, pairs):
        """{(lr, mult): [tuning losses]} for ``pairs``, or None while any run is unfinished."""
        out, pending = {}, False
        for lr, m in pairs:
            rs = [make_run(self.a, w, v, lr, m, tuning.TUNE_SEED0 + k)
                  for k in range(1, self.a.tune_seeds + 1)]
            for r in rs:
                self.runs.setdefault(r.key, r)
            got = [final(self.root, r) for r in rs]
            pending |= any(g is None for g in got)
            out[(lr, m)] = got
        return None if pending else out

    def _grow(self, w, v, values, point):
        """Tune one coordinate over ``values`` (``point(x)`` -> (lr, mult)), growing the grid
        past an edge best (``--max-extend`` points); (best, edge, {x: losses}) or None while
        runs are pending."""
        values = sorted(values)
        size = len(values) + self.a.max_extend
        while True:
            got = self._points(w, v, [point(x) for x in values])
            if got is None:
                return None
            losses = {x: got[point(x)] for x in values}
            best, edge = tuning.best_lr(losses)
            if edge not in ("low", "high") or len(values) >= size:
                return best, edge, losses
            values = tuning.extend(values, edge, self.a.lr_factor)

    def settle(self) -> Plan:
        a = self.a
        for w in a.widths:
            for v in a.variants:
                st = self.state[(w, v)] = {}
                lr = self._grow(w, v, tuning.lr_grid(a.lr, a.lr_points, a.lr_factor),
                                lambda x: (x, 1.0))
                if lr is None:
                    continue
                st["lr0"], st["lr_edge"], st["lr_losses"] = lr
                lr0 = st["lr0"]
                mult = self._grow(w, v, a.mults, lambda x, _lr=lr0: (_lr, x))
                if mult is None:
                    continue
                st["m"], st["m_edge"], st["m_losses"] = mult
                pairs = {(lr0, m): ls for m, ls in st["m_losses"].items()}
                if a.refine:
                    refine = [(tuning._round(lr0 / a.lr_factor), st["m"]),
                              (tuning._round(lr0 * a.lr_factor), st["m"])]
                    got = self._points(w, v, refine)
                    if got is None:
                        continue
                    pairs.update(got)
                st["pairs"] = pairs
                st["best"] = min(pairs, key=lambda k: (_score(pairs[k]), k))
        return self

    @property
    def settled(self) -> bool:
        return all("best" in st for st in self.state.values())

    def comparison(self) -> list:
        """Configurations of the comparison: (width, variant, label, lr, mult)."""
        out = []
        for w in self.a.widths:
            ref = self.state.get((w, "shared"), {}).get("lr0")
            for v in self.a.variants:
                st = self.state[(w, v)]
                out += [(w, v, "tuned LR, vectors x1", st["lr0"], 1.0),
                        (w, v, "best pair", *st["best"])]
                out += [(w, v, f"shared's LR, vectors x{m:g}", ref, m)
                        for m in self.a.user_mults
                        if ref is not None and (ref, m) != (st["lr0"], 1.0)]
        return out

    def comparison_runs(self) -> list:
        runs = {}
        for w, v, _, lr, m in self.comparison():
            for seed in range(1, self.a.seeds + 1):
                r = make_run(self.a, w, v, lr, m, seed)
                runs.setdefault(r.key, r)
        return list(runs.values())


def _score(losses) -> float:
    m = sum(losses) / len(losses)
    return m if math.isfinite(m) else math.inf


def execute(a, root: str, log=print) -> Plan:
    """Tune until every (width, variant) is settled, then run the comparison seeds."""
    for _ in range(4 * (a.max_extend + 2)):
        plan = Plan(a, root).settle()
        todo = [r for r in plan.runs.values() if final(root, r) is None]
        if not todo:
            break
        runner.execute(list(plan.runs.values()), root, log=log, threads=a.threads,
                       jobs=a.jobs)
    plan = Plan(a, root).settle()
    if not plan.settled:
        raise RuntimeError("tuning did not settle; re-run the command to resume")
    runner.execute(plan.comparison_runs(), root, log=log, threads=a.threads, jobs=a.jobs)
    return plan


def main(argv=None) -> None:
    from evidence import vector_lr_report  # noqa: PLC0415

    a = build_parser().parse_args(argv)
    if a.combine:
        print(vector_lr_report.combine(a.combine, a.figure))
        return
    plan = Plan(a, a.out).settle() if a.report_only else execute(a, a.out)
    vector_lr_report.report(a, plan, a.out)
