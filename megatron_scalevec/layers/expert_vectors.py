"""Who owns an expert's scale vectors, and the one way a module reaches the vectors it uses.

Every module normally owns the vectors it uses: a fused projection its ``scale_in`` /
``scale_out`` (layers/linear.py), an MLP its DNP ``gate_norm`` / ``up_norm`` (layers/mlp.py).
``ScaleVecConfig.expert_vectors='shared'`` gives all routed experts of an MoE layer one set:

* the owner is the layer's :class:`ExpertSharedVectors`, registered once as ``shared_vectors``
  by its experts module (sequential, local grouped or TE grouped): state_dict, DDP buckets,
  optimizer groups and checkpoints see the vectors there and nowhere else;
* each user (every expert and its fc1; in a TE grouped linear each expert's
  ``ExpertFc1Vectors`` and DNP norms, layers/te_grouped.py) builds none of its own and holds
  a :class:`Borrowed` as ``vectors_from``, filled by
  :meth:`ExpertSharedVectors.lend_to`;
* every reader asks :func:`vectors_of` (``vectors_of(fc1).scale_in``, ``vectors_of(mlp).up_norm``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.norms import ffn_norms
from megatron_scalevec.vectors import ScaleVector, branch_vectors, sharded_vectors

__all__ = ["Borrowed", "ExpertSharedVectors", "shared_expert_vectors", "uses_shared_vectors",
           "vectors_of"]


class Borrowed:
    """A module or parameter used here and owned (registered) elsewhere. A plain object:
    ``nn.Module`` registers only Module, Parameter and buffer values, so what it holds is seen
    once, at its owner, by state_dict, ``parameters()``, DDP and checkpoints."""

    def __init__(self, target=None):
        self.target = target


def uses_shared_vectors(scalevec: ScaleVecConfig, is_expert: bool) -> bool:
    """Whether a routed expert's module takes its vectors from its layer's
    :class:`ExpertSharedVectors` (which exists exactly then) instead of building its own."""
    return is_expert and scalevec.expert_vectors == "shared" and \
        (scalevec.hg or scalevec.dp or scalevec.dnp)


def vectors_of(module):
    """What holds the vectors ``module`` uses (``scale_in``, ``scale_out``, ``gate_norm``,
    ``up_norm``): ``module`` itself, or the layer's :class:`ExpertSharedVectors` it was lent."""
    borrowed = getattr(module, "vectors_from", None)
    if borrowed is None:
        return module
    if borrowed.target is None:
        raise RuntimeError(f"{type(module).__name__} is a routed expert under "
                           f"expert_vectors='shared' and was never lent its layer's vectors: "
                           f"build it through its experts module (ExpertSharedVectors.lend_to)")
    return borrowed.target


class ExpertSharedVectors(torch.nn.Module):
    """``expert_vectors='shared'``: one set of expert-side vectors for all routed experts of a
    MoE layer: ``scale_in`` (HG gamma_g, gamma_u in R^h), ``scale_out`` (DP a_g, a_u) and
    ``gate_norm`` / ``up_norm`` (DNP), the latter two in R^f split over expert TP like fc1.

    They are not per-expert parameters: every EP rank holds the same copy and its local
    experts use it, so its autograd gradient covers only the tokens of the local experts.
    Reduction, exact for every layout: in autograd we sum over the expert-TP x EP group
    (``tp_ep``) for the input gammas (replicated over expert TP, each rank uses its own fc1
    rows) and over EP only for the output vectors (split over expert TP, so the expert-TP
    part is already complete). Every rank then holds sum_e g_e, e over the experts of its
    expert-data-parallel replica. The parameters copy ``allreduce`` from the expert weights,
    so DDP then does to them exactly what it does to a per-expert vector (sum over expert DP,
    factor 1/dp_cp): by linearity the result is sum_e of the per-expert gradients, i.e. the
    true gradient of the shared vector. Leaving them to DDP's dense buckets would not be:
    when expert TP < TP the EP group runs along the dense TP ranks, outside the dense DP
    group (e.g. TP=2, EP=2, ETP=1 has DP=1).
    """

    def __init__(self, config, scalevec: ScaleVecConfig, width: int, *, expt_tp, tp_ep, ep,
                 allreduce: bool):
        super().__init__()
        names = ["gate", "up"] if config.gated_linear_unit else ["up"]
        local = width // sharding.group_size(expt_tp)
        def place(vector):
            return sharding.placement(f"shared_expert_{vector}", config, expt_tp, ep=ep,
                                      tp_ep=tp_ep)

        self.scale_in, self.scale_out = branch_vectors(
            scalevec, config, names, (config.hidden_size, place("input")),
            (local, place("output")), allreduce)
        norms = ffn_norms(config, scalevec, local, place("ffn_norm"), allreduce)
        self.gate_norm, self.up_norm = norms["gate"], norms["up"]  # registered in this order
        # Identical on every EP rank after the reduction above: counted once in the grad norm.
        sharding.mark_replicas(self, ep)

    def named_scale_vectors(self):
        """All of them, owned here (declared.py); no single target: each user declares what
        it applies them to (borrowed)."""
        for side, dict_name in (("in", "scale_in"), ("out", "scale_out")):
            for b, vec in getattr(self, dict_name).items():
                yield Declared(f"{dict_name}.{b}", vec, vec.role, side, None, b)
        for b in ("gate", "up"):
            norm = getattr(self, f"{b}_norm")
            if norm is not None:
                yield Declared(f"{b}_norm", norm, norm.role, "norm", None, b)

    def lend_to(self, users) -> None:
        """Make each user (built with an empty ``vectors_from``: :func:`uses_shared_vectors`)
        use these vectors, held by :class:`Borrowed` reference, never registered again."""
        for user in users:
            borrowed = getattr(user, "vectors_from", None)
            if borrowed is None:
                raise RuntimeError(f"{type(user).__name__} owns its vectors: it cannot use "
                                   f"the layer's shared ones")
            borrowed.target = self

    @contextlib.contextmanager
    def computed_once(self):
        """Each shared vector computed once per forward for all local experts."""
        with contextlib.ExitStack() as stack:
            for vec in self.modules():
                if isinstance(vec, ScaleVector):
                    stack.enter_context(vec.computed_once())
            yield

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None,
                           ep_group=None, expt_dp_group=None):
        """Once per layer (no expert axis), replicated over EP x expert DP (and expert TP
        where not split): the replica id's last entry numbers the (EP, expert-DP) copies."""
        copy = sharding.group_rank(ep_group) + sharding.group_size(ep_group) * \
            sharding.group_rank(expt_dp_group)
        return sharded_vectors(self.named_scale_vectors(), prefix, sharded_offsets, metadata,
                               copy)


def shared_expert_vectors(config, scalevec: ScaleVecConfig, users, pg_collection, *,
                          expt_tp, ep, weight) -> Optional[ExpertSharedVectors]:
    """``expert_vectors='shared'``: the layer's one set of expert vectors, lent to ``users``
    (the local experts and their fc1s); None otherwise. ``weight``: an expert weight, whose
    ``allreduce`` the vectors copy."""
    users = list(users)
    if not users or not uses_shared_vectors(scalevec, is_expert=True):
        return None
    tp_ep = getattr(pg_collection, "tp_ep", None) if pg_collection is not None else None
    if tp_ep is None:
        tp_ep = parallel_state.get_expert_tensor_and_model_parallel_group(False)
    shared = ExpertSharedVectors(config, scalevec, config.moe_ffn_hidden_size, expt_tp=expt_tp,
                                 tp_ep=tp_ep, ep=ep,
                                 allreduce=getattr(weight, "allreduce", True))
    shared.lend_to(users)
    return shared
