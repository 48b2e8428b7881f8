"""Hugging Face export of every strategy (issue 11 item 9): DNP strategies through our own
trust_remote_code modeling file, the tokenizer shipped, normal permissions, and the reported
difference measured on the export loaded back. Forked one-rank gloo children."""

import importlib.util
import os
import stat

import pytest

from megatron_scalevec.testing import run_on_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers (test extra) not installed")
FP32_TOL = 1e-4
BF16_TOL = 0.1  # bf16 weights and activations against float32 logits of O(1)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    from megatron_scalevec.training import data

    cache = str(tmp_path_factory.mktemp("tok"))
    corpus = data.embedded_corpus(cache, max_bytes=200_000, chunk_bytes=4096)
    return data.train_tokenizer(corpus, os.path.join(cache, "spm"), vocab_size=600)


def _arch(**kw):
    from megatron_scalevec.convert.arch import ModelArch

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=600, max_sequence_length=32,
                layernorm_epsilon=1e-6, rotary_base=5000.0)
    base.update(kw)
    return ModelArch(**base)


def _export_case(rank, world, tmp, strategy, dtype_name, tokenizer, extra):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_scalevec.convert.api import convert
    from megatron_scalevec.convert.arch import build_model, logits, sample_batch
    from megatron_scalevec.convert.io import full_state_dict, save_full
    from megatron_scalevec.testing.models import perturb_vectors

    dtype = getattr(torch, dtype_name)
    arch = _arch(scalevec=strategy, **extra)
    model = build_model(arch)
    perturb_vectors(model, 0.3)
    src, out = os.path.join(tmp, "src"), os.path.join(tmp, "hf")
    save_full(full_state_dict(model), arch, src, show_progress=False)
    old = os.umask(0o022)
    try:
        report = convert(src, out, "hf", dtype=dtype, tokenizer=tokenizer)
    finally:
        os.umask(old)
    tokens, pos = sample_batch(arch)
    ref = logits(model, tokens, pos)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, trust_remote_code=True).eval()
    with torch.no_grad():
        diff = float((hf(input_ids=tokens).logits.float() - ref).abs().max())
    result = dict(report=report, diff=diff, cls=type(hf).__name__,
                  files=sorted(os.listdir(out)),
                  modes={f: stat.S_IMODE(os.stat(os.path.join(out, f)).st_mode)
                         for f in os.listdir(out)},
                  dir_mode=stat.S_IMODE(os.stat(out).st_mode))
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
        ids = tok("def main():\n", return_tensors="pt").input_ids
        gen = hf.generate(ids, max_new_tokens=6, do_sample=False)
        result["generated"] = tok.decode(gen[0, ids.shape[1]:])
        result["new_tokens"] = gen.shape[1] - ids.shape[1]
        result["prompt"] = tok.decode(ids[0])
    return result


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unified_dense_exports_with_our_modeling_file(tmp_path, spm_model, dtype):
    r = run_on_ranks(_export_case, 1, str(tmp_path), "unified", dtype, spm_model, {})[0]
    rep = r["report"]
    assert rep["architecture"] == r["cls"] == "ScaleVecQwen3ForCausalLM" and rep["remote_code"]
    assert rep["dnp_branches"] == ["v", "gate", "up"] and rep["dtype"] == dtype
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    assert r["diff"] < tol and rep["max_logit_diff"] < tol, (r["diff"], rep)
    # the reported figure is the exported model's own (loaded back at the same dtype)
    assert abs(rep["max_logit_diff"] - r["diff"]) < 1e-6, (rep, r["diff"])
    assert {"config.json", "model.safetensors", "modeling_scalevec.py", "tokenizer.json",
            "tokenizer.model", "tokenizer_config.json"} <= set(r["files"])
    assert not any(f.startswith(".") for f in r["files"]), r["files"]
    assert all(m == 0o644 for m in r["modes"].values()), r["modes"]
    assert r["dir_mode"] == 0o755
    assert r["prompt"] == "def main():\n" and r["new_tokens"] == 6


def test_stock_strategy_still_exports_as_llama(tmp_path):
    r = run_on_ranks(_export_case, 1, str(tmp_path), "hg+dp+or", "float32", None, {})[0]
    assert r["report"]["architecture"] == r["cls"] == "LlamaForCausalLM"
    assert not r["report"]["remote_code"] and r["diff"] < FP32_TOL


def _moe_dnp_case(rank, world, tmp):
    from megatron_scalevec.convert.api import convert
    from megatron_scalevec.convert.arch import build_model
    from megatron_scalevec.convert.io import full_state_dict, save_full

    arch = _arch(scalevec="unified", num_moe_experts=4, moe_ffn_hidden_size=24)
    save_full(full_state_dict(build_model(arch)), arch, os.path.join(tmp, "src"),
              show_progress=False)
    try:
        convert(os.path.join(tmp, "src"), os.path.join(tmp, "hf"), "hf")
    except ValueError as e:
        return str(e), os.path.exists(os.path.join(tmp, "hf"))
    return None, True


def test_moe_with_dnp_is_refused_clearly(tmp_path):
    message, exists = run_on_ranks(_moe_dnp_case, 1, str(tmp_path))[0]
    assert message and "MoE model with DNP" in message and not exists
