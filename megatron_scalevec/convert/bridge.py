"""Megatron-Bridge bridges for scale-vector models (import this module explicitly).

``import megatron_scalevec.convert.bridge`` registers, with Bridge's ``AutoBridge`` dispatch,
bridges for the stock Hugging Face families our converter maps (``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``) and for our own
``modeling_scalevec`` architecture (``ScaleVecQwen3ForCausalLM``, auto_map). They replace
Bridge's stock Llama / Qwen3 / Qwen3-MoE bridges for the process; a model built with a stock
spec still goes through Bridge's own per-tensor mappings, unchanged.

For a model built with our spec (any strategy), the math is our converter's (one mapping, not
a second table): loading is ``hf.hf_to_stock`` then ``warmstart.warm_start`` (exact for shared,
HG, DP, OR, ER; DNP and ``none`` over Q/K norms refused unless ``allow_function_change``);
export is ``fold.fold_to_stock`` then ``hf_remote.hf_state`` (a stock family where one fits,
else our modeling file's names, DNP included). Every tensor is mapped or the conversion fails
naming it. Conversion runs at TP=PP=EP=1 (one rank, like the converter); save a dist
checkpoint there to train at any layout::

    import megatron_scalevec.convert.bridge as svb
    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = svb.scalevec_provider(bridge, "hg+dp+or")   # our spec, HF weights warm-started
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    hf = dict(svb.export_bridge(model).export_hf_weights(model))   # folded / auto_map

Private Bridge API touched (checked on megatron-bridge 0.3.1 and 0.6.2):
``AutoBridge._model_bridge`` (which bridge AutoBridge dispatched to).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from megatron.bridge import AutoBridge
from megatron.bridge.models.conversion.model_bridge import HFWeightTuple, MegatronModelBridge
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.bridge.models.llama.llama_bridge import LlamaBridge
from megatron.bridge.models.qwen.qwen3_bridge import Qwen3Bridge
from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from transformers import (
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.convert import hf as _hf
from megatron_scalevec.convert import hf_remote
from megatron_scalevec.convert.arch import ModelArch
from megatron_scalevec.convert.fold import fold_to_stock
from megatron_scalevec.convert.io import check_names_and_shapes, full_state_dict, load_full_into
from megatron_scalevec.convert.warmstart import warm_start
from megatron_scalevec.specs import scalevec_moe_spec

ALLOW_FLAG = "scalevec_allow_function_change"  # provider attribute read when loading
# the config fields a loaded model must share with the HF checkpoint's arch (else refused)
_CHECKED = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "ffn_hidden_size", "normalization", "qk_layernorm", "gated_linear_unit",
            "num_moe_experts", "moe_router_topk", "moe_router_pre_softmax")


def _unwrap(model):
    model = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(model, "module"):  # DDP, Float16Module
        model = model.module
    return model


def model_strategy(model) -> Optional[ScaleVecConfig]:
    """The strategy a GPTModel was built with (our spec), or None for a stock spec."""
    for module in _unwrap(model).modules():
        cfg = getattr(module, "scalevec", None)
        if isinstance(cfg, ScaleVecConfig):
            return cfg
    return None


def arch_of(model) -> ModelArch:
    """The :class:`ModelArch` of a scale-vector GPTModel (from its config)."""
    model = _unwrap(model)
    strategy = model_strategy(model)
    return ModelArch.from_config(
        model.config, vocab_size=model.vocab_size, max_sequence_length=model.max_sequence_length,
        rotary_base=float(model.rotary_base),
        tie_embeddings=model.share_embeddings_and_output_weights,
        scalevec=strategy.to_string() if strategy else "stock",
        expert_vectors=strategy.expert_vectors if strategy else "per_expert")


def _one_rank_layout(what: str) -> None:
    sizes = (parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_expert_model_parallel_world_size())
    if sizes != (1, 1, 1):
        raise ValueError(f"{what} of a scale-vector model runs at TP=PP=EP=1 (here TP, PP, EP = "
                         f"{sizes}); convert there and save a dist checkpoint, which loads at "
                         f"any layout")


def apply_arch(provider, arch: ModelArch):
    """Set a provider's architecture from our :class:`ModelArch` (our mapping's reading of the
    HF config, e.g. Qwen3-MoE ``norm_topk_prob=False`` -> ``moe_router_pre_softmax``)."""
    model = arch.model_kwargs()
    model["seq_length"] = model.pop("max_sequence_length")  # the provider's name for it
    fields = dict(arch.config_kwargs(), **model, should_pad_vocab=False)
    for k, v in fields.items():
        setattr(provider, k, v)
    return provider


class ScaleVecBridgeMixin:
    """Our weight conversion for models built with our spec; Bridge's own for stock specs."""

    def hf_arch(self, hf_config) -> ModelArch:
        return _hf.arch_from_hf_config(hf_config.to_dict())

    def provider_bridge(self, hf_pretrained):
        arch = self.hf_arch(hf_pretrained.config)
        return apply_arch(super().provider_bridge(hf_pretrained), arch)

    def load_weights_hf_to_megatron(self, hf_pretrained, megatron_model,
                                    allowed_mismatched_params=None):
        models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        strategy = model_strategy(models[0])
        if strategy is None:
            return super().load_weights_hf_to_megatron(hf_pretrained, models,
                                                       allowed_mismatched_params)
        _one_rank_layout("loading Hugging Face weights")
        if len(models) != 1:
            raise ValueError("loading into a scale-vector model needs one model chunk (no VPP)")
        model = _unwrap(models[0])
        arch = self.hf_arch(hf_pretrained.config).replace(expert_vectors=strategy.expert_vectors)
        built = arch_of(model)
        bad = [f"{k}: model {getattr(built, k)!r} != checkpoint {getattr(arch, k)!r}"
               for k in _CHECKED if getattr(built, k) != getattr(arch, k)]
        if bad:
            raise ValueError("the provider's model does not match the Hugging Face checkpoint: "
                             + "; ".join(bad))
        state = hf_pretrained.state
        hf = {k: state[k].to(torch.float32) for k in state.keys()}
        if arch.tie_embeddings:
            hf.pop("lm_head.weight", None)
        check_names_and_shapes(hf, _hf._expected_hf_shapes(arch), "Hugging Face checkpoint")
        allow = bool(getattr(model.config, ALLOW_FLAG, False))
        with _rng_kept():  # the converter seeds its own model; the caller's RNG is left as is
            ours, _ = warm_start(_hf.hf_to_stock(hf, arch), arch, strategy.to_string(),
                                 allow_function_change=allow, measure=False)
            load_full_into(model, full_state_dict(ours), f"{strategy.to_string()} warm start")
        return models

    def stream_weights_megatron_to_hf(self, megatron_model, hf_pretrained, cpu=True,
                                      show_progress=True, conversion_tasks=None,
                                      merge_adapter_weights=True, **newer):
        """``newer``: keywords of later Bridge versions (0.6: ``weight_dtype``), passed on."""
        if model_strategy(megatron_model) is None:
            yield from super().stream_weights_megatron_to_hf(
                megatron_model, hf_pretrained, cpu, show_progress, conversion_tasks,
                merge_adapter_weights, **newer)
            return
        dtype = newer.get("weight_dtype")
        hf_sd, config = hf_export(megatron_model)
        name = config.architectures[0]
        if name != self.SOURCE_NAME:
            raise ValueError(f"this model exports as {name}, not {self.SOURCE_NAME}: export "
                             f"through export_bridge(model)")
        for key, tensor in hf_sd.items():
            tensor = tensor.to(dtype) if dtype is not None else tensor
            yield HFWeightTuple(key, tensor.cpu() if cpu else tensor)


def hf_export(model):
    """(HF state dict, transformers config) of a scale-vector model at TP=PP=EP=1, folded by
    our converter (fold.py, hf_remote.py): a stock family's config where one fits, else our
    ``modeling_scalevec`` config (auto_map)."""
    from megatron_scalevec.convert import hf_modeling  # noqa: PLC0415

    _one_rank_layout("Hugging Face export")
    inner = _unwrap(model)
    arch = arch_of(inner)
    if arch.is_moe:
        hf_remote.check_routing(inner.config)
    with torch.no_grad(), _rng_kept():
        stock_sd, stock_arch, dnp = fold_to_stock(inner, arch, keep_dnp=True)
    hf_sd, remote, branches = hf_remote.hf_state(stock_sd, stock_arch, dnp)
    if remote:
        return hf_sd, hf_modeling.ScaleVecQwen3Config(
            **hf_remote.remote_config(stock_arch, branches))
    return hf_sd, _hf.hf_config(stock_arch)


def export_bridge(model) -> AutoBridge:
    """An AutoBridge whose HF config is the one this model exports as (a stock family, or our
    ``modeling_scalevec`` with auto_map), to call ``export_hf_weights(model)`` on."""
    return AutoBridge.from_hf_config(hf_export(model)[1])


def save_hf(model, out_dir: str, *, overwrite: bool = False,
            dtype: torch.dtype = torch.float32) -> str:
    """Write ``config.json`` (+ ``modeling_scalevec.py`` when needed) and the weights Bridge
    exports (``export_bridge(model).export_hf_weights``) to ``out_dir``, atomically; returns
    the architecture. Load it with ``AutoModelForCausalLM`` (``trust_remote_code=True`` for
    our modeling file)."""
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from megatron_scalevec.convert.io import atomic_output_dir, save_safetensors  # noqa: PLC0415

    config = hf_export(model)[1]
    models = model if isinstance(model, list) else [model]
    weights = dict(AutoBridge.from_hf_config(config).export_hf_weights(
        models, cpu=True, show_progress=False))
    name = config.architectures[0]
    with atomic_output_dir(out_dir, overwrite) as tmp:
        config.dtype = dtype
        config.save_pretrained(tmp)
        if name == hf_remote.REMOTE_ARCH:
            here = os.path.dirname(os.path.abspath(__file__))
            shutil.copyfile(os.path.join(here, "hf_modeling.py"),
                            os.path.join(tmp, hf_remote.MODELING_FILE))
        save_safetensors(weights, os.path.join(tmp, "model.safetensors"), {"format": "pt"},
                         False, dtype)
    return name


def scalevec_provider(bridge: AutoBridge, strategy, *, allow_function_change: bool = False,
                      load_weights: bool = True) -> GPTModelProvider:
    """``bridge.to_megatron_provider`` with our spec for ``strategy`` (a string or a
    ScaleVecConfig: its options, the vectors' LR included, which the optimizer takes through
    ``optim.BridgeOverrides(cfg)``); the HF weights are warm-started into it when the model is
    provided (function-changing targets refused unless ``allow_function_change``)."""
    if not isinstance(bridge._model_bridge, ScaleVecBridgeMixin):  # private, Bridge 0.3.1
        raise ValueError(f"{type(bridge._model_bridge).__name__} is not a scale-vector bridge: "
                         f"import megatron_scalevec.convert.bridge before AutoBridge")
    if not isinstance(strategy, ScaleVecConfig):
        ScaleVecConfig.from_string(strategy)  # a bad strategy fails here, in one line
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.transformer_layer_spec = functools.partial(scalevec_moe_spec, scalevec=strategy)
    setattr(provider, ALLOW_FLAG, allow_function_change)
    return provider


@contextlib.contextmanager
def _rng_kept():
    """Restore torch's RNG and megatron's RNG tracker states on exit."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: PLC0415

    tracker = get_cuda_rng_tracker()
    saved = (torch.random.get_rng_state(), tracker.get_states())
    try:
        yield
    finally:
        torch.random.set_rng_state(saved[0])
        tracker.set_states(saved[1])


@MegatronModelBridge.register_bridge(source=LlamaForCausalLM, target=GPTModel, model_type="llama")
class ScaleVecLlamaBridge(ScaleVecBridgeMixin, LlamaBridge):
    """Llama: our weights for scale-vector models, Bridge's LlamaBridge otherwise."""


@MegatronModelBridge.register_bridge(source=Qwen3ForCausalLM, target=GPTModel, model_type="qwen3")
class ScaleVecQwen3Bridge(ScaleVecBridgeMixin, Qwen3Bridge):
    """Qwen3 (Q/K norms)."""


@MegatronModelBridge.register_bridge(source=Qwen3MoeForCausalLM, target=GPTModel,
                                     model_type="qwen3_moe")
class ScaleVecQwen3MoEBridge(ScaleVecBridgeMixin, Qwen3MoEBridge):
    """Qwen3-MoE; ``norm_topk_prob=False`` is megatron's pre-softmax routing (Bridge 0.3.1's
    own bridge reads it as renormalized routing)."""


@MegatronModelBridge.register_bridge(source=MixtralForCausalLM, target=GPTModel,
                                     model_type="mixtral")
class ScaleVecMixtralBridge(ScaleVecBridgeMixin, MegatronModelBridge):
    """Mixtral (Bridge 0.3.1 has no Mixtral bridge): scale-vector models only."""

    def mapping_registry(self):
        raise ValueError("MixtralForCausalLM: only models built with our spec convert here "
                         "(use megatron_scalevec.convert.bridge.scalevec_provider)")


@MegatronModelBridge.register_bridge(source=hf_remote.REMOTE_ARCH, target=GPTModel,
                                     model_type="scalevec_qwen3")
class ScaleVecRemoteBridge(ScaleVecBridgeMixin, MegatronModelBridge):
    """Our ``modeling_scalevec`` exports (auto_map): export of what no stock family holds."""

    def provider_bridge(self, hf_pretrained):
        raise ValueError(f"{hf_remote.REMOTE_ARCH}: loading our own Hugging Face export back "
                         f"is not supported; convert the scale-vector checkpoint instead")

    def mapping_registry(self):
        return self.provider_bridge(None)
