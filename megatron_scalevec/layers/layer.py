"""The transformer layer: megatron-core's, with all its cached scale vectors evaluated at once.

Under ``unified`` a dense layer's norms ask for five OR vectors per forward (a_q, a_k, a_v per
head, a_g, a_u over the FFN width), a MoE layer's for more (the router's, each expert's).
One by one, each costs a dozen tiny ops forward and backward and its own once-per-step cycle
(vectors.py); on a GPU every one of them is a kernel launch. Here the layer evaluates them on
entry to its forward, alike vectors stacked (vectors.py ``gammas``), under one cycle of
layers/fold_cache.py (the flat concatenation of the gammas is the "effective weight"), and
each vector holds its slice for the forward's duration. The cycle is per layer, not per
model, so its backward runs when the layer's own backward ends and ``overlap_grad_reduce``
buckets are ready as before. Off under ``fused.reference()`` (the vectors one by one, the
reference the tests compare with).

A recompute that re-runs a norm outside this forward (selective ``layernorm`` / ``mlp``)
finds nothing held and computes its vector again by itself, with autograd: still exact.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_scalevec.layers import fold_cache, fused
from megatron_scalevec.vectors import ScaleVector, _identity_fold, _identity_unfold, gammas

__all__ = ["ScaleVecTransformerLayer", "layer_vectors"]

_BANK = "_scalevec_layer_vectors"


def layer_vectors(layer: torch.nn.Module) -> list:
    """The vectors a layer evaluates at once: those that opted in to once per step (their
    owner asks exactly once per forward) with an OR / ER parameterization."""
    return [m for m in layer.modules() if isinstance(m, ScaleVector)
            and m._step is not None and m.parameterization in ("or", "er")]


class _Vectors:
    """One layer's vectors, their parameters and their sizes (built on the first forward)."""

    def __init__(self, layer):
        self.vectors = layer_vectors(layer)
        self.sizes = [v.size for v in self.vectors]
        params = [p for v in self.vectors for p in v.parameters(recurse=False)]
        # the longest first: fold_cache names the cycle after weights[0]'s shape
        self.ops = fold_cache.FoldOps(
            tuple(sorted(params, key=lambda p: -p.numel())),
            lambda: (torch.cat(gammas(self.vectors)),), _identity_fold, _identity_unfold)
        self.scalevec = self.vectors[0]._step[0] if self.vectors else None

    @contextlib.contextmanager
    def held(self, layer):
        if not self.vectors or fused.use_reference():
            yield
            return
        flat = fold_cache.step_weight(layer, self.ops, scalevec=self.scalevec,
                                      config=layer.config,
                                      safe_recompute=fold_cache.NORM_SAFE_RECOMPUTE)
        values = gammas(self.vectors) if flat is None else flat.split(self.sizes)
        for v, g in zip(self.vectors, values):
            v.hold(g)
        try:
            yield
        finally:
            for v in self.vectors:
                v.hold(None)


class ScaleVecTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer (any version's forward signature) whose scale vectors
    are evaluated together once per forward (module doc)."""

    def forward(self, *args, **kwargs):
        bank = self.__dict__.get(_BANK)
        if bank is None:
            bank = self.__dict__[_BANK] = _Vectors(self)
        with bank.held(self):
            return super().forward(*args, **kwargs)
