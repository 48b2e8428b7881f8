"""run_on_ranks: results, re-initializing layouts, error propagation, timeouts, no leftovers."""

import multiprocessing
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_scalevec.compat.cpu import is_cpu_compat_enabled
from scalevec_testing import (
    RankError,
    gather_full_tensor,
    init_model_parallel,
    run_on_ranks,
)


def _no_children_left():
    # zombies are still listed as children until reaped, so this also catches those
    return not multiprocessing.active_children() and not psutil.Process().children()


def _echo(rank, world, a, *, b):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return rank, world, a, b, total.item(), torch.get_num_threads(), is_cpu_compat_enabled()


def test_results_ordered_by_rank_with_args():
    results = run_on_ranks(_echo, 3, "x", b=[1, 2])
    assert [r[0] for r in results] == [0, 1, 2]
    for _rank, world, a, b, total, threads, compat in results:
        assert (world, a, b, total, threads, compat) == (3, "x", [1, 2], 6.0, 1, True)
    assert _no_children_left()


def _layouts(rank, world):
    seen = []
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        init_model_parallel(tp=tp, pp=pp)
        seen.append(
            (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_data_parallel_world_size(),
            )
        )
    init_model_parallel(tp=2)
    local = torch.full((2, 3), float(rank))
    full = gather_full_tensor(local, 1, parallel_state.get_tensor_model_parallel_group())
    return seen, full


def test_reinitialize_layouts_in_one_group_and_gather():
    for seen, full in run_on_ranks(_layouts, 2):
        assert seen == [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
        assert torch.equal(full, torch.tensor([[0.0] * 3 + [1.0] * 3] * 2))


def _gloo_threads(rank, world):
    init_model_parallel()
    groups = (dist.distributed_c10d._get_default_group(), parallel_state.get_data_parallel_group(),
              parallel_state.get_tensor_model_parallel_group())
    return [g._get_backend(torch.device("cpu")).options._threads for g in groups]


def test_a_ranks_gloo_groups_run_one_worker_thread():
    """The default group and megatron-core's groups alike run one gloo worker thread
    (scalevec_testing/distributed.py ``one_gloo_worker_thread``: why)."""
    for threads in run_on_ranks(_gloo_threads, 2):
        assert threads == [1, 1, 1]


def _raise_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom-42 from the rank")
    dist.barrier()  # rank 0 would wait here forever: the parent must not wait for it


def test_rank_exception_carries_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 20
    assert info.value.rank == 1
    text = str(info.value)
    assert "ValueError: boom-42 from the rank" in text and "_raise_on_rank_one" in text
    assert "Traceback (most recent call last)" in info.value.remote_traceback
    assert _no_children_left()


def _sleep_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def test_hanging_rank_times_out_and_is_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        run_on_ranks(_sleep_on_rank_one, 2, timeout=3)
    assert time.monotonic() - start < 20
    assert _no_children_left()


def _die_on_rank_zero(rank, world):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_rank_dying_without_result_is_reported():
    with pytest.raises(RankError, match=r"exited \(code 3\)") as info:
        run_on_ranks(_die_on_rank_zero, 2, timeout=60)
    assert info.value.rank == 0
    assert _no_children_left()


def _unpicklable(rank, world):
    return lambda: rank


def test_unpicklable_result_is_an_error():
    with pytest.raises(RankError, match="could not send the result back"):
        run_on_ranks(_unpicklable, 1)
    assert _no_children_left()



def _mean_square(x):
    return x.square().mean()


def _mean_cube(x):  # never compiled by the parent: its rank compiles C++ of its own
    return x.pow(3).mean()


def _compile_in_fresh_cache(rank, world, cache):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    return float(torch.compile(_mean_cube)(torch.linspace(0, 1, 1001)))


def test_a_rank_compiles_after_its_parent_compiled(tmp_path, monkeypatch):
    # inductor's compile thread pool, inherited from the parent without its threads, hung a
    # rank's first compile (TE's FP8 scale update in CI); fresh caches make both compile C++
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "parent"))
    x = torch.linspace(0, 1, 1001)
    assert float(torch.compile(_mean_square)(x)) == pytest.approx(float(_mean_square(x)))
    [got] = run_on_ranks(_compile_in_fresh_cache, 1, str(tmp_path / "rank"), timeout=90)
    assert got == pytest.approx(float(_mean_cube(x)), rel=1e-5)
    assert _no_children_left()


_COMPILE_BACKWARD_THEN_FORK = """
import torch
from scalevec_testing import run_on_ranks


def backward(rank, world):
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    return float(x.grad.sum())


x = torch.ones(3, requires_grad=True)
torch.compile(lambda t: t * 3)(x).sum().backward()  # the parent's first backward, compiled
print(run_on_ranks(backward, 1, timeout=60))
"""


def test_a_rank_runs_backward_after_its_parent_compiled_one(tmp_path):
    # a fresh process (this one has run backwards already): torch's CUDA build started autograd
    # device threads at a first backward after a compile, and forked ranks refused theirs
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _COMPILE_BACKWARD_THEN_FORK], cwd=root, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[6.0]"
