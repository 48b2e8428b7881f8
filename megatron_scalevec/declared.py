"""What a module declares about the scale vectors it owns or borrows, and the one walk over them.

Every module that owns or uses scale vectors says so in ``named_scale_vectors()``, yielding a
:class:`Declared` per vector: its name under the module, the vector, its IWD role, what it
scales and whether the module owns it (registered there) or borrows it (a routed expert under
``expert_vectors='shared'``: layers/expert_vectors.py). Readers (invariance.py, the monitor,
warm start, fold) ask :func:`declared` / :func:`declared_by` instead of probing attribute names,
so a new branched module is one declaration, not a change in every reader.

What a vector scales (``side``):

* ``"in"``: the input columns of ``target`` (a projection), branch ``branch``: HG's gamma,
  the router's gamma_r (``branch`` None: every row);
* ``"out"``: the output rows of ``target``'s branch (DP's ``a``);
* ``"norm"``: the normalized output rows of ``target``'s branch (DNP's norms, QK-norm);
* ``"pre"``: a whole normalized hidden state (a Pre-Norm's or the final norm's gamma);
  ``target`` None: megatron-core's layer decides who reads it (:func:`pre_norm_readers`).

The declared set is exactly what the optimizer classifies as vectors (optim.py ``is_vector``):
tests/test_declared_vectors.py checks it for every strategy and layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Optional

from torch import nn

__all__ = ["Declared", "declared", "declared_by", "declared_parameter_names",
           "pre_norm_readers", "sites"]

SIDES = ("in", "out", "norm", "pre")


class Declared(NamedTuple):
    """One vector a module uses. ``vector``: a ScaleVector (read by its call), or a plain
    parameter that is a vector (TE's fused norm gamma under ``shared``). A norm without a
    vector (a branch norm under ``none``) is declared too: it still normalizes."""

    name: str
    vector: object
    role: str
    side: str
    target: Optional[nn.Module] = None
    branch: Optional[str] = None
    owned: bool = True

    def parameters(self) -> list:
        """The vector's own parameters (its parameterization's parts)."""
        if isinstance(self.vector, nn.Parameter):
            return [self.vector]
        return self.vector.vector_parameters()

    def under(self, prefix: str) -> Declared:
        """The same declaration named from an enclosing module (``prefix``: this module's)."""
        return self._replace(name=".".join(n for n in (prefix, self.name) if n))


def declared_by(module: nn.Module) -> list:
    """What ``module`` itself declares (empty for a module without vectors)."""
    own = getattr(type(module), "named_scale_vectors", None)
    return list(own(module)) if own is not None else []


def declared(model: nn.Module, owned: Optional[bool] = None) -> Iterator[Declared]:
    """Every declaration in ``model``, named from ``model`` (``owned``: only owned ones, or
    only borrowed ones; None: both)."""
    for prefix, module in model.named_modules():
        for d in declared_by(module):
            if owned is None or d.owned == owned:
                yield d.under(prefix)


def declared_parameter_names(model: nn.Module) -> set:
    """Registered names of every owned vector's parameters (what state_dict calls them)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for d in declared(model, owned=True) for p in d.parameters()
            if id(p) in by_id}


def pre_norm_readers(layer: nn.Module) -> list:
    """(Pre-Norm module, the projections reading its output) of a megatron-core
    ``TransformerLayer``: its structure, stock's names, known here once. The MLP's Pre-Norm
    is read by every ``linear_fc1`` under ``mlp`` (the MLP's; in an MoE layer every expert's
    and shared expert's) and the MoE router."""
    out = []
    attn, norm = getattr(layer, "self_attention", None), getattr(layer, "input_layernorm", None)
    if attn is not None and norm is not None:
        out.append((norm, [attn.linear_qkv]))
    mlp, norm2 = getattr(layer, "mlp", None), getattr(layer, "pre_mlp_layernorm", None)
    if mlp is not None and norm2 is not None:
        readers = [m for n, m in mlp.named_modules()
                   if n.endswith("linear_fc1") or n == "router"]
        out.append((norm2, readers))
    return out


def sites(model: nn.Module) -> dict:
    """{declared name: (site, side, branch)}: where in megatron-core's layer each vector acts,
    for plots. ``site``: "attention", "router" or "mlp" (anything else in a TransformerLayer:
    the MLP, experts, shared experts) from the class of the module around the vector's target
    (or, without a target, around its declaring module); a Pre-Norm is "pre" inside a layer,
    "final" outside one, its branch the site it feeds."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.router import Router
    from megatron.core.transformer.transformer_layer import TransformerLayer

    where, in_layer = {}, set()

    def visit(module, site, layered):
        if isinstance(module, TransformerLayer):
            site, layered = "mlp", True
        elif isinstance(module, Attention):
            site = "attention"
        elif isinstance(module, Router):
            site = "router"
        where[id(module)] = site
        if layered:
            in_layer.add(id(module))
        for child in module.children():
            visit(child, site, layered)

    visit(model, "final", False)
    feeds = {}  # a Pre-Norm -> the site it feeds (the MLP's feeds its router too: the MLP)
    for layer in model.modules():
        for norm, readers in pre_norm_readers(layer):
            fed = [where[id(r)] for r in readers]
            feeds[id(norm)] = next((f for f in fed if f != "router"), fed[0] if fed else None)
    out = {}
    for prefix, module in model.named_modules():
        for d in declared_by(module):
            owner = id(d.target) if d.target is not None else id(module)
            if d.side == "pre":
                site = "pre" if id(module) in in_layer else "final"
                branch = where[owner] if d.target is not None else feeds.get(id(module))
            else:
                site, branch = where[owner], d.branch
            out[d.under(prefix).name] = (site, d.side, branch)
    return out
