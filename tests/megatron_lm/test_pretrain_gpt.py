"""Megatron-LM's own ``pretrain_gpt.py`` (the checkout ``MEGATRON_LM_ROOT`` names; .ci/run points
it at ../shared/megatron-lm/<tag>), run on CPU ranks through scalevec_testing/megatron_lm.py's
shim, with and without ``--spec megatron_scalevec.megatron_lm_spec``.

For each flag set of ``megatron_lm.CASES`` (Megatron-LM's defaults, RMSNorm + SwiGLU,
``--qk-layernorm``, TP2 + SP and EP2 with grouped GEMM on the TE layout, PP2 with virtual
stages and with uneven stages under a non-uniform ``--moe-layer-freq``, DP2 with the distributed
optimizer and overlapped reduce / gather): ``MEGATRON_SCALEVEC=shared`` builds on every rank the
parameter names, shapes and count of stock Megatron-LM and gives its losses; ``unified``
trains (its loss falls) with its MoE and dense layers where stock has them, on every rank and
chunk.
"""

import functools

import pytest

from scalevec_testing import megatron_lm as M
from scalevec_testing.markers import needs_megatron_lm, needs_te

pytestmark = needs_megatron_lm

REL = 1e-5  # first iterations' losses, shared vs stock (our norms' backward is hand-written)


@functools.cache
def _run(case: str, strategy, root: str, extra: tuple = ()) -> M.Result:
    """One run of a case (each is shared by the tests that read it)."""
    c = M.CASES[case]
    return M.run([*c.argv(strategy), *extra], f"{root}/{case}-{strategy or 'stock'}", c.nproc,
                 env=c.env(strategy)).check()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("megatron_lm"))


def _cases():
    return [pytest.param(name, marks=[needs_te] if c.te else []) for name, c in M.CASES.items()]


@pytest.mark.parametrize("case", _cases())
def test_shared_builds_and_trains_as_stock(case, root):
    stock, ours = _run(case, None, root), _run(case, "shared", root)
    for rank in range(M.CASES[case].nproc):
        assert ours.params(rank) == stock.params(rank), f"rank {rank}"
    a, b = stock.losses(), ours.losses()
    assert sorted(a) == sorted(b) == [1, 2, 3], (a, b)
    for it in a:
        assert b[it]["lm loss"] == pytest.approx(a[it]["lm loss"], rel=REL), (it, a, b)


@pytest.mark.parametrize("case", _cases())
def test_unified_trains_with_its_layers_where_stock_has_them(case, root):
    """Eight iterations: on megatron-core 0.19's mock data DNP's loss can rise at the second
    before it falls (``unified`` starts from another function than stock's)."""
    stock, ours = _run(case, None, root), _run(case, "unified", root, ("--train-iters", "8"))
    for rank in range(M.CASES[case].nproc):
        assert M.layer_kinds(ours.ranks[rank]["params"]) == \
            M.layer_kinds(stock.ranks[rank]["params"]), f"rank {rank}"
        names = {n for n, _ in ours.params(rank)}
        assert any(".scale_in." in n for n in names)  # HG's vectors are there
    loss = [ours.losses()[it]["lm loss"] for it in range(1, 9)]
    assert sum(loss[-3:]) < sum(loss[:3]), loss
