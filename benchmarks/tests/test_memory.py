"""benchmarks/memory.py: a variant's total peak memory, measured in a process of its own."""

from benchmarks import memory


def test_peaks_run_one_process_per_variant():
    """Tiny model, 1 step: each variant's peak comes back in bytes, the null row too; a peak
    includes the interpreter, torch and megatron-core (well above 100 MiB)."""
    argv = ["--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--vocab", "64", "--micro-batch-size", "1",
            "--memory-steps", "1"]
    peaks = memory.peaks(["shared", "unified", "shared#null"], argv)
    assert set(peaks) == {"shared", "unified", "shared#null"}
    assert all(p > 100 * 2**20 for p in peaks.values()), peaks
