"""Hugging Face export of every strategy: DNP strategies (dense and MoE) and
MoE layouts without a stock family through our own trust_remote_code modeling file, the
tokenizer shipped, normal permissions, and the reported difference measured on the export
loaded back. Forked one-rank gloo children."""

import importlib.util
import os
import stat

import pytest

from scalevec_testing import run_on_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers (test extra) not installed")
FP32_TOL = 1e-4
BF16_TOL = 0.1  # bf16 weights and activations against float32 logits of O(1)
# MoE: relative to the largest |logit| of the source. bf16 is loose: a token whose top-k
# experts are near a tie can be routed differently in bf16 than in float32.
MOE_FP32_REL = 1e-5
MOE_BF16_REL = 0.1
MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=24)


def _arch(**kw):
    from megatron_scalevec.convert.arch import ModelArch

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=600, max_sequence_length=32,
                layernorm_epsilon=1e-6, rotary_base=5000.0)
    base.update(kw)
    return ModelArch(**base)


def _convert_cli(src, out, dtype_name, tokenizer):
    import contextlib
    import importlib.util as iu
    import io
    import json

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    spec = iu.spec_from_file_location("cc", os.path.join(root, "tools", "convert_checkpoint.py"))
    cli = iu.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--load", src, "--to", "hf", "--save", out,
            "--dtype", {"float32": "fp32", "bfloat16": "bf16"}[dtype_name]]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(argv + (["--tokenizer-model", tokenizer] if tokenizer else [])) == 0
    return json.loads(printed.getvalue())


def _export_case(rank, world, tmp, strategy, dtype_name, tokenizer, extra, cli=False):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_scalevec.convert.api import convert
    from megatron_scalevec.convert.build import build_model, logits, sample_batch
    from megatron_scalevec.convert.io import full_state_dict, save_full
    from scalevec_testing.models import perturb_vectors

    dtype = getattr(torch, dtype_name)
    arch = _arch(scalevec=strategy, **extra)
    model = build_model(arch)
    perturb_vectors(model, 0.3)
    src, out = os.path.join(tmp, "src"), os.path.join(tmp, "hf")
    save_full(full_state_dict(model), arch, src, show_progress=False)
    old = os.umask(0o022)
    try:
        report = _convert_cli(src, out, dtype_name, tokenizer) if cli else \
            convert(src, out, "hf", dtype=dtype, tokenizer=tokenizer)
    finally:
        os.umask(old)
    tokens, pos = sample_batch(arch)
    ref = logits(model, tokens, pos)
    hf, info = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, trust_remote_code=True,
                                                    output_loading_info=True)
    hf.eval()
    with torch.no_grad():
        diff = float((hf(input_ids=tokens).logits.float() - ref).abs().max())
    result = dict(report=report, diff=diff, cls=type(hf).__name__,
                  scale=float(ref.abs().max()), config=hf.config.to_dict(),
                  loading={k: sorted(map(str, v)) for k, v in info.items() if v},
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
        # The README's ways of loading without running our code: the tokenizer is a plain one
        import sentencepiece
        from transformers import PreTrainedTokenizerFast

        sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
        text = "def main():\n    return {'a': 1}\n"
        result["plain_ids_match"] = all(
            list(t(text, add_special_tokens=False).input_ids) == sp.encode(text) for t in (
                PreTrainedTokenizerFast.from_pretrained(out),
                AutoTokenizer.from_pretrained(out, trust_remote_code=False)))
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
    assert r["plain_ids_match"]


def test_stock_strategy_still_exports_as_llama(tmp_path):
    r = run_on_ranks(_export_case, 1, str(tmp_path), "hg+dp+or", "float32", None, {})[0]
    assert r["report"]["architecture"] == r["cls"] == "LlamaForCausalLM"
    assert not r["report"]["remote_code"] and r["diff"] < FP32_TOL


# strategy, dtype, arch changes, through the CLI
MOE_CASES = {
    "unified_fp32": ("unified", "float32", MOE, True),
    "unified_bf16": ("unified", "bfloat16", MOE, False),
    # one norm set for all experts, a shared expert, a dense first layer, pre-softmax routing
    "hg_dnp_shared_vectors": ("hg+dnp", "float32", dict(
        MOE, expert_vectors="shared", moe_shared_expert_intermediate_size=16,
        moe_layer_freq=[0, 1], moe_router_pre_softmax=True), False),
    # no DNP, but a shared expert: no stock family (Mixtral / Qwen3-MoE have none), no QK norm
    "hg_dp_or_shared_expert": ("hg+dp+or", "float32",
                               dict(MOE, moe_shared_expert_intermediate_size=16), False),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_exports_with_our_modeling_file(tmp_path, spm_model, case):
    strategy, dtype, extra, cli = MOE_CASES[case]
    r = run_on_ranks(_export_case, 1, str(tmp_path), strategy, dtype, spm_model, extra, cli)[0]
    rep, cfg = r["report"], r["config"]
    assert rep["architecture"] == r["cls"] == "ScaleVecQwen3ForCausalLM" and rep["remote_code"]
    dnp = strategy != "hg+dp+or"
    assert rep["dnp_branches"] == (["v", "gate", "up"] if dnp else [])
    assert not r["loading"], r["loading"]  # every tensor of the file used, none missing
    pattern = [1 if i % extra.get("moe_layer_freq", 1) == 0 else 0 for i in range(2)] \
        if isinstance(extra.get("moe_layer_freq", 1), int) else extra["moe_layer_freq"]
    assert cfg["scalevec_moe_layers"] == pattern and cfg["num_experts"] == 4
    assert cfg["norm_topk_prob"] == (not extra.get("moe_router_pre_softmax", False))
    assert cfg["scalevec_qk_norm"] == dnp
    tol = (MOE_FP32_REL if dtype == "float32" else MOE_BF16_REL) * r["scale"]
    assert r["diff"] < tol and abs(rep["max_logit_diff"] - r["diff"]) < 1e-6, (r, tol)
    assert {"config.json", "model.safetensors", "modeling_scalevec.py", "tokenizer.json",
            "tokenizer.model", "tokenizer_config.json"} <= set(r["files"])
    assert all(m == 0o644 for m in r["modes"].values()) and r["dir_mode"] == 0o755, r["modes"]
    assert r["prompt"] == "def main():\n" and r["new_tokens"] == 6


def test_unsupported_routing_is_refused_in_one_line():
    from types import SimpleNamespace

    from megatron_scalevec.convert.hf_remote import check_routing

    check_routing(SimpleNamespace(moe_router_score_function="softmax"))
    with pytest.raises(ValueError, match="moe_router_score_function.*sigmoid") as e:
        check_routing(SimpleNamespace(moe_router_score_function="sigmoid",
                                      moe_router_enable_expert_bias=False))
    assert "\n" not in str(e.value)
