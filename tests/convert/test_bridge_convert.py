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

from scalevec_testing import bridge_shim
from scalevec_testing.distributed import run_on_ranks

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


def _convert(rank, world, hf_dir, strategy, allow, out_dir, tp=1):
    from megatron.bridge import AutoBridge
    from safetensors.torch import load_file

    from scalevec_testing.distributed import init_model_parallel

    init_model_parallel(tp=tp)
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = svb.scalevec_provider(bridge, strategy, allow_function_change=allow)
    provider.tensor_model_parallel_size = tp
    provider = _cpu(provider)
    try:
        [model] = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
    except ValueError as e:  # FunctionChangeError is a ValueError
        return {"refused": f"{type(e).__name__}: {e}"}
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    vs_source = float((_logits(model, tokens) - _hf_logits(hf_dir, tokens)).abs().max())
    if strategy != "shared":  # as if trained: every vector moved (DNP gammas start at 1)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in model.parameters():
                if hasattr(p, "scalevec_part"):
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
    ours = _logits(model, tokens)
    name = svb.save_hf(model, out_dir)
    remote = name == svb.hf_remote.REMOTE_ARCH
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(out_dir, "model.safetensors"))
    return dict(
        strategy=svb.model_strategy(model).to_string(), architecture=name,
        vectors=sum(hasattr(p, "scalevec_part") for p in model.parameters()),
        vs_source=vs_source,
        export_vs_ours=float((_hf_logits(out_dir, tokens, remote) - ours).abs().max()),
        same_tensors=sorted(original) == sorted(exported) and all(
            torch.equal(original[k], exported[k]) for k in original))


def convert(hf_dirs, tmp_path, family, strategy, allow=False):
    return run_on_ranks(_convert, 1, hf_dirs(family), strategy, allow,
                        str(tmp_path / "export"), timeout=300)[0]


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


def _with_extra_tensor(hf_dir, path):
    """A copy of a HF checkpoint with one tensor nobody maps."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.ones(3)
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def test_an_unmapped_tensor_fails_naming_it(hf_dirs, tmp_path):
    bad = _with_extra_tensor(hf_dirs("llama"), str(tmp_path / "bad"))
    r = run_on_ranks(_convert, 1, bad, "hg+dp", False, str(tmp_path / "export"), timeout=300)[0]
    assert "model.layers.0.self_attn.mystery.weight" in r.get("refused", ""), r


def _stock_spec(rank, world, hf_dir):
    """A stock-spec provider through our registered bridge: Bridge's own mappings, unchanged."""
    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from safetensors.torch import load_file

    from scalevec_testing.distributed import init_model_parallel

    init_model_parallel()
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    assert isinstance(bridge._model_bridge, svb.ScaleVecLlamaBridge)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.transformer_layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    [model] = _cpu(provider).provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    diff = float((_logits(model, tokens) - _hf_logits(hf_dir, tokens)).abs().max())
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = dict(bridge.export_hf_weights([model], cpu=True, show_progress=False))
    same = sorted(original) == sorted(exported) and all(
        torch.equal(original[k], exported[k]) for k in original)
    return svb.model_strategy(model), diff, same


def test_stock_spec_models_keep_bridges_own_path(hf_dirs):
    strategy, diff, same = run_on_ranks(_stock_spec, 1, hf_dirs("llama"), timeout=300)[0]
    assert strategy is None and diff < TOL and same


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_our_table_and_bridges_stock_tables_agree(family):
    """Our converter's stock <-> HF names (convert/hf.py) equal what Bridge's own bridge maps,
    layer and expert by layer and expert: the stock path and ours cannot disagree on names."""
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge
    from megatron.bridge.models.qwen.qwen3_bridge import Qwen3Bridge
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    from megatron_scalevec.convert import hf as H
    from megatron_scalevec.convert.arch import ModelArch

    registry = {"llama": LlamaBridge, "qwen3": Qwen3Bridge,
                "qwen3_moe": Qwen3MoEBridge}[family]().mapping_registry()
    arch = ModelArch(**FAMILIES[family])
    ours = {k: v for k, v in H._GLOBAL_MAP}
    for i in range(arch.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        ours.update({p + a: q + b for a, b in H._LAYER_MAP
                     if arch.qk_layernorm or "_layernorm" not in a.split(".")[1]})
        ours[p + "self_attention.linear_qkv.weight"] = {
            b: f"{q}self_attn.{b}_proj.weight" for b in "qkv"}
        for fc1, fc2, gate, up, down, _ in H._mlp_pairs(arch, i):
            ours[fc1], ours[fc2] = {"gate": gate, "up": up}, down
        if H._router_pair(arch, i):
            ours.update([H._router_pair(arch, i)])
    for megatron, hf in ours.items():
        mapping = registry.megatron_to_hf_lookup(megatron)
        assert mapping is not None, f"Bridge maps no {megatron}"
        assert mapping.hf_param == hf, (megatron, mapping.hf_param, hf)


def test_conversion_at_another_layout_is_refused_in_one_line(hf_dirs, tmp_path):
    rs = run_on_ranks(_convert, 2, hf_dirs("llama"), "hg", False, str(tmp_path / "x"), tp=2,
                      timeout=300)
    for r in rs:
        assert "runs at TP=PP=EP=1 (here TP, PP, EP = (2, 1, 1))" in r.get("refused", ""), r


def test_without_our_bridges_imported_scalevec_provider_refuses():
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    class Plain:  # an AutoBridge whose dispatch found Bridge's own bridge
        _model_bridge = LlamaBridge()

    with pytest.raises(ValueError, match="import megatron_scalevec.convert.bridge"):
        svb.scalevec_provider(Plain(), "hg")
