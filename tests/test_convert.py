"""Checkpoint conversion (tools/convert_checkpoint.py): warm start, exact fold, Hugging Face,
refusals, layouts.

Every case runs in a forked one-rank (or two-rank) gloo child (run_on_ranks), so this file
never leaves a process group in the pytest parent. Tolerances: fp32 logits of tiny models.
"""

import functools
import importlib.util
import os

import pytest

from scalevec_testing import run_on_ranks

TOL = 1e-5
HF_TOL = 1e-4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


# ---- trainer <-> converter round trip: what one writes the other reads ------------------

TRAIN = ["--spec", "scalevec_dense", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--log-interval", "1", "--eval-interval", "0", "--quiet", "--no-plot",
         "--lr-warmup-iters", "0"]
FROZEN = ["--lr", "1e-30", "--min-lr", "1e-31"]  # updates below fp32 resolution: weights kept


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A SentencePiece model and an indexed dataset made from a small slice of the corpus."""
    from megatron_scalevec.training import data
    from megatron_scalevec.training.preprocess import preprocess

    cache = str(tmp_path_factory.mktemp("data"))
    corpus = data.embedded_corpus(cache, max_bytes=200_000, chunk_bytes=4096)
    tok = data.train_tokenizer(corpus, os.path.join(cache, "spm"), vocab_size=600)
    preprocess([corpus], os.path.join(cache, "c"), tok, progress=False)
    return os.path.join(cache, "c_text_document"), tok


def _train(rank, world, argv):
    from megatron_scalevec.training.trainer import main

    return main(argv)


def _convert(rank, world, *args, **kw):
    from megatron_scalevec.convert.api import convert

    return convert(*args, **kw)


def _cli_json(rank, world, argv):
    import contextlib
    import importlib.util as iu
    import io
    import json

    spec = iu.spec_from_file_location("cc", os.path.join(ROOT, "tools", "convert_checkpoint.py"))
    cli = iu.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    return rc, json.loads(out.getvalue()) if rc == 0 else None


def _read(rank, world, path):
    from megatron_scalevec.convert.api import read_checkpoint

    sd, arch = read_checkpoint(path)
    return sd, arch.scalevec


def _max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_trainer_converter_round_trip(tmp_path, tiny_data):
    """train shared -> converter reads the save dir as is (no --arch) -> warm start to unified
    -> the trainer starts from it (--pretrained-checkpoint; at TP=2 its weights arrive
    unchanged, iteration and optimizer fresh) -> continue training -> HF export (our modeling
    file) -> the export loads back with matching logits and the tokenizer."""
    prefix, tok = tiny_data
    data = ["--data-path", prefix, "--tokenizer-model", tok]
    t = str(tmp_path)
    j = functools.partial(os.path.join, t)
    run_on_ranks(_train, 1, TRAIN + data + ["--scalevec", "shared", "--train-iters", "3",
                                            "--save", j("ck1"), "--run-dir", j("r1")])
    assert sorted(f for f in os.listdir(j("ck1", "iter_0000003")) if not f.endswith(
        ("distcp", ".pt", "metadata"))) == ["metadata.json", "scalevec_arch.json",
                                            "scalevec_manifest.json", "tokenizer.model"]
    # the trainer's save dir and one iter_N, as they are
    stock = run_on_ranks(_convert, 1, j("ck1", "iter_0000003"), j("stock"), "stock")[0]
    assert stock["max_logit_diff"] < TOL
    warm = run_on_ranks(_convert, 1, j("ck1"), j("ws"), "unified",
                        allow_function_change=True)[0]
    assert warm["target"] == "hg+dnp+or+iwd" and os.path.isfile(j("ws", "tokenizer.model"))
    # weights only, at another layout: the trainer's TP=2 checkpoint equals the converter's
    run_on_ranks(_train, 2, TRAIN + data + FROZEN + [
        "--train-iters", "2", "--tensor-model-parallel-size", "2", "--pretrained-checkpoint",
        j("ws"), "--load", j("ck2"), "--save", j("ck2"), "--run-dir", j("r2")])
    assert open(j("ck2", "latest")).read().strip() == "2"  # iteration reset to 0, +2
    (ws_sd, _), (ck2_sd, strategy) = (run_on_ranks(_read, 1, j(p))[0] for p in ("ws", "ck2"))
    assert strategy == "hg+dnp+or+iwd" and _max_diff(ws_sd, ck2_sd) == 0.0
    # continue training from the warm start, then export the trained unified model
    losses = run_on_ranks(_train, 1, TRAIN + data + [
        "--train-iters", "4", "--pretrained-checkpoint", j("ws"), "--save", j("ck3"),
        "--run-dir", j("r3")])[0]
    assert len(losses) == 4
    rc, hf = run_on_ranks(_cli_json, 1, ["--load", j("ck3"), "--to", "hf", "--save",
                                         j("hf")])[0]
    assert rc == 0
    assert hf["architecture"] == "ScaleVecQwen3ForCausalLM" and hf["remote_code"]
    assert hf["tokenizer"] and hf["max_logit_diff"] < HF_TOL, hf


def _export_vs_megatron(rank, world, ck, out):
    """Max |logits| gap between the HF export (float32) and megatron's forward of ``ck``, the
    logit scale, and how many tokens generate() adds to a prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_scalevec.convert.api import read_checkpoint
    from megatron_scalevec.convert.build import build_model, logits, sample_batch
    from megatron_scalevec.convert.io import load_full_into

    sd, arch = read_checkpoint(ck)
    model = build_model(arch)
    load_full_into(model, sd, "trained")
    tokens, pos = sample_batch(arch)
    ref = logits(model, tokens, pos)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                              trust_remote_code=True).eval()
    with torch.no_grad():
        diff = float((hf(input_ids=tokens).logits.float() - ref).abs().max())
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("def main():\n", return_tensors="pt").input_ids
    new = hf.generate(ids, max_new_tokens=4, do_sample=False).shape[1] - ids.shape[1]
    return arch.is_moe, diff, float(ref.abs().max()), new


def test_trained_moe_unified_exports_to_hf(tmp_path, tiny_data):
    """A trained MoE ``unified`` checkpoint (per-expert DNP norms) -> converter --to hf as is
    -> our modeling file's logits equal megatron's; generate() works."""
    prefix, tok = tiny_data
    j = functools.partial(os.path.join, str(tmp_path))
    moe = ["--spec", "scalevec_moe", "--num-experts", "4", "--moe-ffn-hidden-size", "32"]
    run_on_ranks(_train, 1, TRAIN[2:] + moe + [
        "--data-path", prefix, "--tokenizer-model", tok, "--scalevec", "unified",
        "--train-iters", "3", "--save", j("ck"), "--run-dir", j("r")])
    rc, hf = run_on_ranks(_cli_json, 1, ["--load", j("ck"), "--to", "hf", "--save",
                                         j("hf")])[0]
    assert rc == 0 and hf["architecture"] == "ScaleVecQwen3ForCausalLM" and hf["tokenizer"]
    is_moe, diff, scale, new = run_on_ranks(_export_vs_megatron, 1, j("ck"), j("hf"))[0]
    assert is_moe and diff < 1e-5 * scale and hf["max_logit_diff"] < 1e-5 * scale, (diff, hf)
    assert new == 4


MOCK = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--eval-interval", "0", "--quiet", "--no-plot", "--lr-warmup-iters", "0"]
MOE_RUN = ["--spec", "scalevec_moe", "--num-experts", "4", "--moe-ffn-hidden-size", "24",
           "--train-iters", "1"]


def _write_moe_source(rank, world, path):
    from megatron_scalevec.convert.build import build_model
    from megatron_scalevec.convert.io import full_state_dict, save_full
    from scalevec_testing.models import perturb_vectors

    arch = _arch(scalevec="unified", tie_embeddings=True, **MOE)
    model = build_model(arch, seed=7)
    perturb_vectors(model, 0.3)
    sd = full_state_dict(model)
    save_full(sd, arch, path, show_progress=False)
    return sd


def test_pretrained_full_checkpoint_loads_at_ep2_tp2(tmp_path):
    """Converter full format (whole tensors) -> trainer at EP=2 and at TP=2+SP: every expert
    and every TP shard lands where it belongs (frozen run, then read back exactly)."""
    src = run_on_ranks(_write_moe_source, 1, str(tmp_path / "src"))[0]
    for name, layout in (("ep2", ["--expert-model-parallel-size", "2"]),
                         ("tp2", ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                         ("bf16", ["--bf16", "--use-distributed-optimizer"])):
        out = str(tmp_path / name)
        run_on_ranks(_train, 2, MOCK + MOE_RUN + FROZEN + layout + [
            "--moe-aux-loss-coeff", "0", "--pretrained-checkpoint", str(tmp_path / "src"),
            "--save", out, "--run-dir", out + "_run"])
        sd, _ = run_on_ranks(_read, 1, out)[0]
        if name == "bf16":  # bf16 weights: the source rounded (the fp32 main copies follow)
            sd = {k: v.float() for k, v in sd.items()}
            src_bf16 = {k: v.bfloat16().float() for k, v in src.items()}
            assert _max_diff(src_bf16, sd) == 0.0, name
            continue
        assert _max_diff(src, sd) == 0.0, name


def _refused(rank, world, argv):
    from megatron_scalevec.training.pretrained import PretrainedError
    from megatron_scalevec.training.trainer import main

    try:
        main(argv)
    except PretrainedError as e:
        return str(e)
    return None


def test_pretrained_of_another_model_is_refused(tmp_path):
    run_on_ranks(_write_moe_source, 1, str(tmp_path / "src"))
    base = MOCK + MOE_RUN + ["--pretrained-checkpoint", str(tmp_path / "src"),
                             "--run-dir", str(tmp_path / "r"), "--overwrite"]
    strategy = run_on_ranks(_refused, 1, base + ["--scalevec", "hg+dp"])[0]
    assert "holds strategy 'unified', this run trains 'hg+dp'" in strategy
    assert "--to hg+dp" in strategy
    width = run_on_ranks(_refused, 1, base + ["--moe-ffn-hidden-size", "32"])[0]
    assert "moe_ffn_hidden_size: 24 != 32" in width, width


def test_finetune_loads_weights_only(tmp_path):
    """--finetune: weights from --load, iteration 0 (two more steps are trained, not zero),
    the weights arrive unchanged (frozen run)."""
    dense = MOCK + ["--spec", "scalevec_dense", "--train-iters"]
    ck, ft = str(tmp_path / "ck"), str(tmp_path / "ft")
    run_on_ranks(_train, 1, dense + ["2", "--save", ck, "--run-dir", ck + "_r"])
    losses = run_on_ranks(_train, 1, dense + ["2", "--finetune", "--load", ck, "--save", ft,
                                              "--run-dir", ft + "_r"] + FROZEN)[0]
    assert len(losses) == 2 and open(os.path.join(ft, "latest")).read().strip() == "2"
    (a, _), (b, _) = (run_on_ranks(_read, 1, p)[0] for p in (ck, ft))
    assert _max_diff(a, b) == 0.0
