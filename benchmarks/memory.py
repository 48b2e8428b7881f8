"""Total peak memory of each benchmark variant, each measured in a fresh process.

A variant's saved activations (the ``act`` column) miss what lives through a whole step: its
parameters' gradients and optimizer state, any weight-sized tensor a layer keeps, the
allocator's transients. This measures all of it. The child process (``python -m
benchmarks.memory --variant NAME`` with the benchmark's own arguments) builds that one variant
as benchmarks/overhead.py does and trains ``--memory-steps`` optimizer steps of the same
micro-batches, then prints its peak:

* CPU: the process's peak resident set (``VmHWM``), with glibc told to hand freed memory
  back at once (``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 MALLOC_ARENA_MAX=1``),
  so the peak is what was live, not what the heap kept. It includes the interpreter, torch and
  megatron-core (alike for every variant): the total a user's process reaches.
* CUDA: ``torch.cuda.max_memory_allocated`` over those steps.

The ``#null`` row (the baseline again) gets a process of its own too: its ratio is the
measurement's own noise.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC_RETURNS_FREED = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
                       "MALLOC_ARENA_MAX": "1"}


def peaks(names: list, argv: list) -> dict:
    """{variant name: peak bytes}, one child process per name (in the order given)."""
    env = dict(os.environ, **GLIBC_RETURNS_FREED)
    env.pop("MASTER_PORT", None)  # the parent's group holds it: the child picks a free one
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    out = {}
    for name in dict.fromkeys(names):
        res = subprocess.run([sys.executable, "-m", "benchmarks.memory", *argv,
                              "--variant", name], cwd=ROOT, env=env, capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise RuntimeError(f"memory of {name}: the child failed:\n{res.stderr[-3000:]}")
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    return out


def _peak_rss() -> int:
    """This process's peak resident set in bytes: Linux's ``VmHWM`` (its own address space;
    ``ru_maxrss`` would keep the parent's peak across the fork and exec that started it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux, else


def _child(argv: list) -> None:
    import torch

    from benchmarks import overhead
    from scalevec_testing import models as M

    parser = overhead.build_parser()
    parser.add_argument("--variant", required=True)
    parser.add_argument("--memory-steps", type=int, default=2)
    args = parser.parse_args(argv)
    overhead.setup(args, keep_heap=False)
    cuda = args.device == "cuda"
    data = overhead.batches(args)
    row = overhead.build_row(args.variant, overhead.config_of(args.variant, args), args, data)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.memory_steps):
        M.train_steps(row["ddp"], row["config"], data, 1, row["opt"])
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _peak_rss()
    torch.distributed.destroy_process_group()
    print(json.dumps({"variant": args.variant, "peak": peak}))


if __name__ == "__main__":
    _child(sys.argv[1:])
