"""The architecture a converter needs to build a model, as a small JSON-able record.

A checkpoint alone does not say how to build the model it came from (megatron-core keeps no
config beside its tensors), so every converter takes a :class:`ModelArch`. Our own output
directories carry it as ``scalevec_arch.json``; for a Megatron-LM checkpoint pass one with
``--arch``. ``scalevec`` is ``"stock"`` for megatron-core's own local layer spec
(``get_gpt_layer_local_spec``) or a strategy string for ours.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
from dataclasses import dataclass
from typing import Optional, Union

import torch

ARCH_FILE = "scalevec_arch.json"
STOCK = "stock"
ACTIVATIONS = ("silu", "gelu")


@dataclass
class ModelArch:
    """What it takes to rebuild a GPT model (dense or MoE) at any parallel layout."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_query_groups: Optional[int] = None
    kv_channels: Optional[int] = None
    max_sequence_length: int = 4096
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    qk_layernorm: bool = False
    gated_linear_unit: bool = True
    activation: str = "silu"
    rotary_base: float = 10000.0
    tie_embeddings: bool = False
    scalevec: str = STOCK
    # MoE (None = dense); megatron-core field names.
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_router_pre_softmax: bool = False
    moe_layer_freq: Union[int, list] = 1  # megatron-core: every n-th layer, or 0/1 per layer
    expert_vectors: str = "per_expert"  # ScaleVecConfig.expert_vectors (MoE, ours only)

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelArch.activation must be one of {ACTIVATIONS}, "
                             f"got {self.activation!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("ModelArch: num_attention_heads must be a multiple of "
                             "num_query_groups")

    @property
    def is_stock(self) -> bool:
        return self.scalevec == STOCK

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def replace(self, **changes) -> ModelArch:
        return dataclasses.replace(self, **changes)

    def strategy(self):
        """The ScaleVecConfig of ``scalevec`` with this arch's MoE reading (not for stock)."""
        from megatron_scalevec.config import ScaleVecConfig

        return ScaleVecConfig.from_string(self.scalevec, expert_vectors=self.expert_vectors)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> ModelArch:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelArch fields {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def load(cls, path: str) -> ModelArch:
        if os.path.isdir(path):
            path = os.path.join(path, ARCH_FILE)
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, ARCH_FILE), "w") as f:
            f.write(self.to_json() + "\n")

    def differences(self, other: ModelArch, ignore=("max_sequence_length",)) -> list[str]:
        """``field: ours != theirs`` for every field that differs (``ignore`` aside)."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return [f"{k}: {a[k]!r} != {b[k]!r}" for k in a if k not in ignore and a[k] != b[k]]

    def transformer_config(self, **overrides):
        """megatron-core TransformerConfig at the current parallel layout, fusions off."""
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_config import TransformerConfig

        act = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}
        kw = dict(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups, kv_channels=self.kv_channels,
            ffn_hidden_size=self.ffn_hidden_size, normalization=self.normalization,
            layernorm_epsilon=self.layernorm_epsilon, qk_layernorm=self.qk_layernorm,
            gated_linear_unit=self.gated_linear_unit, activation_func=act[self.activation],
            add_bias_linear=False, add_qkv_bias=False,
            tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            use_cpu_initialization=True, bias_dropout_fusion=False, apply_rope_fusion=False,
            masked_softmax_fusion=False, bias_activation_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, hidden_dropout=0.0,
            attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
            transformer_impl="local",
        )
        if self.is_moe:
            kw.update(num_moe_experts=self.num_moe_experts, moe_router_topk=self.moe_router_topk,
                      moe_ffn_hidden_size=self.moe_ffn_hidden_size or self.ffn_hidden_size,
                      moe_shared_expert_intermediate_size=(
                          self.moe_shared_expert_intermediate_size),
                      moe_router_pre_softmax=self.moe_router_pre_softmax,
                      moe_layer_freq=self.moe_layer_freq, moe_token_dispatcher_type="alltoall",
                      moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                      moe_grouped_gemm=False)
        kw.update(overrides)
        return TransformerConfig(**kw)


def ensure_parallel_state(seed: int = 1234) -> None:
    """A one-process gloo group and TP=PP=1 model parallelism unless already set up
    (a converter run as a plain script; under torchrun the caller's layout is kept)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_scalevec.compat.cpu import enable_cpu_compat

    enable_cpu_compat()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=30))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)


def build_model(arch: ModelArch, scalevec: Optional[str] = None, seed: int = 1234):
    """A GPTModel of ``arch`` at the current parallel layout (``scalevec`` overrides
    ``arch.scalevec``; ``"stock"`` = megatron-core's local spec)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ensure_parallel_state(seed)
    strategy = arch.scalevec if scalevec is None else scalevec
    config = arch.transformer_config()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    if strategy == STOCK:
        spec = stock_layer_spec(arch)
    else:
        from megatron_scalevec.specs import get_scalevec_block_spec

        spec = get_scalevec_block_spec(config, arch.replace(scalevec=strategy).strategy())
    return GPTModel(
        config, spec, vocab_size=arch.vocab_size, max_sequence_length=arch.max_sequence_length,
        position_embedding_type="rope", rotary_base=int(arch.rotary_base),
        share_embeddings_and_output_weights=arch.tie_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage())


def stock_layer_spec(arch: ModelArch):
    """megatron-core's local spec; for MoE its block spec (dense/MoE per ``moe_layer_freq``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if arch.is_moe:
        return get_gpt_decoder_block_spec(arch.transformer_config(), use_transformer_engine=False,
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
