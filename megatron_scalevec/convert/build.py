"""Building the model a :class:`ModelArch` describes, at the current parallel layout, and
comparing two models' logits. Kept apart from ``arch.py`` (data only), which every converter and
the checkpoint code read without importing the model code."""

from __future__ import annotations

import datetime
from typing import Optional

import torch

from megatron_scalevec.convert.arch import STOCK, ModelArch


def transformer_config(arch: ModelArch, **overrides):
    """megatron-core TransformerConfig at the current parallel layout, fusions off."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        arch.config_kwargs(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        transformer_impl="local",
    )
    if arch.is_moe:
        kw.update(moe_token_dispatcher_type="alltoall",
                  moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                  moe_grouped_gemm=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def ensure_parallel_state(seed: int = 1234) -> None:
    """A one-process gloo group and TP=PP=1 model parallelism unless already set up
    (a converter run as a plain script; under torchrun the caller's layout is kept). On a
    machine without CUDA the caller enables the CPU layer first, as the converter's command
    line does (``compat.cpu.enable_cpu_compat``): a library function never patches torch."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        # an in-process store: no port to race for (see training/trainer.py)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=30))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)


def build_model(arch: ModelArch, scalevec: Optional[str] = None, seed: int = 1234):
    """A GPTModel of ``arch`` at the current parallel layout (``scalevec`` overrides
    ``arch.scalevec``; ``"stock"`` = megatron-core's local spec)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_scalevec.compat import mcore

    mcore.quiet_known_notices()  # a stock spec imports no specs.py, which installs them
    ensure_parallel_state(seed)
    strategy = arch.scalevec if scalevec is None else scalevec
    config = transformer_config(arch)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if strategy == STOCK:
        spec = stock_layer_spec(arch)
    else:
        from megatron_scalevec.specs import get_scalevec_block_spec

        spec = get_scalevec_block_spec(config, arch.replace(scalevec=strategy).strategy())
    return GPTModel(
        config, spec, **arch.model_kwargs(), pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())


def stock_layer_spec(arch: ModelArch):
    """megatron-core's local spec; for MoE its block spec (dense/MoE per ``moe_layer_freq``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if arch.is_moe:
        return get_gpt_decoder_block_spec(transformer_config(arch), use_transformer_engine=False,
                                          normalization=arch.normalization)
    return get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm,
                                     normalization=arch.normalization)


def sample_batch(arch: ModelArch, batch: int = 2, seq: int = 16, seed: int = 0):
    """Deterministic token ids and positions for comparing two models' logits."""
    g = torch.Generator().manual_seed(seed)
    seq = min(seq, arch.max_sequence_length)
    tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=g)
    return tokens, torch.arange(seq).expand(batch, seq)


@torch.no_grad()
def logits(model, tokens, positions) -> torch.Tensor:
    """[batch, seq, vocab] float32 logits of a megatron GPTModel (one process, TP=PP=1)."""
    model.eval()
    device = next(model.parameters()).device
    out = model(tokens.to(device), positions.to(device), None)
    return out.float().cpu()
