"""The Transformer Engine path (layers/te.py) over stand-in TE base classes: TE cannot be
installed here, so megatron-core's TE wrappers are replaced by small torch modules with the
same constructor arguments, weight names and ``_get_weight_tensors()`` hook. Checked: the spec
picks our classes in megatron-core's TE layout, a model built from them computes what the local
path computes (loss and every gradient) with the same checkpoint keys, the fused norm is frozen
and unsaved under HG and the stock gamma under ``shared``, and the refusals.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_scalevec import sharding
from megatron_scalevec.layers import te
from megatron_scalevec.norms import normalize
from megatron_scalevec.testing import init_model_parallel, run_on_ranks
from megatron_scalevec.testing import models as M


class FakeTELinear(torch.nn.Module):
    """TE linear stand-in: weight [out_local, in], the weight read through the hook."""

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert=False, gather_output=False, tp_comm_buffer_name=None, tp_group=None,
                 stride=1, skip_weight_param_allocation=False, **kwargs):
        super().__init__()
        out = output_size // sharding.group_size(sharding.tp_group(is_expert))
        self.config = config
        self.weight = torch.nn.Parameter(torch.empty(out, input_size))
        init_method(self.weight)
        self.bias = None
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion

    def _get_weight_tensors(self):
        return [self.weight]

    def _norm(self, x):
        return x

    def forward(self, x):
        return F.linear(self._norm(x), self._get_weight_tensors()[0]), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets)


class FakeTELayerNormLinear(FakeTELinear):
    def __init__(self, input_size, output_size, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.zero_centered = self.config.layernorm_zero_centered_gamma
        init = 0.0 if self.zero_centered else 1.0
        self.layer_norm_weight = torch.nn.Parameter(torch.full((input_size,), init))

    def _norm(self, x):
        y = normalize(x, self.config.normalization, self.config.layernorm_epsilon)
        return (y * (self.layer_norm_weight + float(self.zero_centered))).to(x.dtype)


class FakeTENorm(torch.nn.Module):
    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        self.config, self.eps = config, eps
        init = 0.0 if config.layernorm_zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init))

    def forward(self, x):
        zc = float(self.config.layernorm_zero_centered_gamma)  # TE: (1 + gamma) then
        return (normalize(x, self.config.normalization, self.eps) * (self.weight + zc)).to(x.dtype)


class FakeGrouped(torch.nn.Module):
    def __init__(self, num_gemms, input_size, output_size, *, config, **kwargs):
        super().__init__()
        for e in range(num_gemms):
            self.register_parameter(f"weight{e}", torch.nn.Parameter(
                torch.randn(output_size, input_size)))

    def _get_weight_tensors(self):
        return [getattr(self, f"weight{e}") for e in range(len(self._parameters))]


def fake_bases():
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    return dict(TELayerNormColumnParallelLinear=FakeTELayerNormLinear,
                TEColumnParallelLinear=FakeTELinear, TERowParallelLinear=RowParallelLinear,
                TEColumnParallelGroupedLinear=FakeGrouped, TERowParallelGroupedLinear=FakeGrouped,
                TENorm=FakeTENorm, TEDotProductAttention=DotProductAttention,
                TEGroupedMLP=TEGroupedMLP)


@pytest.fixture
def fake_te(monkeypatch):
    classes = te.make_te_classes(fake_bases())
    monkeypatch.setattr(te, "HAVE_TE", True)
    monkeypatch.setattr(te, "_CACHE", dict(classes))
    return classes


def _cfg(name, **kw):
    from megatron_scalevec.config import ScaleVecConfig

    return ScaleVecConfig.from_string(name, **kw)


def test_spec_uses_megatron_te_layout(fake_te):
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_scalevec.specs import get_scalevec_layer_spec

    dense = get_scalevec_layer_spec("unified", transformer_impl="transformer_engine").submodules
    assert dense.input_layernorm is IdentityOp and dense.pre_mlp_layernorm is IdentityOp
    att = dense.self_attention.submodules
    assert att.linear_qkv.func is fake_te["ln_column"]
    assert att.core_attention is fake_te["attention"] and att.linear_proj is fake_te["row"]
    assert dense.mlp.submodules.linear_fc1.module is fake_te["ln_column"]
    moe = get_scalevec_layer_spec("unified", 4, transformer_impl="transformer_engine").submodules
    assert moe.pre_mlp_layernorm.module is fake_te["norm"]
    experts = moe.mlp.submodules.experts
    assert experts.submodules.linear_fc1.module is fake_te["column"]
    assert moe.mlp.submodules.shared_experts.submodules.linear_fc1.module is fake_te["column"]
    grouped = get_scalevec_layer_spec("hg+dp", 4, transformer_impl="transformer_engine",
                                      grouped_gemm=True).submodules.mlp.submodules.experts
    assert grouped.module is fake_te["grouped_mlp"]
    assert grouped.submodules.linear_fc1.module is fake_te["grouped_column"]
    assert grouped.submodules.linear_fc2 is fake_te["grouped_row"]


def test_without_te_the_error_is_clear():
    if te.HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    from megatron_scalevec.specs import get_scalevec_layer_spec

    with pytest.raises(ImportError, match="needs Transformer Engine"):
        get_scalevec_layer_spec("unified", transformer_impl="transformer_engine")


# ---------------------------------------------------------------- numerics over stand-ins
def _te_vs_local(rank, world, strategy, experts, zero_centered):
    init_model_parallel()
    kw = dict(layernorm_zero_centered_gamma=zero_centered)
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=24,
                  moe_layer_freq=[1, 0], moe_aux_loss_coeff=0.0)
    local = M.build_gpt(M.tiny_config(**kw), strategy)
    M.perturb_vectors(local)
    model = M.build_gpt(M.tiny_config(transformer_impl="transformer_engine", **kw), strategy)
    sd = {k: v for k, v in local.state_dict().items() if "_extra_state" not in k}
    def te_name(k):  # shared: the Pre-Norm gammas under their stock TE names
        k = k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        dense = "layers.1." in k or not experts  # an MoE layer keeps its pre-MLP TE norm
        return k.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight") \
            if dense else k

    sd = {te_name(k): v for k, v in sd.items()}
    model.load_state_dict(sd, strict=True)  # the same keys, nothing missing or unexpected
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    values = {float(p.detach().abs().max()) for n, p in model.named_parameters() if n in frozen}
    b = M.batches(1, 2)[0]
    out = []
    for m in (local, model):
        m.zero_grad()
        loss = m(b["tokens"], b["position_ids"], None, labels=b["labels"]).float().mean()
        loss.backward()
        out.append((float(loss), {n: p.grad for n, p in m.named_parameters()
                                  if p.grad is not None}))
    (l0, g0), (l1, g1) = out
    g0 = {te_name(n): g for n, g in g0.items()}
    def scale(n):  # OR's magnitude / ER's alpha: a sum with cancellation, see test_grouped
        sibling = n.replace(".magnitude", ".direction").replace(".alpha", ".logit")
        return max(float(g0[n].abs().max()), float(g0.get(sibling, g0[n]).abs().max()), 1e-30)

    rel = {n: float((g0[n] - g1[n]).abs().max()) / scale(n) for n in g0}
    return dict(dloss=abs(l0 - l1), worst=max(rel.values()), worst_name=max(rel, key=rel.get),
                same_grads=set(g0) == set(g1),
                frozen=sorted(frozen), values=values, keys=sorted(model.state_dict()),
                n_vec=sum(1 for n in g0 if "scale_" in n))


@pytest.mark.parametrize("strategy,experts,zc", [("unified", 0, False), ("hg+dp+er", 4, True),
                                                 ("shared", 4, False)])
def test_te_fold_equals_local_path(fake_te, strategy, experts, zc):
    r = run_on_ranks(_te_vs_local, 1, _cfg(strategy), experts, zc)[0]
    assert r["dloss"] < 1e-6 and r["same_grads"], r
    assert r["worst"] < 1e-4, r
    assert (r["n_vec"] > 0) == (strategy != "shared"), r
    ln = [k for k in r["keys"] if "layer_norm_weight" in k]
    if strategy == "shared":
        assert not r["frozen"] and ln  # the stock trainable gamma under the stock name
    else:  # HG: every fused / pre-MLP norm frozen at identity and not saved
        assert not ln and r["frozen"] and r["values"] == {0.0 if zc else 1.0}, r
        assert all(n.endswith(("layer_norm_weight", "pre_mlp_layernorm.weight"))
                   for n in r["frozen"]), r["frozen"]


# ---------------------------------------------------------------- refusals
def _refusal(rank, world, field, strategy, grouped):
    init_model_parallel()
    config = M.tiny_config(transformer_impl="transformer_engine")
    if field:
        object.__setattr__(config, field, True)
    cls = te.te_modules()["grouped_column" if grouped else "ln_column"]
    args = (4, 32, 48) if grouped else (32, 48)
    extra = {} if grouped else dict(gather_output=False, branches="fc1")
    try:
        cls(*args, scalevec=strategy, config=config, init_method=torch.nn.init.zeros_,
            bias=False, skip_bias_add=False, is_expert=grouped, **extra)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("field", ["delay_wgrad_compute", "use_te_op_fuser", "fp8_param",
                                   "use_megatron_fsdp", "moe_single_grouped_weight"])
def test_folded_modules_refuse_unsupported_te_options(fake_te, field):
    msg = run_on_ranks(_refusal, 1, field, _cfg("unified"), False)[0]
    assert msg and f"config.{field}=True" in msg, msg


def test_refusals_for_activation_mode_and_dnp_on_te_grouped(fake_te):
    msg = run_on_ranks(_refusal, 1, None, _cfg("hg", apply_mode="activation"), False)[0]
    assert msg and "fold the vectors" in msg, msg
    msg = run_on_ranks(_refusal, 1, None, _cfg("unified"), True)[0]
    assert msg and "TE grouped experts" in msg, msg
    assert run_on_ranks(_refusal, 1, None, _cfg("hg+dp"), True)[0] is None
    msg = run_on_ranks(_refusal, 1, None, _cfg("shared+or"), False)[0]
    assert msg and "plain TE parameter" in msg, msg


def _grouped_fold(rank, world):
    """The TE grouped fc1's weight{e} seen through the hook = each expert's effective weight."""
    init_model_parallel()
    config = M.tiny_config(transformer_impl="transformer_engine")
    cls = te.te_modules()["grouped_column"]
    lin = cls(3, 32, 8, scalevec=_cfg("hg+dp+or"), config=config, is_expert=True)
    M.perturb_vectors(lin)
    got = lin._get_weight_tensors()
    ref = [v.effective_weight(getattr(lin, f"weight{e}"))
           for e, v in enumerate(lin.scale_vectors)]
    assert not lin.fuse_wgrad_accumulation
    return max(float((a - b).abs().max()) for a, b in zip(got, ref))


def test_te_grouped_fold_equals_per_expert_effective_weight(fake_te):
    assert run_on_ranks(_grouped_fold, 1)[0] < 1e-6
