"""Tiny MoE models shared by the expert tests (test_grouped.py, test_te_grouped.py,
test_host_syncs.py and test_moe*.py in tests/layers/): their config, the expert-parallel layouts
they all run, and the rank functions that save or load any kind of experts and compare saved
gradients. Here because a test file never imports another (tests/test_import_cycles.py checks
it).

Experts come in three kinds (:data:`KINDS`): megatron-core's sequential experts, our local
grouped experts (layers/grouped.py) and TE's grouped experts (layers/te_grouped.py).
"""

import contextlib
import re

import torch

from scalevec_testing import init_model_parallel
from scalevec_testing import models as M

EXPERTS = 4

# world size and parallel layout of each expert-parallel run (keyword arguments of the tests'
# rank functions: tp, ep, etp, sp, dispatcher)
EXPERT_LAYOUTS = {
    "ep1": dict(world=1),
    "ep2": dict(world=2, ep=2),
    "ep2_alltoall": dict(world=2, ep=2, dispatcher="alltoall"),
    "tp2_sp_etp2": dict(world=2, tp=2, sp=True, etp=2),
    "tp2_sp_etp2_alltoall": dict(world=2, tp=2, sp=True, etp=2, dispatcher="alltoall"),
}

# kind -> (TE, grouped)
KINDS = {"sequential": (False, False), "grouped": (False, True), "te": (True, True)}


def strategy_config(name, expert_vectors="per_expert"):
    """The ScaleVecConfig of strategy ``name`` with ``expert_vectors`` (per expert or shared)."""
    from megatron_scalevec.config import ScaleVecConfig

    return ScaleVecConfig.from_string(name, expert_vectors=expert_vectors)


def moe_config(grouped, **overrides):
    """A tiny MoE config (4 experts, top-2, allgather dispatcher, aux loss) at the current
    expert-parallel layout; ``grouped``: grouped-GEMM experts."""
    from megatron.core import parallel_state as ps

    kw = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=24,
              moe_layer_freq=[1, 0], moe_token_dispatcher_type="allgather",
              moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
              moe_grouped_gemm=grouped,
              expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
              expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size())
    kw.update(overrides)
    return M.tiny_config(**kw)


def build_stock_moe(config):
    """megatron-core's own local GPT spec with MoE layers where config.moe_layer_freq says."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=config.normalization)
    return GPTModel(config, spec, vocab_size=M.VOCAB, max_sequence_length=M.SEQ,
                    position_embedding_type="rope")


def te_moe_config(te: bool, grouped: bool, **overrides):
    """:func:`moe_config` on Transformer Engine (``te``) or on the local spec."""
    impl = "transformer_engine" if te else "local"
    return moe_config(grouped, **{"transformer_impl": impl, **overrides})


def rel_diffs(rank, world, a_dir, b_dir):
    """Rank function: each tensor's relative difference between two saved sets of tensors
    (M.save_grads / M.save_model), which must hold the same names."""
    a, b = M.plain_tensors(a_dir), M.plain_tensors(b_dir)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    return M.relative_differences(a, b)


def save_or_load(rank, world, kind, expert_vectors="per_expert", *, ep, save_dir=None,
                 load_dir=None):
    """Rank function: build ``kind`` experts (:data:`KINDS`; ``te``: TE grouped,
    tests/layers/test_te_grouped.py) at EP ``ep``; save with distinct experts per EP rank, or load;
    return the eval loss."""
    from scalevec_testing import te_stub

    te, grouped = KINDS[kind]
    if te:
        te_stub.activate()
    init_model_parallel(ep=ep)
    overrides = dict(transformer_impl="transformer_engine") if te else {}
    with te_stub.cuda_claimed() if te else contextlib.nullcontext():
        model = M.build_gpt(moe_config(grouped, moe_layer_freq=1, **overrides),
                            strategy_config("unified", expert_vectors))
        if load_dir is None:
            M.perturb_vectors(model)
            with torch.no_grad():
                for name, p in model.named_parameters():  # distinct experts per EP rank
                    if re.search(r"experts\.(local_experts|linear_fc|expert_norms)", name):
                        p.add_(0.01 * (1 + torch.distributed.get_rank()))
            M.save_model(model, save_dir)
        else:
            M.load_model(model, load_dir, te_extra_state=te)
        model.eval()
        with torch.no_grad():
            b = M.batches(1, 2, seed=11)[0]
            return float(model(b["tokens"], b["position_ids"], None,
                               labels=b["labels"]).float().mean())


_VECTOR_KEY = re.compile(r"\.(scale_in|scale_out|gate_norm|up_norm)\.")


def vector_ownership(rank, world, te, grouped, strategy, expert_vectors):
    """Rank function: how a model's expert vectors are owned (layers/expert_vectors.py), for
    ``te`` / ``grouped`` experts (TE grouped or TE sequential; local grouped or sequential):
    whether every parameter and module is registered once (an aliased registration is listed
    twice with ``remove_duplicate=False``), how many ``shared_vectors`` owners, how many users
    were lent one and how many resolve (``vectors_of``) to another than their experts module's,
    and the expert vector state_dict keys outside an owner."""
    from megatron_scalevec.layers.expert_vectors import vectors_of
    from scalevec_testing import te_stub

    if te:
        te_stub.activate()
    init_model_parallel()
    with te_stub.cuda_claimed() if te else contextlib.nullcontext():
        model = M.build_gpt(te_moe_config(te, grouped), strategy_config(strategy, expert_vectors))
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    modules = [m for _, m in model.named_modules(remove_duplicate=False)]
    owners = users = elsewhere = 0
    for mod in model.modules():
        owner = getattr(mod, "shared_vectors", None)
        if not isinstance(owner, torch.nn.Module):
            continue
        owners += 1
        for user in [*mod.modules(), *getattr(mod, "experts_view", ())]:
            if getattr(user, "vectors_from", None) is not None:
                users += 1
                elsewhere += vectors_of(user) is not owner
    keys = [k for k in model.state_dict() if ".experts." in k and _VECTOR_KEY.search(k)]
    return dict(params_once=len(params) == len({id(p) for p in params}),
                modules_once=len(modules) == len({id(m) for m in modules}),
                owners=owners, users=users, elsewhere=elsewhere,
                outside_owner=[k for k in keys if ".shared_vectors." not in k],
                in_owner=[k for k in keys if ".shared_vectors." in k])
