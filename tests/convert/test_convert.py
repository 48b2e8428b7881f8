"""Checkpoint conversion (tools/convert_checkpoint.py): warm start, exact fold, Hugging Face,
refusals, layouts (the trainer <-> converter round trips: tests/convert/test_convert_trainer.py).

Every case runs in a forked one-rank (or two-rank) gloo child (run_on_ranks), so this file
never leaves a process group in the pytest parent. Tolerances: fp32 logits of tiny models.
"""

import importlib.util
import os

import pytest

from scalevec_testing import run_on_ranks

TOL = 1e-5
HF_TOL = 1e-4
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository root


def _arch(**kw):
    from megatron_scalevec.convert.arch import ModelArch

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=64, max_sequence_length=32)
    base.update(kw)
    return ModelArch(**base)


def _stock_with_gammas(arch, positive=True):
    """A stock model whose norm weights are not 1 (so a lost gamma shows)."""
    import torch

    from megatron_scalevec.convert.build import build_model

    model = build_model(arch.replace(scalevec="stock"))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                noise = 0.3 * torch.randn(p.shape, generator=g)
                p.copy_(1 + (noise.abs() if positive else noise))
                if not positive:
                    p[0] = -0.5
    return model


def _logits_of(arch, sd):
    from megatron_scalevec.convert.build import build_model, logits, sample_batch
    from megatron_scalevec.convert.io import load_full_into

    model = build_model(arch)
    load_full_into(model, sd)
    return logits(model, *sample_batch(arch))


WARM = ["shared", "none", "hg", "hg+dp", "shared+or", "hg+or", "hg+er", "hg+dp+er", "hg+dp+or"]


MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2)
ARCHS = {"plain": {}, "qk_norm": dict(qk_layernorm=True),
         # LayerNorm's biases (stock's, non-zero): kept, or moved inside the branch vectors
         "layernorm_qk_norm": dict(normalization="LayerNorm", qk_layernorm=True),
         # layer 0 MoE with a shared expert, layer 1 dense
         "moe_shared_mixed": dict(MOE, moe_shared_expert_intermediate_size=40,
                                  moe_layer_freq=[1, 0])}


def _warm_case(rank, world, kind):
    from megatron_scalevec.convert.build import logits, sample_batch
    from megatron_scalevec.convert.io import full_state_dict
    from megatron_scalevec.convert.warmstart import FunctionChangeError, warm_start

    arch = _arch(**ARCHS[kind])
    stock = _stock_with_gammas(arch)
    ref = logits(stock, *sample_batch(arch))
    sd = full_state_dict(stock)
    out = {}
    for target in WARM:
        if target == "none" and arch.qk_layernorm:  # QK-norm gammas cannot be folded
            try:
                warm_start(sd, arch, target)
            except FunctionChangeError as err:
                out[target] = (0.0, 0.0) if "q/k_layernorm" in str(err) else (1.0, 0.0)
            model, report = warm_start(sd, arch, target, allow_function_change=True)
            assert report["max_logit_diff"] > 0  # ... and dropping them changes the function
            continue
        model, report = warm_start(sd, arch, target)
        out[target] = (float((logits(model, *sample_batch(arch)) - ref).abs().max()),
                       report["max_logit_diff"])
    return out


@pytest.mark.parametrize("kind", list(ARCHS))
def test_warm_start_preserves_logits(kind):
    diffs = run_on_ranks(_warm_case, 1, kind)[0]
    assert set(diffs) == set(WARM)
    for target, (measured, reported) in diffs.items():
        assert measured < TOL, (target, measured)
        assert abs(measured - reported) < 1e-7, target


FOLD = ["hg", "hg+dp", "hg+dp+or", "hg+er", "shared+or", "shared+dp+er", "none"]


def _fold_case(rank, world, kind):
    import torch

    from megatron_scalevec.convert.build import build_model, logits, sample_batch
    from megatron_scalevec.convert.fold import fold_to_stock
    from scalevec_testing.models import perturb_vectors

    out = {}
    for strategy in FOLD:
        arch = _arch(scalevec=strategy, **ARCHS[kind])
        model = build_model(arch)
        moved = perturb_vectors(model, 0.3)
        # a few SGD steps too, so the matrices and vectors are not at their init
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        tokens, pos = sample_batch(arch)
        for _ in range(2):
            opt.zero_grad()
            model.train()
            model(tokens, pos, None, labels=tokens).float().mean().backward()
            opt.step()
        ours = logits(model, tokens, pos)
        sd, stock_arch = fold_to_stock(model, arch)
        assert stock_arch.is_stock and stock_arch.qk_layernorm == arch.qk_layernorm
        folded = _logits_of(stock_arch, sd)
        norms = [k for k in sd if k.endswith(("input_layernorm.weight",
                                               "pre_mlp_layernorm.weight"))]
        ones = all(bool(torch.equal(sd[k], torch.ones_like(sd[k]))) for k in norms)
        out[strategy] = (float((folded - ours).abs().max()), moved, ones)
    return out


@pytest.mark.parametrize("kind", list(ARCHS))
def test_fold_to_stock_is_exact(kind):
    diffs = run_on_ranks(_fold_case, 1, kind)[0]
    for strategy, (diff, moved, norms_are_one) in diffs.items():
        assert moved > 0 or strategy == "none", strategy
        assert diff < TOL, (strategy, diff)
        # HG moves gamma into the branches: the stock Pre-Norm weight must be exactly 1
        if strategy.startswith("hg") or strategy == "none":
            assert norms_are_one, strategy


def _hf_case(rank, world, tmp, strategy, extra):
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_scalevec.convert.build import build_model, logits, sample_batch
    from megatron_scalevec.convert.fold import fold_to_stock
    from megatron_scalevec.convert.hf import export_hf, import_hf
    from megatron_scalevec.convert.warmstart import warm_start
    from scalevec_testing.models import perturb_vectors

    arch = _arch(scalevec=strategy, rotary_base=5000.0, layernorm_epsilon=1e-6, **extra)
    model = build_model(arch)
    perturb_vectors(model, 0.3)
    tokens, pos = sample_batch(arch)
    ours = logits(model, tokens, pos)
    sd, stock_arch = fold_to_stock(model, arch)
    out = os.path.join(tmp, "hf")
    name = export_hf(sd, stock_arch, out, show_progress=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits.float()
    back_sd, back_arch = import_hf(out)
    back, _ = warm_start(back_sd, back_arch, strategy)
    return (name, type(hf).__name__, float((theirs - ours).abs().max()),
            float((logits(back, tokens, pos) - ours).abs().max()))


HF_CASES = {
    "llama_gqa": ("hg+dp+or", {}, "LlamaForCausalLM"),
    "qwen3_qk_norm_tied": ("hg", dict(qk_layernorm=True, tie_embeddings=True),
                           "Qwen3ForCausalLM"),
    "mixtral": ("hg+dp+er", MOE, "MixtralForCausalLM"),
    "qwen3_moe_pre_softmax": ("hg+dp", dict(MOE, qk_layernorm=True, moe_router_pre_softmax=True),
                              "Qwen3MoeForCausalLM"),
}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers (test extra) not installed")
@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_export_and_import(tmp_path, case):
    strategy, extra, expected = HF_CASES[case]
    name, cls, diff_hf, diff_back = run_on_ranks(_hf_case, 1, str(tmp_path), strategy,
                                                 extra)[0]
    assert name == expected and cls == expected
    assert diff_hf < HF_TOL, diff_hf
    assert diff_back < TOL, diff_back


def _refusal_case(rank, world, tmp):
    from megatron_scalevec.convert.api import convert
    from megatron_scalevec.convert.build import build_model
    from megatron_scalevec.convert.io import full_state_dict, save_full
    from megatron_scalevec.convert.warmstart import FunctionChangeError

    messages = {}
    arch = _arch(scalevec="unified")
    dnp = os.path.join(tmp, "dnp")
    save_full(full_state_dict(build_model(arch)), arch, dnp, show_progress=False)
    negative = os.path.join(tmp, "negative")
    stock_arch = _arch()
    save_full(full_state_dict(_stock_with_gammas(stock_arch, positive=False)), stock_arch,
              negative, show_progress=False)
    cases = {"fold_dnp": (dnp, "stock", {}),
             "er_negative": (negative, "hg+er", {}), "dnp_warm": (negative, "hg+dnp", {})}
    for name, (src, target, kw) in cases.items():
        out = os.path.join(tmp, f"out_{name}")
        try:
            convert(src, out, target, **kw)
            messages[name] = None
        except (FunctionChangeError, ValueError) as e:
            messages[name] = str(e)
        messages[name + "_exists"] = os.path.exists(out)
    # with the flag, DNP converts and reports how much the function changed
    report = convert(negative, os.path.join(tmp, "allowed"), "hg+dnp",
                     allow_function_change=True)
    messages["allowed_diff"] = report["max_logit_diff"]
    messages["leftovers"] = sorted(f for f in os.listdir(tmp) if ".tmp-" in f)
    return messages


def test_refused_conversions_leave_nothing(tmp_path):
    m = run_on_ranks(_refusal_case, 1, str(tmp_path))[0]
    for case in ("fold_dnp",):
        assert m[case] is not None and "['gate', 'up', 'v']" in m[case], m[case]
        assert "no stock equivalent" in m[case]
    assert "ER parameterization needs gamma > 0" in m["er_negative"]
    assert "decoder.layers.0." in m["er_negative"]
    assert "--allow-function-change" in m["dnp_warm"]
    for case in ("fold_dnp", "er_negative", "dnp_warm"):
        assert not m[case + "_exists"], case
    assert m["leftovers"] == []
    assert m["allowed_diff"] > 1e-3  # DNP really changes the outputs, and it is reported


def _save_tp2(rank, world, tmp, strategy):
    import torch

    from megatron_scalevec.convert.build import build_model, sample_batch
    from megatron_scalevec.convert.io import save_dist
    from scalevec_testing import gather_full_tensor, init_model_parallel
    from scalevec_testing.models import perturb_vectors

    init_model_parallel(tp=2)
    arch = _arch(scalevec=strategy)
    model = build_model(arch, seed=11)
    perturb_vectors(model, 0.3)
    save_dist(model, os.path.join(tmp, "tp2"), arch)
    model.eval()
    with torch.no_grad():
        local = model(*sample_batch(arch), None)  # [b, s, vocab / tp]
    from megatron.core import parallel_state

    return gather_full_tensor(local, -1, parallel_state.get_tensor_model_parallel_group())


def _convert_tp2(rank, world, tmp):
    from megatron_scalevec.convert.api import convert, read_checkpoint

    report = convert(os.path.join(tmp, "tp2"), os.path.join(tmp, "stock"), "stock")
    sd, arch = read_checkpoint(os.path.join(tmp, "stock"))
    return _logits_of(arch, sd), report


def test_convert_from_tp2_dist_checkpoint(tmp_path):
    tp2_logits = run_on_ranks(_save_tp2, 2, str(tmp_path), "hg+dp+or")[0]
    folded, report = run_on_ranks(_convert_tp2, 1, str(tmp_path))[0]
    assert report["max_logit_diff"] < TOL
    assert float((folded - tp2_logits).abs().max()) < TOL


def _cli_case(rank, world, tmp):
    import importlib.util as iu

    from megatron_scalevec.convert.api import read_checkpoint
    from megatron_scalevec.convert.build import build_model
    from megatron_scalevec.convert.io import full_state_dict, save_full

    arch = _arch(scalevec="hg+dp")
    save_full(full_state_dict(build_model(arch)), arch, os.path.join(tmp, "src"),
              show_progress=False)
    spec = iu.spec_from_file_location("cc", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    cli = iu.module_from_spec(spec)
    spec.loader.exec_module(cli)
    rc = cli.main(["--load", os.path.join(tmp, "src"), "--save", os.path.join(tmp, "dist"),
                   "--to", "shared+or", "--format", "dist"])
    refused = cli.main(["--load", os.path.join(tmp, "src"), "--save", os.path.join(tmp, "dnp"),
                        "--to", "unified"])
    sd, out_arch = read_checkpoint(os.path.join(tmp, "dist"))
    return (rc, out_arch.scalevec, sorted(k for k in sd if "magnitude" in k)[:1], refused,
            os.path.exists(os.path.join(tmp, "dnp")))


def test_cli_writes_dist_checkpoint(tmp_path):
    rc, strategy, keys, refused_rc, refused_exists = run_on_ranks(_cli_case, 1,
                                                                  str(tmp_path))[0]
    assert rc == 0 and strategy == "shared+or"
    assert keys == ["decoder.final_layernorm.magnitude"]
    assert refused_rc == 2 and not refused_exists
