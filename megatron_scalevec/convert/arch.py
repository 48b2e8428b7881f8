"""The architecture a converter needs to build a model, as a small JSON-able record.

A checkpoint alone does not say how to build the model it came from (megatron-core keeps no
config beside its tensors), so every converter takes a :class:`ModelArch`. Our own output
directories carry it as ``scalevec_arch.json``; for a Megatron-LM checkpoint pass one with
``--arch``. ``scalevec`` is ``"stock"`` for megatron-core's own local layer spec
(``get_gpt_layer_local_spec``) or a strategy string for ours.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional, Union

ARCH_FILE = "scalevec_arch.json"
STOCK = "stock"
ACTIVATIONS = ("silu", "gelu")
# The architecture fields a megatron-core TransformerConfig (a Bridge provider is one) names as
# ModelArch does: the one mapping between the two, both ways (from_config, config_kwargs).
CONFIG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "ffn_hidden_size", "normalization", "layernorm_epsilon",
                 "qk_layernorm", "gated_linear_unit")
MOE_CONFIG_FIELDS = ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size", "moe_router_pre_softmax",
                     "moe_layer_freq")


def activation_funcs() -> dict:
    """``{ModelArch.activation: megatron's activation_func}`` (torch imported only here)."""
    import torch.nn.functional as F  # noqa: PLC0415 -- arch.py stays importable without torch

    return {"silu": F.silu, "gelu": F.gelu}


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
    layernorm_bias: str = "stock"  # ScaleVecConfig.layernorm_bias (LayerNorm, ours only)

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

        return ScaleVecConfig.from_string(self.scalevec, expert_vectors=self.expert_vectors,
                                          layernorm_bias=self.layernorm_bias)

    @classmethod
    def from_config(cls, config, **model) -> ModelArch:
        """The arch of a megatron-core TransformerConfig (or Bridge provider); ``model`` gives
        what a config does not hold (vocab_size, max_sequence_length, rotary_base,
        tie_embeddings, scalevec, expert_vectors). A dense config keeps the MoE defaults."""
        act = [k for k, f in activation_funcs().items() if config.activation_func is f]
        if not act:
            raise ValueError(f"activation {config.activation_func} has no Hugging Face "
                             f"equivalent here")
        fields = {k: getattr(config, k) for k in CONFIG_FIELDS}
        if config.num_moe_experts:
            fields.update({k: getattr(config, k) for k in MOE_CONFIG_FIELDS})
        return cls(activation=act[0], **fields, **model)

    def config_kwargs(self) -> dict:
        """The TransformerConfig fields this arch fixes (linears without biases; the MoE ones
        when MoE), which our converter, the Bridge providers and the trainer all build from."""
        kw = {k: getattr(self, k) for k in CONFIG_FIELDS}
        kw.update(activation_func=activation_funcs()[self.activation], add_bias_linear=False,
                  add_qkv_bias=False)
        if self.is_moe:
            kw.update({k: getattr(self, k) for k in MOE_CONFIG_FIELDS})
            kw["moe_ffn_hidden_size"] = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return kw

    def model_kwargs(self) -> dict:
        """The GPTModel arguments this arch fixes (besides its config and layer spec)."""
        return dict(vocab_size=self.vocab_size, max_sequence_length=self.max_sequence_length,
                    position_embedding_type="rope", rotary_base=int(self.rotary_base),
                    share_embeddings_and_output_weights=self.tie_embeddings)

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
