"""MoE options with scale vectors: the router's expert bias untouched by its vector, the router
vector folded in the router's dtype, the grouped-GEMM spec, and the parameter-overhead formula
(per-expert and shared expert vectors) against the paper's reference numbers."""

import pytest
import torch

from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M
from scalevec_testing.experts import EXPERTS, build_stock_moe, moe_config, strategy_config


# ---------------------------------------------------------------- options and guards
def _balancing(rank, world):
    """Aux-loss-free balancing: the expert-bias update equals megatron-core's at init."""
    init_model_parallel()
    config = moe_config(False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                        moe_router_bias_update_rate=0.1, moe_layer_freq=1)
    stock = build_stock_moe(config)
    ours = M.build_gpt(config, "hg+or")
    ours.load_state_dict(stock.state_dict(), strict=False)
    biases = []
    for model in (stock, ours):
        ddp = M.wrap_ddp(model, config)
        M.train_steps(ddp, config, M.batches(2, 2), 1)
        biases.append(model.decoder.layers[0].mlp.router.expert_bias.numpy().copy())
    return biases


def test_router_expert_bias_unchanged_by_gamma_r():
    stock_bias, our_bias = run_on_ranks(_balancing, 1)[0]
    assert abs(stock_bias).sum() > 0  # the update happened
    assert (stock_bias == our_bias).all()


def _router_logits(rank, world):
    """bf16 parameters, moe_router_dtype=fp32: the gating logits of W_r diag(gamma_r)."""
    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.layers.moe import ScaleVecTopKRouter

    init_model_parallel()
    config = moe_config(False, params_dtype=torch.bfloat16, bf16=True, moe_router_dtype="fp32")
    from megatron.core.process_groups_config import ProcessGroupCollection

    router = ScaleVecTopKRouter(config, ProcessGroupCollection.use_mpu_process_groups(),
                                scalevec=ScaleVecConfig.from_string("hg"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.scale_in.weight.copy_(1 + 0.3 * torch.randn(32, generator=g))
    x = torch.randn(6, 32, generator=g).to(torch.bfloat16)
    logits = router.gating(x)
    exact = x.float() @ (router.weight.float() * router.scale_in.weight.float()).t()
    return logits.dtype, float((logits - exact).abs().max()), float(exact.abs().max())


def test_router_vector_folded_in_router_dtype():
    """W_r * gamma_r is formed in fp32 (the router dtype), not rounded to bf16 first (that
    adds ~4e-3 relative error stock routing does not have)."""
    dtype, diff, scale = run_on_ranks(_router_logits, 1)[0]
    assert dtype == torch.float32
    assert diff <= 1e-6 * scale, (diff, scale)


def test_grouped_gemm_spec():
    """grouped_gemm=True builds our grouped experts (tests/layers/test_grouped.py checks them)."""
    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.layers.grouped import ScaleVecGroupedMLP
    from megatron_scalevec.specs import moe_spec

    cfg = ScaleVecConfig.from_string("unified")
    assert moe_spec(cfg, num_experts=4, grouped_gemm=True).submodules.experts.module \
        is ScaleVecGroupedMLP
    with pytest.raises(ValueError, match="num_experts"):
        moe_spec(cfg, num_experts=0)


# ---------------------------------------------------------------- parameter count
COUNT_SHAPE = dict(num_layers=2, hidden=32, heads=4, query_groups=2, head_dim=8, ffn=64,
                   num_experts=EXPERTS, moe_ffn=24, shared_ffn=40, moe_layers=[1, 0])


def _count(rank, world, strategies):
    init_model_parallel()
    config = moe_config(False, moe_shared_expert_intermediate_size=40)
    stock = sum(p.numel() for p in build_stock_moe(config).parameters())
    return stock, {s: sum(p.numel() for p in M.build_gpt(config, s).parameters()) - stock
                   for s in strategies}


STRATS = ["unified", "hg", "hg+dp+er", "shared+or", "none"]


def test_parameter_count_formula_and_reference_overhead():
    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.layers.moe import moe_model_parameters, moe_new_parameters

    stock, new = run_on_ranks(_count, 1, STRATS)[0]
    tiny = moe_model_parameters(vocab=M.VOCAB, **COUNT_SHAPE)["total"]
    assert tiny == stock
    for s in STRATS:
        assert moe_new_parameters(ScaleVecConfig.from_string(s), **COUNT_SHAPE)["total"] == new[s]
    # Reference: a paper-like fine-grained MoE with ~2B total parameters (all layers MoE).
    ref = dict(num_layers=24, hidden=1024, heads=16, query_groups=4, head_dim=64, ffn=4096,
               num_experts=64, moe_ffn=384, shared_ffn=0)
    total = moe_model_parameters(vocab=128256, **ref)["total"]
    parts = moe_new_parameters(ScaleVecConfig.from_string("unified"), **ref)
    ratio = parts["total"] / total
    print(f"\nreference MoE: {total / 1e9:.3f}B params, unified adds {parts['total']:,} "
          f"({ratio:.3e} of the model): {parts}")
    assert 1.5e9 < total < 2.5e9
    # per expert 2(h + f) + 4 new over 3hf: the ratio is about 2/(3f) + 2/(3h)
    bound = 2 / (3 * ref["moe_ffn"]) + 2 / (3 * ref["hidden"])
    assert ratio < bound, (ratio, bound)


def test_shared_expert_vectors_parameter_count_and_reference_overhead():
    from megatron_scalevec.layers.moe import moe_model_parameters, moe_new_parameters

    strategies = [strategy_config(s, "shared") for s in ("unified", "hg+dp+er", "hg")]
    _, new = run_on_ranks(_count, 1, strategies)[0]
    for cfg in strategies:
        assert moe_new_parameters(cfg, **COUNT_SHAPE)["total"] == new[cfg], cfg
    ref = dict(num_layers=24, hidden=1024, heads=16, query_groups=4, head_dim=64, ffn=4096,
               num_experts=64, moe_ffn=384, shared_ffn=0)
    total = moe_model_parameters(vocab=128256, **ref)["total"]
    shared = strategy_config("unified", "shared")
    per_expert = moe_new_parameters(shared.replace(expert_vectors="per_expert"), **ref)["total"]
    parts = moe_new_parameters(shared, **ref)
    ratio = parts["total"] / total
    print(f"\nreference MoE: {total / 1e9:.3f}B params; unified adds {per_expert:,} per expert "
          f"({per_expert / total:.3e}), {parts['total']:,} shared ({ratio:.3e}): {parts}")
    assert ratio < 1e-4 < per_expert / total
