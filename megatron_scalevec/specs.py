"""ModuleSpecs for scale-vector GPT models (wiring only; the math is in layers/ and norms.py).

* :func:`get_scalevec_layer_spec` -- one transformer layer (dense, or MoE with ``num_experts``).
* :func:`get_scalevec_block_spec` -- the layers of one pipeline stage (dense or MoE per layer
  from ``config.moe_layer_freq``) plus our final norm, for ``GPTModel(transformer_layer_spec=)``.
* ``scalevec_dense`` / ``scalevec_moe`` -- a ``ModuleSpec`` of ``TransformerBlock`` whose
  submodules are sized when the block is built, for its config and pipeline stage: by the
  config registered with :func:`building` (our trainer), or by the hook that Megatron-LM's
  ``--spec`` module (:mod:`megatron_scalevec.megatron_lm_spec`) installs where megatron-core's
  TransformerBlock receives ``vp_stage``; this module has no side effects on import and
  imports no installer.
  A layer-only spec would get megatron-core's default final norm, which has a plain gamma and
  refuses sequence parallelism, hence a block spec.
* :func:`scalevec_moe_spec` / :func:`scalevec_dense_spec` -- the same as callables of the
  config (``vp_stage=`` keyword), the form Megatron-Bridge providers take.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Optional, Union

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_scalevec.compat import mcore
from megatron_scalevec.config import (
    ScaleVecConfig,
    moe_layer_flags,
    unsupported_feature,
    unsupported_with,
)
from megatron_scalevec.layers import ScaleVecMLP, ScaleVecSelfAttention
from megatron_scalevec.layers.moe import (
    ScaleVecSequentialMLP,
    ScaleVecSharedExpertMLP,
    ScaleVecTopKRouter,
)
from megatron_scalevec.layers.parts import linear_modules
from megatron_scalevec.norms import ScaleVecNorm

StrategyLike = Union[str, ScaleVecConfig]


mcore.quiet_known_notices()  # "Unknown MLP type" for ours; 0.19's GPTModel notice


def as_config(scalevec: StrategyLike) -> ScaleVecConfig:
    if isinstance(scalevec, ScaleVecConfig):
        return scalevec
    return ScaleVecConfig.from_string(scalevec)


def norm_spec(scalevec: StrategyLike, kind: str = "pre") -> ModuleSpec:
    return ModuleSpec(module=ScaleVecNorm, params={"scalevec": as_config(scalevec), "kind": kind})


def mlp_spec(scalevec: StrategyLike, transformer_impl: str = "local") -> ModuleSpec:
    cfg = as_config(scalevec)
    parts = linear_modules(transformer_impl)
    fc1 = ModuleSpec(module=parts.get("ln_column", parts["column"]),  # TE: norm fused in fc1
                     params={"scalevec": cfg, "branches": "fc1"})
    return ModuleSpec(module=ScaleVecMLP, params={"scalevec": cfg},
                      submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=parts["row"]))


def attention_spec(scalevec: StrategyLike, transformer_impl: str = "local") -> ModuleSpec:
    cfg = as_config(scalevec)
    parts = linear_modules(transformer_impl)
    # SelfAttention calls its linear_qkv builder directly (no build_module): a partial.
    qkv = functools.partial(parts.get("ln_column", parts["column"]), scalevec=cfg,
                            branches="qkv")  # TE: the input norm fused in linear_qkv
    return ModuleSpec(
        module=ScaleVecSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "scalevec": cfg},
        submodules=SelfAttentionSubmodules(linear_qkv=qkv, core_attention=parts["attention"],
                                           linear_proj=parts["row"]))


def grouped_gemm_available(transformer_impl: str = "local") -> bool:
    """True when grouped-GEMM experts can be built: torch's grouped_mm (local) or TE."""
    if transformer_impl == "transformer_engine":
        from megatron_scalevec.layers.te import HAVE_TE  # noqa: PLC0415

        return HAVE_TE
    from megatron_scalevec.layers.grouped import grouped_mm_available  # noqa: PLC0415

    return grouped_mm_available()


def _grouped_experts_spec(cfg: ScaleVecConfig, mlp: MLPSubmodules,
                          transformer_impl: str = "local") -> ModuleSpec:
    """Our grouped experts: torch grouped_mm (local) or TE's GroupedLinear, vectors folded
    (TE: our TEGroupedMLP with the folded grouped fc1 and TE's grouped fc2)."""
    if not grouped_gemm_available(transformer_impl):
        raise RuntimeError(
            f"grouped_gemm=True with transformer_impl={transformer_impl!r} needs "
            + ("Transformer Engine" if transformer_impl == "transformer_engine"
               else "torch.nn.functional.grouped_mm (torch >= 2.8)")
            + "; use grouped_gemm=False (sequential experts)")
    if transformer_impl == "transformer_engine":
        parts = linear_modules(transformer_impl)
        fc1 = ModuleSpec(module=parts["grouped_column"], params={"scalevec": cfg})
        return ModuleSpec(module=parts["grouped_mlp"], params={"scalevec": cfg},
                          submodules=MLPSubmodules(linear_fc1=fc1,
                                                   linear_fc2=parts["grouped_row"]))
    from megatron_scalevec.layers.grouped import ScaleVecGroupedMLP  # noqa: PLC0415

    return ModuleSpec(module=ScaleVecGroupedMLP, params={"scalevec": cfg}, submodules=mlp)


def moe_spec(cfg: ScaleVecConfig, num_experts: int, grouped_gemm: bool = False,
             transformer_impl: str = "local") -> ModuleSpec:
    """ModuleSpec of an MoE layer (megatron-core's MoELayer) with the strategy applied.

    Shared experts are built when ``config.moe_shared_expert_intermediate_size`` is set, as in
    megatron-core; the dispatcher is ``config.moe_token_dispatcher_type``. With
    ``transformer_impl='transformer_engine'`` the sequential experts use TE's linears.
    """
    if not num_experts or num_experts < 1:
        raise ValueError(f"moe_spec needs num_experts >= 1, got {num_experts!r}")
    parts = linear_modules(transformer_impl)
    fc1 = ModuleSpec(module=parts["column"], params={"scalevec": cfg, "branches": "fc1"})
    mlp = MLPSubmodules(linear_fc1=fc1, linear_fc2=parts["row"])
    if grouped_gemm:
        experts = _grouped_experts_spec(cfg, mlp, transformer_impl)
    else:
        experts = ModuleSpec(module=ScaleVecSequentialMLP, params={"scalevec": cfg},
                             submodules=mlp)
    shared = ModuleSpec(module=ScaleVecSharedExpertMLP, params={"scalevec": cfg}, submodules=mlp)
    router = functools.partial(ScaleVecTopKRouter, scalevec=cfg)
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(experts=experts, shared_experts=shared, router=router),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def te_norm_spec(scalevec: StrategyLike, normalization: Optional[str]) -> ModuleSpec:
    """Our TE norm (layers/te_classes.py) of ``normalization`` ('LayerNorm' / 'RMSNorm', the
    config's). megatron-core's TENorm instead picks TE's class in ``__new__`` from the config at
    build time, because its layer spec builders are not given the config; ours are given the
    normalization, so the class is picked here, when the spec is built."""
    norms = linear_modules("transformer_engine")["norm"]
    if normalization not in norms:
        raise ValueError(f"a Transformer Engine norm needs normalization='LayerNorm' or "
                         f"'RMSNorm' (config.normalization), got {normalization!r}")
    return ModuleSpec(module=norms[normalization], params={"scalevec": as_config(scalevec)})


def get_scalevec_layer_spec(scalevec: StrategyLike = "unified",
                            num_experts: Optional[int] = None,
                            transformer_impl: str = "local", normalization: Optional[str] = None,
                            **moe_options) -> ModuleSpec:
    """A GPT layer with the strategy applied; MoE when ``num_experts`` is given.

    ``transformer_impl='transformer_engine'``: megatron-core's TE layout (layers/te.py): the
    Pre-Norms fused into ``linear_qkv`` / dense ``linear_fc1``, vectors folded into TE weights,
    the MoE pre-norm a TE norm of ``normalization`` (``config.normalization``, needed then);
    otherwise our norms.
    """
    cfg = as_config(scalevec)
    te = transformer_impl == "transformer_engine"
    pre = norm_spec(cfg, "pre")
    if te:
        from megatron.core.transformer.identity_op import IdentityOp  # noqa: PLC0415

        moe_norm = te_norm_spec(cfg, normalization) if num_experts else None
    if num_experts:
        mlp = moe_spec(cfg, num_experts=num_experts, transformer_impl=transformer_impl,
                       **moe_options)
    else:
        mlp = mlp_spec(cfg, transformer_impl)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if te else pre,
            self_attention=attention_spec(cfg, transformer_impl),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=(moe_norm if num_experts else IdentityOp) if te else pre,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def moe_layer_pattern(config) -> list:
    """0/1 per global layer: which layers are MoE (megatron-core's ``moe_layer_freq``)."""
    return moe_layer_flags(config.num_layers, config.moe_layer_freq,
                           bool(config.num_moe_experts))


def get_scalevec_block_spec(config, scalevec: StrategyLike = "unified",
                            vp_stage: Optional[int] = None,
                            pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (dense or MoE each) and our final norm. A feature the
    vectors do not support (CUDA graphs, context parallelism ...: config.UNSUPPORTED) is refused
    here, before any model is built, whichever entry point builds it."""
    cfg = as_config(scalevec)
    why = unsupported_feature(config) or unsupported_with(config, cfg)
    if why:
        raise ValueError(f"megatron_scalevec: {why}")
    pattern = moe_layer_pattern(config)
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    n = get_num_layers_to_build(config, vp_stage, pp_rank)
    # Honour --transformer-impl: Megatron-LM's flag no longer picks the spec under --spec.
    impl = "local" if config.transformer_impl == "local" else "transformer_engine"
    dense = get_scalevec_layer_spec(cfg, transformer_impl=impl)
    moe = get_scalevec_layer_spec(cfg, config.num_moe_experts, transformer_impl=impl,
                                  normalization=config.normalization,
                                  grouped_gemm=config.moe_grouped_gemm) if any(pattern) else None
    specs = [moe if pattern[offset + i] else dense for i in range(n)]
    final = norm_spec(cfg, "final")
    if impl == "transformer_engine" and cfg.vectors and not cfg.hg and \
            cfg.stock_gamma:  # shared: the stock TE final norm and its keys
        final = te_norm_spec(cfg, config.normalization)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final)


def scalevec_moe_spec(config, vp_stage: Optional[int] = None, *,
                      scalevec: StrategyLike = "unified") -> TransformerBlockSubmodules:
    """The callable form (Megatron-Bridge ``transformer_layer_spec=``, Megatron-LM's
    ``f(config, vp_stage=)``): this stage's block, MoE per layer from the config."""
    return get_scalevec_block_spec(config, scalevec, vp_stage)


def scalevec_dense_spec(config, vp_stage: Optional[int] = None, *,
                        scalevec: StrategyLike = "unified") -> TransformerBlockSubmodules:
    """The dense callable form; a config with ``num_moe_experts`` is refused, not half-used."""
    if config.num_moe_experts:
        raise ValueError(f"scalevec_dense_spec: the config has num_moe_experts="
                         f"{config.num_moe_experts}; use scalevec_moe_spec")
    return get_scalevec_block_spec(config, scalevec, vp_stage)


_BUILD_STACK: list = []
# The module Megatron-LM's --spec names; it installs our hooks (this module never imports it).
MEGATRON_LM_SPEC_MODULE = "megatron_scalevec.megatron_lm_spec"


@contextlib.contextmanager
def building(config, vp_stage: Optional[int] = None):
    """Register the config a lazy ``scalevec_*`` spec sizes itself from while a model is built."""
    _BUILD_STACK.append((config, vp_stage))
    try:
        yield
    finally:
        _BUILD_STACK.pop()


def _build_context():
    """The (config, vp_stage) a lazy spec read outside a block's construction is sized from."""
    if _BUILD_STACK:
        return _BUILD_STACK[-1]
    if MEGATRON_LM_SPEC_MODULE in sys.modules:  # Megatron-LM: its hook sizes the block
        raise RuntimeError(
            "megatron_scalevec: this megatron-core builds TransformerBlock without "
            "transformer_block._get_block_submodules(config, spec, vp_stage, pp_rank), where "
            "megatron_scalevec.megatron_lm installs the hook that sizes our block for its "
            "pipeline stage; megatron-core 0.16.1 to 0.19.x have it")
    if "megatron.training" in sys.modules:  # e.g. the pre-0.2 `--spec ...specs ...`
        raise RuntimeError(
            f"inside Megatron-LM pass `--spec {MEGATRON_LM_SPEC_MODULE} scalevec_moe` (or "
            f"scalevec_dense): megatron_scalevec.specs installs no IWD, statistics or "
            f"pipeline-stage hooks")
    raise RuntimeError(
        "a lazy scale-vector block spec was built outside a build context: wrap the model "
        "construction in `with megatron_scalevec.specs.building(config, vp_stage):` or use "
        "get_scalevec_block_spec(config, ...)")


class ScaleVecBlockSubmodules(TransformerBlockSubmodules):
    """Block submodules sized when built: the layer list depends on the config and the stage.

    Megatron-LM hands one spec object to every model chunk; the stage each chunk builds is
    known only where megatron-core's TransformerBlock receives ``vp_stage``, so there
    :mod:`megatron_scalevec.megatron_lm`'s hook calls :meth:`resolve` (never parallel_state's
    virtual rank, which Megatron-LM does not set). Our trainer registers the config and stage
    with :func:`building` instead.
    """

    def __init__(self, scalevec: StrategyLike):  # noqa: D107 -- not a dataclass init
        self.scalevec = as_config(scalevec)

    def resolve(self, config, vp_stage: Optional[int] = None,
                pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
        """This stage's layers and final norm (megatron-core's block hook and building())."""
        return get_scalevec_block_spec(config, self.scalevec, vp_stage, pp_rank)

    def _resolve(self) -> TransformerBlockSubmodules:
        config, vp_stage = _build_context()
        return self.resolve(config, vp_stage)

    @property
    def layer_specs(self):
        return self._resolve().layer_specs

    @property
    def layer_norm(self):
        return self._resolve().layer_norm

    def __repr__(self) -> str:
        return f"ScaleVecBlockSubmodules({self.scalevec.to_string()!r})"


def block_module_spec(scalevec: StrategyLike) -> ModuleSpec:
    """A ``ModuleSpec`` of TransformerBlock that Megatron-LM and GPTModel accept as is."""
    return ModuleSpec(module=TransformerBlock, submodules=ScaleVecBlockSubmodules(scalevec))


scalevec_dense = block_module_spec("unified")
scalevec_moe = block_module_spec("unified")
