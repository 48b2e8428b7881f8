"""One mapping between a megatron-core TransformerConfig and our ModelArch:
``ModelArch.config_kwargs`` / ``model_kwargs`` / ``from_config`` against expectations written
out field by field, dense and MoE (every MoE field off its default, so dropping one fails),
and the three users: our converter's config, the trainer's flags, a Bridge provider."""

import types

import pytest
import torch.nn.functional as F

from megatron_scalevec.convert.arch import ModelArch

GPT = dict(vocab_size=96, max_sequence_length=64, rotary_base=500000.0, tie_embeddings=False)
DENSE = ModelArch(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  kv_channels=24, ffn_hidden_size=160, normalization="LayerNorm",
                  layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=False,
                  activation="gelu", scalevec="hg+dp+or", **GPT)
MOE = ModelArch(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                num_moe_experts=6, moe_router_topk=3, moe_ffn_hidden_size=48,
                moe_shared_expert_intermediate_size=32, moe_router_pre_softmax=True,
                moe_layer_freq=[1, 0, 1, 1], expert_vectors="shared", scalevec="unified", **GPT)
DENSE_CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    kv_channels=24, ffn_hidden_size=160, normalization="LayerNorm",
                    layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=False,
                    activation_func=F.gelu, add_bias_linear=False, add_qkv_bias=False)
MOE_CONFIG = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                  kv_channels=16, ffn_hidden_size=128, normalization="RMSNorm",
                  layernorm_epsilon=1e-5, qk_layernorm=False, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
                  num_moe_experts=6, moe_router_topk=3, moe_ffn_hidden_size=48,
                  moe_shared_expert_intermediate_size=32, moe_router_pre_softmax=True,
                  moe_layer_freq=[1, 0, 1, 1])
MODEL = dict(vocab_size=96, max_sequence_length=64, position_embedding_type="rope",
             rotary_base=500000, share_embeddings_and_output_weights=False)


def _model_fields(arch):
    return dict(GPT, scalevec=arch.scalevec, expert_vectors=arch.expert_vectors)


@pytest.mark.parametrize("arch,expected", [(DENSE, DENSE_CONFIG), (MOE, MOE_CONFIG)],
                         ids=["dense", "moe"])
def test_config_round_trip(arch, expected):
    from megatron.core.transformer.transformer_config import TransformerConfig

    assert arch.config_kwargs() == expected
    assert arch.model_kwargs() == MODEL
    config = TransformerConfig(**expected, use_cpu_initialization=True)
    assert ModelArch.from_config(config, **_model_fields(arch)) == arch


def test_unmapped_activation_refused():
    config = types.SimpleNamespace(**dict(DENSE_CONFIG, activation_func=F.relu))
    with pytest.raises(ValueError, match="has no Hugging Face equivalent here"):
        ModelArch.from_config(config, **GPT)


def test_trainer_flags_build_the_arch_they_record(tmp_path):
    from megatron_scalevec.training import build
    from megatron_scalevec.training.arguments import parse_args

    a = parse_args(["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
                    "--num-experts", "6", "--moe-router-topk", "3", "--moe-ffn-hidden-size",
                    "48", "--moe-router-pre-softmax", "--moe-layer-freq", "2",
                    "--norm-epsilon", "1e-6", "--rotary-base", "500000",
                    "--scalevec", "hg+dnp+or+iwd", "--run-dir", str(tmp_path)])
    arch = build.run_arch(a, 96)
    assert arch == MOE.replace(moe_shared_expert_intermediate_size=None, moe_layer_freq=2,
                               layernorm_epsilon=1e-6, tie_embeddings=True,
                               expert_vectors="per_expert", max_sequence_length=128,
                               scalevec="hg+dnp+or+iwd")
    config = build.transformer_config(a, 96)
    assert {k: getattr(config, k) for k in arch.config_kwargs()} == arch.config_kwargs()


def test_bridge_provider_takes_the_arch():
    from scalevec_testing import bridge_shim

    bridge_shim.bridge_or_skip()
    from megatron_scalevec.convert import bridge as svb

    provider = svb.apply_arch(types.SimpleNamespace(), MOE)
    assert {k: getattr(provider, k) for k in MOE_CONFIG} == MOE_CONFIG
    assert (provider.vocab_size, provider.seq_length, provider.rotary_base,
            provider.share_embeddings_and_output_weights) == (96, 64, 500000, False)
    assert ModelArch.from_config(provider, **_model_fields(MOE)) == MOE
