"""Host <-> device copies and syncs of one forward + backward of the grouped experts
(benchmarks/host_syncs.py): the local grouped (layers/grouped.py) and TE grouped
(layers/te_grouped.py) experts add no blocking copy or sync per MoE layer and micro-batch over
megatron-core's experts given the same ``tokens_per_expert``, on the host (the allgather and
alltoall dispatchers) or on the device (flex / drop-and-pad). The index tensors of the DNP GLU
norm and grouped_mm's offsets come from one non-blocking upload of host counts (pinned on a GPU),
none of device counts. On CPU places are followed by provenance (``simulate``).
"""

import pytest
import torch

from benchmarks.host_syncs import count_host_syncs, experts_report, stalls
from scalevec_testing import init_model_parallel, run_on_ranks, te_stub
from scalevec_testing import models as M
from scalevec_testing.experts import moe_config, te_moe_config
from scalevec_testing.markers import needs_te
from scalevec_testing.te_compare import start_te

DNP = ("unified", "hg+dnp")
HIDDEN, COUNTS = 32, [10, 0, 17, 13]  # an expert without rows


def _strategy(name):
    from megatron_scalevec.config import ScaleVecConfig

    return None if name is None else ScaleVecConfig.from_string(name)


def _measure(experts) -> dict:
    """{host: counts} of one forward + backward of ``experts``, host / device counts."""
    return experts_report(experts, COUNTS, HIDDEN)


def _local(rank, world):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    init_model_parallel()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    out = {}
    for name in (None, "shared", *DNP):  # None: megatron-core's (sequential) experts
        config = moe_config(name is not None, moe_layer_freq=1)
        experts = M.build_gpt(config, _strategy(name)).decoder.layers[0].mlp.experts
        for host, c in _measure(experts).items():
            out[(name or "stock", host)] = c
    return out


def _te(rank, world):
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        get_default_pg_collection,
    )

    start_te()
    from megatron.core.extensions import transformer_engine as ext  # as TE's stand-in left it
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    out = {}
    for name in (None, "shared", *DNP):  # None: megatron-core's TEGroupedMLP
        config = te_moe_config(True, True, moe_layer_freq=1)
        with te_stub.cuda_claimed():
            if name is None:
                torch.manual_seed(7)
                experts = TEGroupedMLP(len(COUNTS), config, MLPSubmodules(
                    linear_fc1=ext.TEColumnParallelGroupedLinear,
                    linear_fc2=ext.TERowParallelGroupedLinear), get_default_pg_collection())
            else:
                experts = M.build_gpt(config, _strategy(name)).decoder.layers[0].mlp.experts
            for host, c in _measure(experts).items():
                out[(name or "stock", host)] = c
    return out


def _check(res: dict) -> None:
    for key, c in res.items():  # shown with pytest -s
        print(key, {k: v for k, v in c.items() if k != "where" and v}, c["where"])
    for (name, host), c in res.items():
        stock = res[("stock", host)]
        for kind in ("upload", "download", "sync", "download_async"):  # none added
            assert c[kind] <= stock[kind], (name, host, kind, c["where"], stock["where"])
        # host counts: at most one non-blocking upload (grouped_mm's offsets, the GLU rows)
        assert c["upload_async"] <= (1 if host else 0), (name, host, c["where"])


def test_local_grouped_experts_add_no_host_sync():
    res = run_on_ranks(_local, 1)[0]
    _check(res)
    assert stalls(res[("stock", False)]) == 1  # megatron-core's sequential: .tolist()
    for host in (True, False):  # grouped: no stall at all, the DNP rows from grouped_mm's upload
        for name in ("shared", *DNP):
            assert stalls(res[(name, host)]) == 0, (name, host, res[(name, host)]["where"])
            assert res[(name, host)]["upload_async"] == res[("shared", host)]["upload_async"]


@needs_te
def test_te_grouped_experts_add_no_host_sync():
    res = run_on_ranks(_te, 1)[0]
    _check(res)
    assert stalls(res[("stock", False)]) == 1  # megatron-core's tokens_per_expert.tolist()


def test_counter_sees_blocking_copies_and_syncs():
    """The counter itself: a host tensor moved to the device, a device value read back, a
    boolean mask, and the non-blocking form."""
    dev = torch.arange(6.0)
    host = torch.tensor([1, 2, 3])

    def step():
        up = host.to(dev.device)
        torch.tensor([0, 1], device=dev.device)
        dev[dev > 2].sum().item()
        host.to(dev.device, non_blocking=True)
        return dev.tolist(), up

    c = count_host_syncs(step, host=(host,), simulate=True)["counts"]
    assert c == dict(upload=2, upload_async=1, download=1, download_async=0, sync=2), c


@pytest.mark.parametrize("counts", [[3, 0, 2, 4], [20, 0, 13, 31, 7], [0, 0, 0], [16, 16]])
def test_expert_rows_from_device_counts_match_host_counts(counts):
    """The rows built from a device tensor of counts (no host values but the total) equal
    those of host counts, and building them reads nothing back."""
    from megatron_scalevec.layers import glu

    ref = glu.expert_rows(counts)
    sizes = torch.tensor(counts)
    r = count_host_syncs(lambda: glu.expert_rows(sizes, sizes.device, total=sum(counts)),
                         simulate=True)
    assert stalls(r["counts"]) == 0 and r["counts"]["upload_async"] == 0, r["where"]
    for a, b in zip(ref, r["result"]):
        assert (a is None and b is None) or torch.equal(a, b)
