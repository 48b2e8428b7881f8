"""Trainer command lines shared by the end-to-end tests (tests/test_trainer.py, test_faults.py,
test_first_hour.py, test_run_reports.py), here because a test file never imports another
(tests/test_import_cycles.py checks it).

``TINY``: the smallest dense run of pretrain_gpt.py / the trainer on mock data (2 layers, hidden
32, 16 tokens, 8 sequences a step), quiet and without plots; tests append the iterations,
directories and flags they check.
"""

TINY = ["--mock-data", "--spec", "scalevec_dense", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--vocab-size", "64", "--lr", "1e-2", "--min-lr", "1e-3", "--log-interval", "2",
        "--eval-interval", "0", "--quiet", "--no-plot"]
