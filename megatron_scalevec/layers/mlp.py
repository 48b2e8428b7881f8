"""MLP with DNP's normalized output side on gate and up, on megatron-core's MLP.

``g = a_g * N(W_g (gamma_g * N(x)))``, ``u = a_u * N(W_u (gamma_u * N(x)))``,
``y = W_d (act(g) * u)``. ``N`` runs over the whole FFN width; under tensor (or expert-tensor)
parallelism that width is split, so its statistics are all-reduced and the result does not
depend on the layout. Without DNP this class is megatron-core's MLP unchanged (the HG/DP
vectors live in ``linear_fc1``), fusions included. With DNP the norms, their vectors and the
GLU run as one function over fc1's output (layers/glu.py), which keeps only that output.
"""

from __future__ import annotations

from megatron.core.transformer.mlp import MLP

from megatron_scalevec import sharding
from megatron_scalevec.compat import mcore
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.layers import glu
from megatron_scalevec.layers.expert_vectors import Borrowed, uses_shared_vectors, vectors_of
from megatron_scalevec.norms import ffn_norms
from megatron_scalevec.vectors import stacked


def check_dnp(config, scalevec: ScaleVecConfig, width: int, tp: int) -> None:
    """DNP's gate / up norms can be laid out over ``width`` split on ``tp`` ranks."""
    if not scalevec.dnp:
        return
    glu.check_config(config)
    check_dnp_width(scalevec, width, tp)


def check_dnp_width(scalevec: ScaleVecConfig, width: int, tp: int, field="ffn_hidden_size",
                    ranks="tensor-parallel") -> None:
    """DNP's norm over ``width`` (config.``field``) splits evenly over ``tp`` ``ranks`` ranks:
    every MLP and experts module."""
    if scalevec.dnp and width % tp:
        raise ValueError(f"DNP: {field} {width} does not split over {tp} {ranks} ranks, so "
                         f"its norm cannot be laid out")


def branch_norms(holder, target, owned: bool):
    """Declarations of the DNP norms ``holder`` has (``gate_norm``, ``up_norm``), normalizing
    ``target``'s branch rows: one definition for every MLP-like owner or user."""
    for b in ("gate", "up"):
        norm = getattr(holder, f"{b}_norm", None)
        if norm is not None:
            yield Declared(f"{b}_norm", norm, norm.role, "norm", target, b, owned)


class GLUNormMLP(MLP):
    """megatron-core's MLP with DNP's ``gate_norm`` / ``up_norm`` applied after ``linear_fc1``
    (:meth:`forward`), built by :meth:`_init_norms` after ``MLP.__init__``. No ``__init__`` of
    its own, so a megatron-core subclass of MLP (SharedExpertMLP) can sit above it in an MRO."""

    def _init_norms(self, scalevec: ScaleVecConfig, width: int, is_expert: bool) -> None:
        """The DNP norms over this MLP's FFN ``width``, split over ``self.tp_group``; a routed
        expert under ``expert_vectors='shared'`` is lent its layer's (layers/expert_vectors.py)."""
        self.scalevec = scalevec
        self.vectors_from = Borrowed() if uses_shared_vectors(scalevec, is_expert) else None
        if self.vectors_from is not None:
            return
        tp = sharding.group_size(self.tp_group)
        allreduce = getattr(self.linear_fc1.weight, "allreduce", True) if is_expert else None
        norms = ffn_norms(self.config, scalevec, width // tp,
                          sharding.placement("ffn_norm", self.config, self.tp_group), allreduce)
        self.up_norm, self.gate_norm = norms["up"], norms["gate"]  # registered in this order

    def named_scale_vectors(self):
        """DNP's gate / up norms on ``linear_fc1``'s rows (declared.py), owned or lent."""
        yield from branch_norms(vectors_of(self), self.linear_fc1, self.vectors_from is None)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        norms = vectors_of(self)
        if norms.up_norm is None:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        h, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            h = h + bias
        gated = self.config.gated_linear_unit
        norm = norms.up_norm
        if gated and norm.enabled:  # alike vectors: one batched evaluation (vectors.stacked)
            a_g, a_u = stacked([norms.gate_norm, norm]).unbind(0)
        else:
            a_g, a_u = norms.gate_norm() if gated else None, norm()
        h = glu.glu_norm(h, a_g, a_u,
                         self.config.activation_func, gated=gated,
                         normalization=norm.normalization, eps=norm.eps,
                         group=norm.split_group, width=norm.global_size)
        if per_token_scale is not None:
            h = (h * per_token_scale.unsqueeze(-1)).to(h.dtype)
        out, out_bias = self.linear_fc2(h)
        if per_token_scale is not None and out_bias is not None:
            out = out + out_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            out_bias = None
        return out, out_bias


class ScaleVecMLP(GLUNormMLP):
    """megatron-core MLP + DNP norms (``gate_norm``, ``up_norm``) after ``linear_fc1``."""

    def __init__(self, config, submodules, *, scalevec: ScaleVecConfig, is_expert=False,
                 input_size=None, ffn_hidden_size=None, tp_group=None, pg_collection=None,
                 is_mtp_layer=False, name=None):
        # pg_collection / is_mtp_layer / name: what TransformerLayer passes from 0.18 on
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        width = ffn_hidden_size if ffn_hidden_size is not None else config.ffn_hidden_size
        check_dnp(config, scalevec, width,
                  sharding.group_size(tp_group or sharding.tp_group(is_expert)))
        super().__init__(config, submodules, **mcore.accepted_kwargs(
            MLP, is_expert=is_expert, input_size=input_size, ffn_hidden_size=ffn_hidden_size,
            tp_group=tp_group, name=name))
        self._init_norms(scalevec, width, is_expert)
