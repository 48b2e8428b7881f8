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
