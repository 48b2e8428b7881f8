"""Run many trainer invocations resumably, one subprocess per run, with overall progress.

Each run is ``trainer.main(argv)`` in a fresh Python process (``python -m
evidence.runner RUN_DIR -- ARGV``), so a crash or a kill costs one run, and
no state leaks between strategies. A run is done when its ``metrics.jsonl`` holds the final
iteration with a validation loss; finished runs are never redone, unfinished ones restart from
scratch (they are short). The worker also records the parameter count (total and scale-vector
parameters) of the model the trainer built, and the wall time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

# The vectors at the base LR: the sweeps in docs/RESULTS.md before its headline ran them so
# (the default until issue 51 made it x30), and they stay re-runnable as recorded.
VECTORS_AT_BASE_LR = ("--vector-lr-mult", "1")


@dataclasses.dataclass
class Run:
    """One trainer invocation: ``key`` names its directory, ``labels`` group it in tables."""

    key: str
    argv: list
    train_iters: int
    labels: dict = dataclasses.field(default_factory=dict)


def train_iters(a, family: str) -> int:
    """Iterations of one run of ``family`` (MoE may have its own count), from parsed args."""
    return a.moe_train_iters if family == "moe" and a.moe_train_iters else a.train_iters


def read_metrics(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill
                break
    return out


def is_done(run_dir: str, train_iters: int) -> bool:
    return any(r.get("iteration") == train_iters and "val_loss" in r
               for r in read_metrics(run_dir))


def val_curve(run_dir: str) -> list:
    """[(iteration, val_loss)] of a run."""
    return [(r["iteration"], r["val_loss"]) for r in read_metrics(run_dir) if "val_loss" in r]


def read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return default


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def execute(runs: list, root: str, log=print, threads: int | None = None, retries: int = 2,
            retry_wait_s: float = 30.0, jobs: int = 1) -> dict:
    """Run every unfinished run of ``runs`` under ``root`` (``jobs`` at a time, in list order);
    returns {key: run_dir}.

    Progress: runs done / total and an ETA from the measured seconds per iteration of the runs
    finished in this call (all runs weigh by their iteration count). A failed run is retried
    ``retries`` times after ``retry_wait_s`` (a busy shared machine, a file being edited), then
    the sweep stops; re-running it resumes.
    """
    dirs = {r.key: os.path.join(root, r.key) for r in runs}
    todo = [r for r in runs if not is_done(dirs[r.key], r.train_iters)]
    total, done = len(runs), len(runs) - len(todo)
    log(f"[sweep] {total} runs, {done} already done, {len(todo)} to run under {root}")
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (repo, env.get("PYTHONPATH")) if x)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t_start, iters_done = time.time(), 0
    iters_left = sum(r.train_iters for r in todo)
    queue = [(r, 0) for r in todo]
    active = {}  # key -> (run, attempt, Popen, file, start time)
    while queue or active:
        while queue and len(active) < max(1, jobs):
            r, attempt = queue.pop(0)
            d = dirs[r.key]
            os.makedirs(d, exist_ok=True)
            cmd = [sys.executable, "-m", "evidence.runner", d, "--", *r.argv]
            out = open(os.path.join(d, "stdout.txt"), "w")
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            active[r.key] = (r, attempt, proc, out, time.time())
        time.sleep(0.2)
        for key, (r, attempt, proc, out, t0) in list(active.items()):
            rc = proc.poll()
            if rc is None:
                continue
            out.close()
            del active[key]
            d = dirs[key]
            if rc != 0 or not is_done(d, r.train_iters):
                log(f"[sweep] run {key} failed (exit {rc}, attempt {attempt + 1}); see "
                    f"{d}/stdout.txt")
                if attempt >= retries:
                    for _, _, p, f, _ in active.values():
                        p.wait()
                        f.close()
                    raise RuntimeError(f"run {key} failed {retries + 1} times; see "
                                       f"{d}/stdout.txt")
                time.sleep(retry_wait_s)
                queue.insert(0, (r, attempt + 1))
                continue
            done += 1
            iters_done += r.train_iters
            iters_left -= r.train_iters
            spent = time.time() - t_start
            eta = spent / iters_done * iters_left
            log(f"[sweep] {done}/{total} done ({key}: {time.time() - t0:.0f} s, val "
                f"{val_curve(d)[-1][1]:.4f}); elapsed {_fmt_s(spent)}, ETA {_fmt_s(eta)}")
    return dirs


def _worker(run_dir: str, argv: list) -> None:
    """Train through ``trainer.main``; record the built model's parameter counts and wall."""
    from megatron_scalevec.training import trainer

    build = trainer.build_model

    def counting_build_model(args, config, vocab_size):
        model = build(args, config, vocab_size)
        params = [p for m in model for p in m.parameters()]
        counts = dict(total=sum(p.numel() for p in params),
                      scale_vectors=sum(p.numel() for p in params
                                        if hasattr(p, "scalevec_role")),
                      vocab_size=vocab_size)
        with open(os.path.join(run_dir, "params.json"), "w") as f:
            json.dump(counts, f)
        return model

    trainer.build_model = counting_build_model  # observe only; the trainer runs unchanged
    t0 = time.time()
    keep = [] if "--save" in argv else ["--no-save"]  # a measurement: no checkpoint to keep
    trainer.main(list(argv) + ["--run-dir", run_dir, "--overwrite", *keep])  # a retry reuses it
    with open(os.path.join(run_dir, "wall.json"), "w") as f:
        json.dump({"wall_s": time.time() - t0, "argv": list(argv)}, f)


if __name__ == "__main__":
    sep = sys.argv.index("--")
    _worker(sys.argv[1], sys.argv[sep + 1:])
