"""The Transformer Engine path (layers/te.py) over megatron-core's real TE wrappers and TE's real
Python modules (TE's pure-Python wheel, made importable on CPU by scalevec_testing/te_stub.py inside
the forked ranks only). Checked: the spec layout; ``shared`` has the stock TE spec's parameters and
checkpoint keys; every strategy's ``_get_weight_tensors()`` fold and its gradients equal the local
path's; HG's fused norm weight is a frozen identity outside the checkpoint; checkpoints move between
the TE and the local spec exactly; and TE's own fp32 and bf16 forward and backward (its autograd
functions over scalevec_testing/te_ops.py's torch GEMMs and norms) give the local spec's loss and
every gradient. Refusals: tests/layers/test_te_refusals.py. FP8: tests/layers/test_te_fp8.py
(TE's FP8 Python on CPU) and tools/te_check.py on a GPU.
"""

import os

import pytest
import torch

from megatron_scalevec.layers import te
from scalevec_testing import models as M
from scalevec_testing import run_on_ranks, te_stub
from scalevec_testing.markers import needs_te
from scalevec_testing.te_compare import compare_with_local, start_te, te_model, te_moe

STRATEGIES = ["shared", "hg", "hg+dp", "hg+or", "hg+er", "hg+dnp", "unified"]


# ---------------------------------------------------------------- layout and stock keys
def _layout(rank, world):
    start_te()
    from megatron.core.extensions import transformer_engine as ext
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_scalevec.layers import te_classes
    from megatron_scalevec.layers.parts import linear_modules
    from megatron_scalevec.specs import get_scalevec_layer_spec

    parts = linear_modules("transformer_engine")
    ours = [parts[k] for k in ("ln_column", "column", "grouped_column", "grouped_mlp")]
    ours += list(parts["norm"].values())
    again = linear_modules("transformer_engine")  # defined once, at te_classes' import
    once = [c.__module__ == te_classes.__name__ and "<locals>" not in c.__qualname__
            and getattr(te_classes, c.__name__) is c for c in ours]
    once += [again[k] is parts[k] for k in parts]
    dense = get_scalevec_layer_spec("unified", transformer_impl="transformer_engine").submodules
    att = dense.self_attention.submodules
    moe = get_scalevec_layer_spec("unified", 4, transformer_impl="transformer_engine",
                                  normalization="RMSNorm").submodules
    grouped = get_scalevec_layer_spec("unified", 4, transformer_impl="transformer_engine",
                                      normalization="RMSNorm",
                                      grouped_gemm=True).submodules.mlp.submodules.experts
    return [dense.input_layernorm is IdentityOp, dense.pre_mlp_layernorm is IdentityOp,
            att.linear_qkv.func is parts["ln_column"],
            issubclass(parts["ln_column"], ext.TELayerNormColumnParallelLinear),
            att.core_attention is ext.TEDotProductAttention,
            att.linear_proj is ext.TERowParallelLinear,
            dense.mlp.submodules.linear_fc1.module is parts["ln_column"],
            moe.pre_mlp_layernorm.module is parts["norm"]["RMSNorm"],
            moe.mlp.submodules.experts.submodules.linear_fc1.module is parts["column"],
            issubclass(parts["column"], ext.TEColumnParallelLinear),
            moe.mlp.submodules.shared_experts.submodules.linear_fc1.module is parts["column"],
            grouped.submodules.linear_fc1.module is parts["grouped_column"],
            issubclass(parts["grouped_column"], ext.TEColumnParallelGroupedLinear),
            grouped.submodules.linear_fc2 is ext.TERowParallelGroupedLinear,
            grouped.module is parts["grouped_mlp"],
            issubclass(parts["grouped_mlp"], TEGroupedMLP), *once]


@needs_te
def test_spec_uses_megatron_te_classes():
    checks = run_on_ranks(_layout, 1)[0]
    assert all(checks), checks


def _te_norms(rank, world):
    """For each normalization: the class each spec names, the class built, its TE base; a TE
    MoE layer spec without the normalization, and a mismatching config, refused."""
    start_te()
    import transformer_engine.pytorch as tep

    from megatron_scalevec.specs import get_scalevec_block_spec, get_scalevec_layer_spec

    out = {}
    for norm in ("LayerNorm", "RMSNorm"):
        config = M.tiny_config(transformer_impl="transformer_engine", normalization=norm,
                               **te_moe(4))
        block = get_scalevec_block_spec(config, "shared")
        specs = [block.layer_specs[0].submodules.pre_mlp_layernorm.module,
                 block.layer_norm.module]
        model = te_model("shared", normalization=norm, **te_moe(4))
        built = [type(model.decoder.layers[0].pre_mlp_layernorm),
                 type(model.decoder.final_layernorm)]
        out[norm] = dict(specs_are_built=specs == built, names=[c.__name__ for c in built],
                         te_base=all(issubclass(c, getattr(tep, norm)) for c in built),
                         no_new=all("__new__" not in vars(c) for c in built))
        other = "RMSNorm" if norm == "LayerNorm" else "LayerNorm"
        spec = get_scalevec_layer_spec("shared", 4, transformer_impl="transformer_engine",
                                       normalization=other)
        try:
            with te_stub.cuda_claimed():
                spec.submodules.pre_mlp_layernorm.module(
                    config, 32, scalevec=spec.submodules.pre_mlp_layernorm.params["scalevec"])
        except ValueError as err:
            out[norm]["mismatch"] = str(err)
    try:
        get_scalevec_layer_spec("shared", 4, transformer_impl="transformer_engine")
    except ValueError as err:
        out["missing"] = str(err)
    return out


@needs_te
def test_te_norm_class_is_chosen_when_the_spec_is_built():
    """The TE norm's class (LayerNorm or RMSNorm flavour) is the spec's own, picked from the
    normalization where the spec is built; the built module is an instance of exactly that
    class (no ``__new__`` returning another type)."""
    out = run_on_ranks(_te_norms, 1)[0]
    for norm in ("LayerNorm", "RMSNorm"):
        got = out[norm]
        assert got["specs_are_built"] and got["te_base"] and got["no_new"], (norm, got)
        assert got["names"] == [f"ScaleVecTE{norm}"] * 2, got
        assert "config.normalization" in got.get("mismatch", ""), got
    assert "normalization" in out.get("missing", ""), out


def test_without_te_the_error_is_clear():
    if te.HAVE_TE:
        pytest.skip("Transformer Engine with its extension is installed")
    from megatron_scalevec.specs import get_scalevec_layer_spec

    with pytest.raises(ImportError, match="needs Transformer Engine"):
        get_scalevec_layer_spec("unified", transformer_impl="transformer_engine")


def _stock_vs_shared(rank, world, experts, grouped, tp):
    start_te(tp)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    kw = te_moe(experts, grouped, sequence_parallel=tp > 1)
    config = M.tiny_config(transformer_impl="transformer_engine", **kw)
    with te_stub.cuda_claimed():
        stock = GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=True),
                         vocab_size=M.VOCAB, max_sequence_length=M.SEQ,
                         position_embedding_type="rope")
    ours = te_model("shared", **kw)

    def describe(m):
        params = {n: tuple(p.shape) for n, p in m.named_parameters()}
        sharded = {k: tuple(v.global_shape) for k, v in m.sharded_state_dict().items()
                   if hasattr(v, "global_shape")}
        return params, sharded, sorted(m.sharded_state_dict())

    return describe(stock), describe(ours)


@needs_te
@pytest.mark.parametrize("experts,grouped,tp", [(0, False, 1), (4, False, 1), (4, True, 1),
                                                (0, False, 2)])
def test_shared_has_the_stock_te_spec_keys(experts, grouped, tp):
    (p0, s0, k0), (p1, s1, k1) = run_on_ranks(_stock_vs_shared, tp, experts, grouped, tp)[0]
    assert p0 == p1, sorted(set(p0.items()) ^ set(p1.items()))
    assert s0 == s1 and k0 == k1, sorted(set(k0) ^ set(k1))


# ---------------------------------------------------------------- fold, gradients, checkpoints
def _local_counterpart(name: str, local, e=None):
    if e is not None:  # TE grouped fc1 -> sequential expert e's fc1
        name = name.replace(".experts.linear_fc1", f".experts.local_experts.{e}.linear_fc1")
    return local.get_submodule(name)


def _fold_vs_local(rank, world, strategy, experts, grouped, zero_centered, tp, tmp):
    from megatron.core import dist_checkpointing

    start_te(tp)
    kw = dict(te_moe(experts), sequence_parallel=tp > 1,
              layernorm_zero_centered_gamma=zero_centered)
    local = M.build_gpt(M.tiny_config(**kw), strategy)  # sequential experts
    M.perturb_vectors(local)
    local_dir, te_dir = os.path.join(tmp, "local"), os.path.join(tmp, "te")
    M.save_model(local, local_dir)
    model = te_model(strategy, **{**kw, "moe_grouped_gemm": grouped})
    # local checkpoint -> TE model
    state = dist_checkpointing.load(M.te_as_local_keys(model.sharded_state_dict()), local_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    out = dict(missing=[k for k in missing if not k.endswith("_extra_state")],
               unexpected=list(unexpected))
    # the fold of every folded TE module = the local module's, and so are its gradients
    worst, folded = 0.0, 0
    g = torch.Generator().manual_seed(11)
    for name, mod in model.named_modules():
        if not getattr(mod, "has_scale_vectors", False) or not hasattr(mod, "_get_weight_tensors"):
            continue
        weights = mod._get_weight_tensors()
        refs = [_local_counterpart(name, local, e if len(weights) > 1 else None)
                for e in range(len(weights))]
        ref_w = [m.effective_weight(m.weight) for m in refs]
        rs = [torch.randn(w.shape, generator=g) for w in ref_w]
        model.zero_grad(), local.zero_grad()
        sum((w * r).sum() for w, r in zip(weights, rs)).backward()
        sum((w * r).sum() for w, r in zip(ref_w, rs)).backward()
        for e, (w, ref, ref_mod) in enumerate(zip(weights, ref_w, refs)):
            worst = max(worst, float((w - ref).abs().max()) / float(ref.abs().max()))
            te_params = dict(mod.named_parameters())
            if len(weights) > 1:
                te_params = {k.replace(f"scale_vectors.{e}.", ""): v for k, v in te_params.items()
                             if k.startswith(f"scale_vectors.{e}.") or k == f"weight{e}"}
                te_params["weight"] = te_params.pop(f"weight{e}")
            for pname, p_ref in ref_mod.named_parameters():
                p = te_params[pname]
                if p_ref.grad is None:
                    assert p.grad is None, (name, pname)
                    continue
                if p.grad is None:  # the fold lost this parameter
                    worst = float("inf")
                    continue
                scale = max(float(p_ref.grad.abs().max()), 1e-30)
                worst = max(worst, float((p.grad - p_ref.grad).abs().max()) / scale)
            folded += 1
    out.update(worst=worst, folded=folded)
    # HG: the fused / pre-MLP TE norm weights are a frozen identity, not in the checkpoint
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    out["frozen"] = sorted(frozen)
    out["frozen_values"] = sorted({float(v) for p in frozen.values() for v in p.flatten()})
    out["norm_keys"] = sorted(k for k in model.sharded_state_dict() if "layer_norm_weight" in k
                              or "pre_mlp_layernorm.weight" in k)
    # TE model -> checkpoint -> equal to the local checkpoint, tensor for tensor
    M.save_model(model, te_dir)
    os.makedirs(os.path.join(tmp, "te_as_local"), exist_ok=True)
    dist_checkpointing.save(M.te_as_local_keys(model.sharded_state_dict()),
                            os.path.join(tmp, "te_as_local"))
    a, b = M.plain_tensors(local_dir), M.plain_tensors(os.path.join(tmp, "te_as_local"))
    out["ckpt"] = M.max_differences(a, b) if set(a) == set(b) else sorted(set(a) ^ set(b))
    # and back: the TE checkpoint loads into a fresh local model exactly
    fresh = M.build_gpt(M.tiny_config(**kw), strategy, seed=99)
    te_keys = set(M.plain_tensors(te_dir))
    back = dist_checkpointing.load(_as_te_keys(fresh.sharded_state_dict(), te_keys), te_dir)
    fresh.load_state_dict(back, strict=False)
    out["back"] = max(float((p - dict(local.named_parameters())[n]).abs().max())
                      for n, p in fresh.named_parameters())
    return out


def _as_te_keys(sharded: dict, te_keys: set) -> dict:
    """A local model's sharded tensors under a TE checkpoint's keys (the inverse renaming)."""
    for sh in sharded.values():
        for te_part, local_part in M.TE_FUSED_NORMS.items():
            if sh.key not in te_keys and local_part in sh.key:
                sh.key = sh.key.replace(local_part, te_part)
    return sharded


CASES = [(s, 0, False, False) for s in STRATEGIES] + \
        [(s, 4, False, False) for s in STRATEGIES] + \
        [(s, 4, True, False) for s in STRATEGIES] + \
        [("unified", 0, False, True), ("hg+dp+er", 4, False, True), ("hg+or", 4, True, True)]


@needs_te
@pytest.mark.parametrize("strategy,experts,grouped,zc", CASES)
def test_te_fold_and_checkpoint_equal_local_path(tmp_path, strategy, experts, grouped, zc):
    r = run_on_ranks(_fold_vs_local, 1, strategy, experts, grouped, zc, 1, str(tmp_path))[0]
    assert not r["missing"] and not r["unexpected"], r
    assert (r["folded"] > 0) == (strategy != "shared"), r
    assert r["worst"] < 1e-5, r
    assert isinstance(r["ckpt"], dict) and max(r["ckpt"].values()) == 0.0, r["ckpt"]
    assert r["back"] == 0.0, r
    if strategy == "shared":  # the stock trainable gamma under the stock name
        assert not r["frozen"] and r["norm_keys"], r
    else:  # HG: every fused / pre-MLP norm frozen at identity and not saved
        assert r["frozen"] and not r["norm_keys"], r
        assert r["frozen_values"] == [0.0 if zc else 1.0], r
        assert all(n.endswith(("layer_norm_weight", "pre_mlp_layernorm.weight"))
                   for n in r["frozen"]), r["frozen"]


def _fold_tp2(rank, world, strategy, experts, tmp):
    return _fold_vs_local(rank, world, strategy, experts, False, False, 2, tmp)


@needs_te
@pytest.mark.parametrize("strategy,experts", [("unified", 0), ("hg+dp", 4)])
def test_te_fold_and_checkpoint_tp2_sequence_parallel(tmp_path, strategy, experts):
    for r in run_on_ranks(_fold_tp2, 2, strategy, experts, str(tmp_path)):
        assert not r["missing"] and not r["unexpected"] and r["folded"] > 0, r
        assert r["worst"] < 1e-5 and r["back"] == 0.0, r
        assert isinstance(r["ckpt"], dict) and max(r["ckpt"].values()) == 0.0, r["ckpt"]


# ---------------------------------------------------------------- TE's own forward / backward
def _run_vs_local(rank, world, strategy, experts, grouped, tp, tmp, extra=None):
    from megatron.core import dist_checkpointing

    start_te(tp)
    kw = dict(te_moe(experts), sequence_parallel=tp > 1, **(extra or {}))
    local = M.build_gpt(M.tiny_config(**kw), strategy)
    M.perturb_vectors(local)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LayerNorm's biases away from 0: where each adds them shows
        for name, p in local.named_parameters():
            if name.endswith("layernorm.bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    M.save_model(local, os.path.join(tmp, "local"))
    model = te_model(strategy, **{**kw, "moe_grouped_gemm": grouped})
    state = dist_checkpointing.load(M.te_as_local_keys(model.sharded_state_dict()),
                                    os.path.join(tmp, "local"))
    model.load_state_dict(state, strict=False)
    from scalevec_testing import te_ops

    te_ops.CALLS.clear()
    r = compare_with_local(local, model, M.batches(1, 2)[0])
    return dict(dloss=r["dloss"], loss=r["loss"], same=r["only_one"], calls=dict(te_ops.CALLS),
                worst=max(r["rel"].values()), worst_name=max(r["rel"], key=r["rel"].get))


RUN_CASES = [("shared", 0, False), ("unified", 0, False), ("hg+dp+er", 4, False),
             ("unified", 4, False), ("hg+or", 4, True), ("shared", 4, True),
             ("unified", 4, True)]


@needs_te
@pytest.mark.parametrize("strategy,experts,grouped", RUN_CASES)
def test_te_forward_backward_equal_local_path(tmp_path, strategy, experts, grouped):
    """TE's own autograd functions (te_ops' GEMMs and norms on CPU, fp32) give the local spec's
    loss and every gradient."""
    r = run_on_ranks(_run_vs_local, 1, strategy, experts, grouped, 1, str(tmp_path))[0]
    assert not r["same"], r
    assert r["dloss"] < 1e-5 * max(1.0, r["loss"]) and r["worst"] < 1e-4, r
    # TE's own path ran: the fused norms and GEMMs (grouped ones for grouped experts)
    used = {"generic_gemm", "rmsnorm_fwd", "rmsnorm_bwd"}
    used |= {"te_general_grouped_gemm"} if grouped else set()
    assert used <= set(r["calls"]), r["calls"]


EXTRA_CASES = [  # options users run with: biases (no DP: it refuses a bias), zero-centred
    # gamma; dense and TE grouped experts
    ("hg+dnp", 0, False, dict(add_bias_linear=True)),
    ("hg+dnp", 4, True, dict(add_bias_linear=True)),
    ("unified", 0, False, dict(layernorm_zero_centered_gamma=True)),
    ("unified", 4, True, dict(layernorm_zero_centered_gamma=True)),
    # LayerNorm's bias before the folded branch vectors: TE's fused LayerNorm, ours alike
    ("hg+dp", 4, True, dict(normalization="LayerNorm")),
]


@needs_te
@pytest.mark.parametrize("strategy,experts,grouped,extra", EXTRA_CASES,
                         ids=["bias", "bias-te_grouped", "zero_centered",
                              "zero_centered-te_grouped", "layernorm_bias-te_grouped"])
def test_te_forward_backward_equal_local_path_with_options(tmp_path, strategy, experts, grouped,
                                                           extra):
    r = run_on_ranks(_run_vs_local, 1, strategy, experts, grouped, 1, str(tmp_path), extra)[0]
    assert not r["same"], r
    assert r["dloss"] < 1e-5 * max(1.0, r["loss"]) and r["worst"] < 1e-4, r


BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


@needs_te
@pytest.mark.parametrize("strategy,experts,grouped,extra", [
    ("unified", 0, False, {}), ("unified", 4, True, {}),
    ("hg+dnp", 4, True, dict(add_bias_linear=True))], ids=["dense", "te_grouped", "bias"])
def test_te_forward_backward_equal_local_path_in_bf16(tmp_path, strategy, experts, grouped,
                                                      extra):
    """bf16 parameters (TE's bf16 GEMMs and norms, its attention on the unfused path): the local
    spec's loss and gradients to bf16 rounding (an OR magnitude's cancelling sum, measured
    against its direction's gradient, reaches a few 2^-8)."""
    r = run_on_ranks(_run_vs_local, 1, strategy, experts, grouped, 1, str(tmp_path),
                     {**BF16, **extra})[0]
    assert not r["same"] and r["dloss"] < 1e-3 * r["loss"] and r["worst"] < 0.1, r


def _run_tp2(rank, world, strategy, experts, tmp):
    return _run_vs_local(rank, world, strategy, experts, False, 2, tmp)


@needs_te
@pytest.mark.parametrize("strategy,experts", [("unified", 0), ("hg+dp", 4)])
def test_te_forward_backward_tp2_sequence_parallel(tmp_path, strategy, experts):
    for r in run_on_ranks(_run_tp2, 2, strategy, experts, str(tmp_path)):
        assert not r["same"] and r["dloss"] < 1e-5 * max(1.0, r["loss"]), r
        assert r["worst"] < 1e-4 and "generic_gemm" in r["calls"], r


def _with_real_extension(rank, world):
    import importlib
    import sys
    import types
    import warnings

    sys.modules[te_stub.EXTENSION] = types.ModuleType(te_stub.EXTENSION)  # "compiled" TE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.reload(te_stub)
    try:
        te_stub.activate()
    except RuntimeError as err:
        return [str(w.message) for w in caught], str(err)
    return [str(w.message) for w in caught], None


def test_stub_warns_and_refuses_where_real_te_is_installed():
    warned, refused = run_on_ranks(_with_real_extension, 1)[0]
    assert any("compiled extension is installed" in w for w in warned), warned
    assert refused and "real Transformer Engine extension is installed" in refused, refused


# ---------------------------------------------------------------- memory kept for backward
def _kept(rank, world):
    from benchmarks.overhead import kept_bytes, saved_activation_bytes

    start_te()
    batch = M.batches(1, 2)[0]
    out = {}
    for impl in ("transformer_engine", "local"):
        for strategy in ("shared", "hg+dp", "unified"):
            with te_stub.cuda_claimed():
                model = M.build_gpt(M.tiny_config(transformer_impl=impl, hidden_size=64,
                                                  ffn_hidden_size=256), strategy)

                def forward(m=model):
                    return m(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

                out[impl, strategy] = (kept_bytes(forward), saved_activation_bytes(forward))
            out["folded", impl] = sum(p.numel() * p.element_size() for n, p in
                                      model.named_parameters()
                                      if n.endswith(("linear_qkv.weight", "linear_fc1.weight")))
    return out


@needs_te
def test_te_keeps_no_folded_weight_after_the_forward():
    """Bytes a forward keeps for backward (storages alive after it): TE saves the folded
    weight it multiplied (and pins it on ctx), the fold releases it until TE's backward, so
    every strategy keeps at most 1.02x ``shared`` of the same layout, TE as local; under TE
    the folded weights (qkv and fc1 of every layer) were saved, and released."""
    kept = run_on_ranks(_kept, 1)[0]
    for impl in ("transformer_engine", "local"):
        base = kept[impl, "shared"][0]
        for strategy in ("hg+dp", "unified"):
            assert kept[impl, strategy][0] <= 1.02 * base, (impl, strategy, kept)
    folded = kept["folded", "transformer_engine"]
    for strategy in ("hg+dp", "unified"):
        held, saved = kept["transformer_engine", strategy]
        assert saved - held >= folded, (strategy, folded, kept)
