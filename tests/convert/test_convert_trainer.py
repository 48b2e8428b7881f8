"""The trainer and the converter agree on every file the other writes: a trained run converts
and round-trips exactly, a trained MoE ``unified`` exports to Hugging Face, ``--pretrained``
loads a full checkpoint at EP2 / TP2, a checkpoint of another model is refused, and fine-tuning
loads weights only. Every case runs in forked gloo ranks (run_on_ranks)."""

import functools
import os

import pytest

from scalevec_testing import run_on_ranks
from scalevec_testing.trainer_flags import run_convert, run_converter_cli, run_trainer

TOL = 1e-5
HF_TOL = 1e-4
MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2)


def _arch(**kw):
    from megatron_scalevec.convert.arch import ModelArch

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=64, max_sequence_length=32)
    base.update(kw)
    return ModelArch(**base)

TRAIN = ["--spec", "scalevec_dense", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--log-interval", "1", "--eval-interval", "0", "--quiet", "--no-plot",
         "--lr-warmup-iters", "0"]
FROZEN = ["--lr", "1e-30", "--min-lr", "1e-31"]  # updates below fp32 resolution: weights kept


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, small_corpus, spm_model):
    """The SentencePiece model and an indexed dataset made from a small slice of the corpus
    (tests/conftest.py)."""
    from megatron_scalevec.training.preprocess import preprocess

    cache = str(tmp_path_factory.mktemp("data"))
    preprocess([small_corpus], os.path.join(cache, "c"), spm_model, progress=False)
    return os.path.join(cache, "c_text_document"), spm_model


def _cli_json(rank, world, argv):
    import json

    rc, out = run_converter_cli(rank, world, argv)
    return rc, json.loads(out) if rc == 0 else None


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
    run_on_ranks(run_trainer, 1, TRAIN + data + ["--scalevec", "shared", "--train-iters", "3",
                                                 "--save", j("ck1"), "--run-dir", j("r1")])
    assert sorted(f for f in os.listdir(j("ck1", "iter_0000003")) if not f.endswith(
        ("distcp", ".pt", "metadata"))) == ["metadata.json", "scalevec_arch.json",
                                            "scalevec_manifest.json", "tokenizer.model"]
    # the trainer's save dir and one iter_N, as they are
    stock = run_on_ranks(run_convert, 1, j("ck1", "iter_0000003"), j("stock"), "stock")[0]
    assert stock["max_logit_diff"] < TOL
    warm = run_on_ranks(run_convert, 1, j("ck1"), j("ws"), "unified",
                        allow_function_change=True)[0]
    assert warm["target"] == "hg+dnp+or+iwd" and os.path.isfile(j("ws", "tokenizer.model"))
    # weights only, at another layout: the trainer's TP=2 checkpoint equals the converter's
    run_on_ranks(run_trainer, 2, TRAIN + data + FROZEN + [
        "--train-iters", "2", "--tensor-model-parallel-size", "2", "--pretrained-checkpoint",
        j("ws"), "--load", j("ck2"), "--save", j("ck2"), "--run-dir", j("r2")])
    assert open(j("ck2", "latest")).read().strip() == "2"  # iteration reset to 0, +2
    (ws_sd, _), (ck2_sd, strategy) = (run_on_ranks(_read, 1, j(p))[0] for p in ("ws", "ck2"))
    assert strategy == "hg+dnp+or+iwd" and _max_diff(ws_sd, ck2_sd) == 0.0
    # continue training from the warm start, then export the trained unified model
    losses = run_on_ranks(run_trainer, 1, TRAIN + data + [
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
    run_on_ranks(run_trainer, 1, TRAIN[2:] + moe + [
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
        run_on_ranks(run_trainer, 2, MOCK + MOE_RUN + FROZEN + layout + [
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
    assert "--scalevec unified to train its strategy" in strategy  # DNP: no conversion offered
    assert "converts to no other strategy" in strategy and "--to hg+dp" not in strategy
    width = run_on_ranks(_refused, 1, base + ["--moe-ffn-hidden-size", "32"])[0]
    assert "moe_ffn_hidden_size: 24 != 32" in width, width


def test_finetune_loads_weights_only(tmp_path):
    """--finetune: weights from --load, iteration 0 (two more steps are trained, not zero),
    the weights arrive unchanged (frozen run)."""
    dense = MOCK + ["--spec", "scalevec_dense", "--train-iters"]
    ck, ft = str(tmp_path / "ck"), str(tmp_path / "ft")
    run_on_ranks(run_trainer, 1, dense + ["2", "--save", ck, "--run-dir", ck + "_r"])
    losses = run_on_ranks(run_trainer, 1, dense + ["2", "--finetune", "--load", ck, "--save", ft,
                                                   "--run-dir", ft + "_r"] + FROZEN)[0]
    assert len(losses) == 2 and open(os.path.join(ft, "latest")).read().strip() == "2"
    (a, _), (b, _) = (run_on_ranks(_read, 1, p)[0] for p in (ck, ft))
    assert _max_diff(a, b) == 0.0
