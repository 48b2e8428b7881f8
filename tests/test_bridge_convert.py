"""Our Megatron-Bridge bridges (megatron_scalevec/convert/bridge.py): stock Hugging Face
checkpoints (tiny, built here with transformers configs) warm-start into a strategy through
``AutoBridge`` + a provider with our spec, exactly where SPEC says so (shared, HG, DP, OR, ER)
and refused where the function changes (DNP, ``none`` over Q/K norms) unless asked; the model
exports back through Bridge (a stock family where it fits, our ``modeling_scalevec`` where it
does not, MoE with DNP included), and the export computes our logits (fp32 < 1e-5).

Each case runs on one gloo rank (conversion is TP=PP=EP=1, as in our converter); Bridge is
imported once here and inherited by the forked rank.
"""

import os

import pytest
import torch

from megatron_scalevec.testing import bridge_shim
from megatron_scalevec.testing.distributed import run_on_ranks

bridge_shim.bridge_or_skip()
import megatron_scalevec.convert.bridge as svb  # noqa: E402 -- after Bridge (shim)

TOL = 1e-5
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=48, vocab_size=64, max_sequence_length=32)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24)
FAMILIES = {
    "llama": dict(BASE),
    "qwen3": dict(BASE, qk_layernorm=True),
    "mixtral": dict(BASE, **MOE),
    "qwen3_moe": dict(BASE, qk_layernorm=True, **MOE),
}


def _make_hf(family: str, path: str) -> str:
    """A stock HF checkpoint with random weights and norm gammas away from 1 (> 0 for ER)."""
    import transformers

    from megatron_scalevec.convert.arch import ModelArch
    from megatron_scalevec.convert.hf import hf_config

    torch.manual_seed(5)
    config = hf_config(ModelArch(**FAMILIES[family]))
    config.dtype = torch.float32
    model = getattr(transformers, config.architectures[0])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.rand_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _make_hf(family, str(tmp_path_factory.mktemp(family)))
        return cache[family]

    return get


def _cpu(provider):
    for k, v in dict(transformer_impl="local", bias_activation_fusion=False,
                     bias_dropout_fusion=False, apply_rope_fusion=False,
                     masked_softmax_fusion=False, persist_layer_norm=False,
                     gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
                     moe_grouped_gemm=False, moe_permute_fusion=False, bf16=False, fp16=False,
                     params_dtype=torch.float32, autocast_dtype=None,
                     moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0).items():
        setattr(provider, k, v)
    provider.finalize()
    return provider


def _logits(model, tokens):
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    model.eval()
    with torch.no_grad():
        return model(tokens, pos, None).float()


def _hf_logits(path, tokens, remote=False):
    from megatron_scalevec.convert.hf_remote import load_exported

    with torch.no_grad():
        return load_exported(path, torch.float32, remote)(input_ids=tokens).logits.float()


def _convert(rank, world, hf_dir, strategy, allow, out_dir):
    from megatron.bridge import AutoBridge
    from safetensors.torch import load_file

    from megatron_scalevec.testing.distributed import init_model_parallel

    init_model_parallel()
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = _cpu(svb.scalevec_provider(bridge, strategy, allow_function_change=allow))
    try:
        [model] = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
    except ValueError as e:  # FunctionChangeError is a ValueError
        return {"refused": f"{type(e).__name__}: {e}"}
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = _logits(model, tokens)
    name = svb.save_hf(model, out_dir)
    remote = name == svb.hf_remote.REMOTE_ARCH
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(out_dir, "model.safetensors"))
    return dict(
        strategy=svb.model_strategy(model).to_string(), architecture=name,
        vectors=sum(hasattr(p, "scalevec_part") for p in model.parameters()),
        vs_source=float((ours - _hf_logits(hf_dir, tokens)).abs().max()),
        export_vs_ours=float((_hf_logits(out_dir, tokens, remote) - ours).abs().max()),
        same_tensors=sorted(original) == sorted(exported) and all(
            torch.equal(original[k], exported[k]) for k in original))


def convert(hf_dirs, tmp_path, family, strategy, allow=False):
    r = run_on_ranks(_convert, 1, hf_dirs(family), strategy, allow,
                     str(tmp_path / "export"), timeout=300)[0]
    print(family, strategy, r)
    return r


STOCK_NAME = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
EXACT = [("llama", "shared"), ("llama", "hg+dp+or"), ("qwen3", "hg+er"),
         ("mixtral", "hg+dp"), ("qwen3_moe", "hg+dp+er"), ("qwen3_moe", "shared+or")]


@pytest.mark.parametrize("family,strategy", EXACT)
def test_exact_warm_start_and_stock_export(hf_dirs, tmp_path, family, strategy):
    r = convert(hf_dirs, tmp_path, family, strategy)
    assert "refused" not in r, r
    assert r["vectors"] > 0
    assert r["vs_source"] < TOL, r  # exact at conversion time
    assert r["architecture"] == STOCK_NAME[family]  # folded into the stock architecture
    assert r["export_vs_ours"] < TOL, r
    if strategy == "shared":  # HF -> ours -> HF: the very tensors
        assert r["same_tensors"], r


@pytest.mark.parametrize("family,strategy", [("llama", "unified"), ("qwen3_moe", "hg+dnp"),
                                             ("qwen3", "none")])
def test_function_changes_are_refused_unless_asked(hf_dirs, tmp_path, family, strategy):
    r = convert(hf_dirs, tmp_path, family, strategy)
    assert "FunctionChangeError" in r.get("refused", ""), r
    assert "allow_function_change" in r["refused"]


@pytest.mark.parametrize("family,strategy", [("llama", "unified"), ("qwen3_moe", "unified"),
                                             ("mixtral", "hg+dnp+er")])
def test_dnp_exports_with_our_modeling_file(hf_dirs, tmp_path, family, strategy):
    r = convert(hf_dirs, tmp_path, family, strategy, allow=True)
    assert r["architecture"] == svb.hf_remote.REMOTE_ARCH, r
    assert r["export_vs_ours"] < TOL, r
    assert r["vs_source"] > 1e-3  # the function did change (DNP added norms): not vacuous
