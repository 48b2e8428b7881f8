"""The benchmark's CPU heap keeps what it frees (benchmarks/heap.py), as a caching
allocator does: a step that allocates again what the previous one freed faults no pages in.
It runs in a fresh process (the heap's state is the process's history). glibc's own choice to
give the memory back varies from one process to the next (seen: 0 or 32,738 faults for the
same script), which is why the benchmark pins it and why only the kept side is asserted."""

import os
import subprocess
import sys

import pytest

_STEPS = """
import sys, torch
from benchmarks import heap
# glibc's dynamic thresholds rise to their largest once a ~32 MiB mapped block is freed (an
# import may do that); then only more than 64 MiB free at the heap's top may be given back
big = torch.ones(8 * 2**20 - 1024)
del big
kept = heap.keep_freed_memory()
faults = []
for step in range(4):  # a 'step': 160 MiB in 1 MiB tensors, written, then all freed
    before = heap.minor_faults()
    blocks = [torch.ones(2**18) for _ in range(160)]
    del blocks
    faults.append(heap.minor_faults() - before)
print(kept, *faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_refaults_nothing():
    root = os.path.join(os.path.dirname(__file__), "..", "..")  # the repo root
    out = subprocess.run([sys.executable, "-c", _STEPS], capture_output=True, text=True,
                         check=True, cwd=root).stdout.split()
    kept, faults = out[0], [int(f) for f in out[1:]]
    assert kept == "True"
    # 160 MiB = 40,960 pages a step; given back and faulted in again, a step faults them all
    # (about 35,000 seen). Kept, a later step faults a few (0-2,307 seen: the second step may
    # still place some blocks anew), so the bound is a quarter of a step.
    assert faults[0] > 20000 and max(faults[1:]) < 10000, faults
