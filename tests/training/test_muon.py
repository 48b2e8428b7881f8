"""``--optimizer muon`` end to end through the trainer (the Python 3.12 leg of CI): the loss goes
down, and a run saved halfway and resumed matches the straight run in losses, weights and the
whole optimizer state (Muon's momentum included). Skipped where emerging-optimizers is absent;
the refusal on Python 3.11 is tested in tests/compat/test_mcore.py."""

import importlib.util
import warnings

import pytest
import torch

from scalevec_testing.distributed import run_on_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("emerging_optimizers") is None,
                                reason="--optimizer muon needs emerging-optimizers "
                                       "(Python >= 3.12)")

STEPS = 10
MUON = ["--mock-data", "--spec", "scalevec_dense", "--scalevec", "unified", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "64", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--vocab-size", "64", "--optimizer", "muon", "--lr", "1e-2",
        "--min-lr", "1e-3", "--train-iters", str(STEPS), "--log-interval", "5",
        "--eval-interval", "0", "--quiet", "--no-plot"]


def _runs(rank, world, root):
    """Straight to STEPS (saved at the end), then STEPS/2 + save + resume to STEPS: all in one
    forked rank, one trainer ``main()`` per run, as a user would launch them."""
    from megatron_scalevec.training.trainer import main

    straight = main(MUON + ["--run-dir", f"{root}/a", "--save", f"{root}/ck_a"])
    first = main(MUON + ["--run-dir", f"{root}/b", "--save", f"{root}/ck_b",
                         "--exit-interval", str(STEPS // 2)])
    second = main(MUON + ["--run-dir", f"{root}/b", "--load", f"{root}/ck_b",
                          "--save", f"{root}/ck_b"])
    return straight, first, second


def _tensors(ckpt: str) -> dict:
    """Every tensor of a torch_dist checkpoint (model and optimizer state), read with torch's
    DCP reader without a process group; byte entries (pickled objects) are never loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    meta = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata)}
    dcp.load(out, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    return out


def test_muon_trains_and_resumes_exactly(tmp_path):
    straight, first, second = run_on_ranks(_runs, 1, str(tmp_path), timeout=300)[0]
    assert len(straight) == STEPS and len(first) == len(second) == STEPS // 2
    assert sum(straight[-3:]) / 3 < straight[0] - 0.5, straight  # 4.16 -> ~3.4 here
    assert first + second == straight  # bitwise: same data order, same RNG, same state

    end = f"iter_{STEPS:07d}"
    a, b = _tensors(str(tmp_path / "ck_a" / end)), _tensors(str(tmp_path / "ck_b" / end))
    assert a.keys() == b.keys()
    momentum = [k for k in a if "momentum_buffer" in k]
    assert momentum, "no Muon momentum in the checkpoint: was Muon built?"
    assert any(k.endswith("linear_qkv.weight") for k in momentum)
    assert any("exp_avg" in k for k in a)  # embeddings / scale vectors: the Adam part
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Muon itself trains the matrices (the loss alone would also fall with only the Adam part
    # moving embeddings and vectors): over steps 5..10 each matrix moves ~45% (Frobenius,
    # relative); weight decay alone would move it 0.2%.
    half = _tensors(str(tmp_path / "ck_b" / f"iter_{STEPS // 2:07d}"))
    for k in momentum:
        w = k.split("momentum_buffer.", 1)[1]
        moved = float((b[w] - half[w]).norm() / half[w].norm())
        assert moved > 0.05, (w, moved)
