"""The benchmark's CPU heap keeps what it frees (megatron_scalevec/heap.py), as a caching
allocator does: a step that allocates again what the previous one freed faults no pages in.
Each case runs in a fresh process (the heap's state is the process's history)."""

import subprocess
import sys

import pytest

_STEPS = """
import sys, torch
from megatron_scalevec import heap
kept = heap.keep_freed_memory() if sys.argv[1] == "kept" else None
for step in range(3):  # a 'step': 64 MiB in 1 MiB tensors, written, then all freed
    before = heap.minor_faults()
    blocks = [torch.ones(2**18) for _ in range(64)]
    del blocks
    faults = heap.minor_faults() - before
print(kept, faults)
"""


def _third_step_faults(mode):
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_refaults_nothing_that_system_malloc_refaults():
    kept, kept_faults = _third_step_faults("kept")
    _, system_faults = _third_step_faults("system")
    assert kept == "True"
    # 64 MiB = 16,384 pages: glibc gives the freed top of its heap back and faults it in again
    assert system_faults > 8000, system_faults
    assert kept_faults < 1000, kept_faults
