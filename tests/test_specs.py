"""Invariants 1 and 2: parity with megatron-core's own layers, identity at initialization."""

import pytest
import torch

from megatron_scalevec import ScaleVecConfig
from scalevec_testing import init_model_parallel, run_on_ranks
from scalevec_testing import models as M


def _loss_and_grads(model, data):
    model.zero_grad()
    loss = torch.stack([model(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
                        for b in data]).mean()
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _stock_weights(model):
    return {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}


def _compare_to_stock(rank, world, strategy, config_kw):
    init_model_parallel()
    config = M.tiny_config(**config_kw)
    stock = M.build_gpt(config, None)
    ours = M.build_gpt(config, strategy)
    missing, unexpected = ours.load_state_dict(_stock_weights(stock), strict=False)
    missing = [k for k in missing if "_extra_state" not in k]
    data = M.batches(2, 2)
    loss_s, grads_s = _loss_and_grads(stock, data)
    loss_o, grads_o = _loss_and_grads(ours, data)
    shared = set(grads_s) & set(grads_o)
    return dict(loss=(loss_s, loss_o), missing=missing, unexpected=unexpected,
                n_shared=len(shared),
                grad_err=max(float((grads_s[k] - grads_o[k]).abs().max()) for k in shared))


def test_shared_equals_megatron_core_local_spec():
    res = run_on_ranks(_compare_to_stock, 1, "shared", {})[0]
    assert res["missing"] == [] and res["unexpected"] == []  # same names, key for key
    assert res["loss"][0] == res["loss"][1]  # the forward is bit for bit the stock one
    assert res["grad_err"] < 1e-6  # our RMSNorm backward is hand-written (saves less memory)


@pytest.mark.parametrize("strategy", ["hg", "hg+dp", "shared+or", "shared+er", "hg+or",
                                      "hg+dp+er", "shared+dp", "shared+iwd"])
def test_variant_at_init_equals_shared(strategy):
    res = run_on_ranks(_compare_to_stock, 1, strategy, {})[0]
    assert res["n_shared"] >= 5
    assert abs(res["loss"][0] - res["loss"][1]) < 1e-6, res["loss"]
    assert res["grad_err"] < 1e-5
    if strategy.startswith("hg"):
        assert any("scale_in" in k for k in res["missing"])


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_qk_layernorm_flag_equals_stock_qk_layernorm(normalization):
    """config.qk_layernorm with our spec (no DNP): stock's own q/k_layernorm slots, names and
    (LayerNorm) biases, key for key, and the same loss."""
    res = run_on_ranks(_compare_to_stock, 1, "shared",
                       {"qk_layernorm": True, "normalization": normalization})[0]
    assert res["missing"] == [] and res["unexpected"] == []
    assert res["loss"][0] == pytest.approx(res["loss"][1], abs=1e-6)
    assert res["grad_err"] < 1e-5


@pytest.mark.parametrize("strategy", ["shared", "hg", "hg+dp+er"])
def test_layernorm_keeps_stock_biases(strategy):
    """normalization=LayerNorm: the Pre-Norms and final norm keep megatron-core's biases
    (ScaleVecConfig.layernorm_bias='stock'); every variant equals stock at init."""
    res = run_on_ranks(_compare_to_stock, 1, strategy, {"normalization": "LayerNorm"})[0]
    assert not [k for k in res["missing"] if k.endswith(".bias")], res["missing"]
    if strategy == "shared":
        assert res["missing"] == [] and res["unexpected"] == []
    assert abs(res["loss"][0] - res["loss"][1]) < 1e-6, res["loss"]
    assert res["grad_err"] < 1e-5


def test_none_with_qk_layernorm_has_no_learnable_norm():
    """`none` fixes every scale vector to 1, QK-norm's too: its q/k norms have no parameters
    (each learnable one would show up as a key stock lacks) and the loss equals stock at init."""
    res = run_on_ranks(_compare_to_stock, 1, "none", {"qk_layernorm": True})[0]
    assert res["missing"] == [], res["missing"]
    assert any("q_layernorm" in k for k in res["unexpected"])
    assert all(k.endswith("layernorm.weight") for k in res["unexpected"]), res["unexpected"]
    assert res["loss"][0] == pytest.approx(res["loss"][1], abs=1e-6)


def _gate_rows(rank, world, strategy):
    """Perturb one branch vector at a time: how much each of megatron-core's own
    (q, k, v, gate) split changes."""
    init_model_parallel()
    model = M.build_gpt(M.tiny_config(attention_output_gate=True), strategy)
    attn = model.decoder.layers[0].self_attention
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M.SEQ, 2, 32, generator=g)

    def split():
        with torch.no_grad():
            return attn.get_query_key_value_tensors(x, output_gate=True)

    base = split()
    res = {}
    for where in ("scale_in", "scale_out"):
        for b in ("q", "k", "v", "gate"):
            vectors = getattr(attn.linear_qkv, where)
            if b not in vectors:
                continue
            vec = vectors[b]
            p = vec.direction if vec.parameterization == "or" else vec.weight
            old = p.detach().clone()
            with torch.no_grad():
                p.mul_(1 + 0.5 * torch.rand(p.shape, generator=g))
            res[(where, b)] = [float((o - t).abs().max()) for o, t in zip(split(), base)]
            with torch.no_grad():
                p.copy_(old)
    return res


@pytest.mark.parametrize("strategy", ["hg+dp", "unified"])
def test_output_gate_rows_carry_their_own_vectors(strategy):
    """attention_output_gate: rows per query group [q x hpg, gate x hpg, k, v]. Changing a
    branch's vector changes exactly that branch of megatron-core's split, nothing else."""
    res = run_on_ranks(_gate_rows, 1, strategy)[0]
    assert ("scale_in", "gate") in res and (("scale_out", "gate") in res) == ("dp" in strategy)
    for (where, b), errs in res.items():
        own = ("q", "k", "v", "gate").index(b)
        assert errs[own] > 1e-3, (where, b, errs)
        assert max(e for i, e in enumerate(errs) if i != own) == 0.0, (where, b, errs)


def test_output_gate_at_init_equals_stock():
    res = run_on_ranks(_compare_to_stock, 1, "hg+dp", {"attention_output_gate": True})[0]
    assert abs(res["loss"][0] - res["loss"][1]) < 1e-6 and res["grad_err"] < 1e-5, res


def _dnp_qk_vs_stock(rank, world):
    init_model_parallel()
    stock = M.build_gpt(M.tiny_config(qk_layernorm=True), None).decoder.layers[0].self_attention
    ours = M.build_gpt(M.tiny_config(), "hg+dnp").decoder.layers[0].self_attention
    with torch.no_grad():
        ours.linear_qkv.weight.copy_(stock.linear_qkv.weight)
        for b in ("q", "k"):
            gamma = torch.linspace(0.5, 1.5, stock.hidden_size_per_attention_head)
            getattr(stock, f"{b}_layernorm").weight.copy_(gamma)
            getattr(ours, f"{b}_norm").weight.copy_(gamma)
    x = torch.randn(M.SEQ, 2, 32)
    qs, ks, vs = stock.get_query_key_value_tensors(x)
    qo, ko, vo = ours.get_query_key_value_tensors(x)
    return [float((qs - qo).abs().max()), float((ks - ko).abs().max()),
            float((vs - vo).abs().max())]


def test_dnp_on_q_and_k_is_stock_qk_layernorm():
    dq, dk, dv = run_on_ranks(_dnp_qk_vs_stock, 1)[0]
    assert dq < 1e-6 and dk < 1e-6
    assert dv > 1e-3  # V gets DNP's extra norm, which stock has no equivalent for


def _modes(rank, world, tp, sp):
    init_model_parallel(tp=tp)
    config = M.tiny_config(sequence_parallel=sp)
    out = {}
    for mode in ("weight", "activation"):
        cfg = ScaleVecConfig.from_string("hg+dp+or", apply_mode=mode)
        model = M.build_gpt(config, cfg)
        M.perturb_vectors(model)
        loss, grads = _loss_and_grads(model, M.batches(2, 2))
        out[mode] = (loss, grads)
    (lw, gw), (la, ga) = out["weight"], out["activation"]
    return lw, la, max(float((gw[k] - ga[k]).abs().max()) for k in gw)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (2, False)])
def test_weight_and_activation_modes_agree(tp, sp):
    for lw, la, gerr in run_on_ranks(_modes, tp, tp, sp):
        assert lw == pytest.approx(la, abs=1e-5)
        assert gerr < 1e-5


def _build_error(rank, world, strategy, tp, config_kw):
    init_model_parallel(tp=tp)
    try:
        M.build_gpt(M.tiny_config(**config_kw), strategy)
    except (ValueError, NotImplementedError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("strategy,tp,config_kw,words", [
    ("hg+dnp", 2, dict(num_query_groups=1), ["num_query_groups", "tensor_model_parallel_size"]),
    ("hg+dnp", 2, dict(ffn_hidden_size=65), ["ffn_hidden_size", "65"]),
    ("hg+dp", 1, dict(add_bias_linear=True), ["bias"]),
    ("shared", 1, dict(normalization="L2Norm"), ["RMSNorm or LayerNorm"]),
])
def test_bad_configurations_fail_clearly(strategy, tp, config_kw, words):
    msgs = run_on_ranks(_build_error, tp, strategy, tp, config_kw)
    assert msgs[0] is not None, "expected a clear error"
    for w in words:
        assert w in msgs[0], msgs[0]


def test_rope_mscale_without_yarn_is_one_even_with_the_field_present():
    """A Megatron-Bridge provider has ``yarn_rotary_scaling_factor=None`` (megatron-core's own
    helper then fails on ``None <= 1``): our RoPE scale reads 1 there, and megatron-core's YaRN
    factor where one is set."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    from megatron_scalevec.layers.attention import _rope_mscale

    assert _rope_mscale(SimpleNamespace()) == 1.0
    assert _rope_mscale(SimpleNamespace(yarn_rotary_scaling_factor=None)) == 1.0
    cfg = SimpleNamespace(yarn_rotary_scaling_factor=4.0, yarn_mscale=None,
                          yarn_mscale_all_dim=None)
    assert _rope_mscale(cfg) == yarn._yarn_get_mscale(4.0) > 1.0
