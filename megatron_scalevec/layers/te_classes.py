"""Our Transformer Engine classes, each defined once, here, over megatron-core's TE wrappers.

Their behaviour is in layers/te.py (:class:`FoldedTELinear`) and layers/te_grouped.py
(:class:`FoldedGroupedLinear`, :class:`GroupedExpertsVectors`), which import no TE; the class
statements need TE's classes as bases, so they live in this module, imported only where TE is
used (layers/parts.py ``linear_modules``, after ``te.require_te()``). That split is forced by TE
being optional and, in tests, importable only once its CPU stand-in is activated inside a forked
rank (scalevec_testing/te_stub.py), after layers/te.py was first imported: without TE this
module refuses to import, so no class is ever built over megatron-core's placeholders.
"""

from __future__ import annotations

from megatron.core.extensions import transformer_engine as ext
from megatron.core.transformer.moe.experts import TEGroupedMLP

from megatron_scalevec.compat import mcore
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers.te import FoldedTELinear, freeze_scale_free, te_norm_gamma
from megatron_scalevec.layers.te_grouped import (
    FoldedGroupedLinear,
    GroupedExpertsVectors,
    check,
)

if not ext.HAVE_TE:  # megatron-core's TE names are placeholders then
    raise ImportError("megatron_scalevec.layers.te_classes needs Transformer Engine "
                      "(layers/parts.py linear_modules('transformer_engine') says so first)")

__all__ = ["PARTS", "ScaleVecTEColumnParallelGroupedLinear", "ScaleVecTEColumnParallelLinear",
           "ScaleVecTEGroupedMLP", "ScaleVecTELayerNorm", "ScaleVecTELayerNormColumnParallelLinear",
           "ScaleVecTERMSNorm"]


class ScaleVecTELayerNormColumnParallelLinear(FoldedTELinear, ext.TELayerNormColumnParallelLinear):
    """TE's fused norm + column linear; branch vectors folded, norm frozen unless shared."""

    def __init__(self, input_size, output_size, *, scalevec: ScaleVecConfig, branches: str,
                 config, **kwargs):
        if scalevec.vectors and not scalevec.hg and not scalevec.stock_gamma:
            raise NotImplementedError(
                f"{scalevec.to_string()} under TE: the fused norm's gamma is a plain TE "
                f"parameter; use the local path for {scalevec.parameterization.upper()} on a "
                "shared gamma")
        super().__init__(input_size, output_size, config=config, **kwargs)
        self._init_folded(scalevec, branches, config, input_size, output_size, False)
        freeze_scale_free(self, "layer_norm_weight", "layer_norm_bias", config, scalevec)

    def named_scale_vectors(self):
        """The branch vectors, and the fused norm's gamma under ``shared`` (declared.py)."""
        yield from super().named_scale_vectors()
        yield from te_norm_gamma(self, self)


class ScaleVecTEColumnParallelLinear(FoldedTELinear, ext.TEColumnParallelLinear):
    """TE column linear (sequential and shared experts) with branch vectors folded."""

    def __init__(self, input_size, output_size, *, scalevec: ScaleVecConfig, branches: str,
                 config, is_expert: bool = False, **kwargs):
        super().__init__(input_size, output_size, config=config, is_expert=is_expert, **kwargs)
        self._init_folded(scalevec, branches, config, input_size, output_size, is_expert)


class _ScaleFreeTENorm:
    """TE's LayerNorm / RMSNorm built as megatron-core's TENorm builds it; scale-free (frozen
    identity) unless ``shared``, LayerNorm's bias trainable (te.freeze_scale_free).
    ``normalization``: the flavour, picked where the spec is built (specs.py); a config asking
    for the other one is refused."""

    normalization = ""

    def __init__(self, config, hidden_size, eps=1e-5, *, scalevec: ScaleVecConfig):
        if config.normalization != self.normalization:
            raise ValueError(f"{type(self).__name__} was put in the spec for "
                             f"{self.normalization}, but config.normalization is "
                             f"{config.normalization!r}: build the spec from this config")
        # megatron-core's TENorm arguments; _get_extra_te_kwargs is its private helper
        # (params_dtype, device), present in 0.16.1 and 0.19.2
        super().__init__(hidden_size, eps=eps, sequence_parallel=config.sequence_parallel,
                         zero_centered_gamma=config.layernorm_zero_centered_gamma,
                         **ext._get_extra_te_kwargs(config))
        freeze_scale_free(self, "weight", "bias", config, scalevec)

    def named_scale_vectors(self):
        """Its gamma under ``shared`` (declared.py)."""
        yield from te_norm_gamma(self)


class ScaleVecTELayerNorm(_ScaleFreeTENorm, ext.te.pytorch.LayerNorm):
    normalization = "LayerNorm"


class ScaleVecTERMSNorm(_ScaleFreeTENorm, ext.te.pytorch.RMSNorm):
    normalization = "RMSNorm"


class ScaleVecTEColumnParallelGroupedLinear(FoldedGroupedLinear,
                                            ext.TEColumnParallelGroupedLinear):
    """TE grouped fc1 folding expert e's vectors into ``weight{e}``."""

    def __init__(self, num_gemms, input_size, output_size, *, scalevec: ScaleVecConfig, config,
                 **kwargs):
        check(config, scalevec)
        super().__init__(num_gemms, input_size, output_size, config=config, **kwargs)
        self._init_vectors(scalevec, config, input_size, output_size)


class ScaleVecTEGroupedMLP(GroupedExpertsVectors, TEGroupedMLP):
    """megatron-core's TEGroupedMLP: DNP between the grouped GEMMs, shared expert vectors."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None, *,
                 scalevec: ScaleVecConfig):
        super().__init__(**mcore.accepted_kwargs(
            TEGroupedMLP, num_local_experts=num_local_experts, config=config,
            submodules=submodules, pg_collection=pg_collection, name=name))
        self._init_vectors(scalevec, pg_collection)


PARTS = {  # layers/parts.py linear_modules("transformer_engine")
    "ln_column": ScaleVecTELayerNormColumnParallelLinear,
    "column": ScaleVecTEColumnParallelLinear,
    "row": ext.TERowParallelLinear,
    "attention": ext.TEDotProductAttention,
    "norm": {"LayerNorm": ScaleVecTELayerNorm, "RMSNorm": ScaleVecTERMSNorm},
    "grouped_column": ScaleVecTEColumnParallelGroupedLinear,
    "grouped_row": ext.TERowParallelGroupedLinear,
    "grouped_mlp": ScaleVecTEGroupedMLP,
}
