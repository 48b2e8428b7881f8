"""Transformer Engine parts with scale vectors folded into TE's own weights (optional, guarded).

TE's ``Linear``, ``LayerNormLinear`` and ``GroupedLinear`` obtain their weights through the
overridable ``_get_weight_tensors()`` (TE 2.9 to 2.11, the range megatron-core 0.16.1 pins;
``../shared/TE_NOTES.md``): we return ``diag(a) W diag(gamma)`` there, a non-leaf that gets
correct gradients and is quantized by the module's own FP8 weight quantizer. So the fused
QKV / fc1 GEMM runs once, and TE's fused norm (and its fused FP8 cast) is kept:

* dense ``linear_qkv`` / ``linear_fc1``: a ``TELayerNormColumnParallelLinear`` subclass. Under
  HG (and ``none``) its ``layer_norm_weight`` is frozen at identity (1, or 0 under
  ``layernorm_zero_centered_gamma``): not trained, not decayed, not saved. Under ``shared`` it
  is the stock trainable gamma under the stock name.
* sequential and shared experts: a ``TEColumnParallelLinear`` subclass; grouped experts: a
  ``TEColumnParallelGroupedLinear`` subclass folding expert e's vectors into ``weight{e}``.
* the MoE pre-norm: TE's norm, scale-free (frozen identity) unless ``shared``.

The fold is :meth:`ScaleVecLinearMixin.forward_weight` (dense, per expert) and layers/grouped.py's
``stacked_forward_weight`` (grouped): the functions the local path runs and tests, once per
optimizer step when that is on (layers/fold_cache.py).
Tested against TE's real Python (2.11.0 with megatron-core 0.16.1, 2.17.1 with 0.19.2) over
megatron-core's real TE wrappers: tests/test_te_spec.py, on CPU through the test-only stand-in
for TE's compiled extension (testing/te_stub.py, testing/te_ops.py), TE's own fp32 forward and
backward included. FP8 is not exercised there (tools/te_check.py on a CUDA machine with TE).
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_scalevec import sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.layers.linear import ScaleVecLinearMixin


def _te_usable() -> bool:
    """TE's Python and its compiled extension (the pure-Python wheel alone cannot run)."""
    try:
        return all(importlib.util.find_spec(name) is not None
                   for name in ("transformer_engine", "transformer_engine_torch"))
    except (ImportError, ValueError):
        return False


HAVE_TE = _te_usable()
_CACHE: dict = {}

# (config attribute, why a folded module cannot run with it). TransformerConfig fields in
# megatron-core 0.16.1 and 0.19.2: delay_wgrad_compute, fp8_param; moe_single_grouped_weight
# from 0.19 (tests/test_te_spec.py checks each). use_te_op_fuser is a spec-builder argument
# (our specs never build TEFusedMLP) and use_megatron_fsdp / use_custom_fsdp are DDP-config
# fields: read here only if a caller sets them on the TransformerConfig.
_REFUSED = (
    ("delay_wgrad_compute", "TE's backward_dw recomputes the weight and writes .grad onto a "
                            "fresh tensor: the folded weight's gradient would be lost"),
    ("use_te_op_fuser", "TEFusedMLP reads linear_fc1.weight directly, bypassing the fold"),
    ("fp8_param", "FP8 primary weights: the folded weight is not a parameter TE can keep in FP8"),
    ("use_megatron_fsdp", "Megatron-FSDP shards the weights the fold reads whole"),
    ("use_custom_fsdp", "Megatron-FSDP shards the weights the fold reads whole"),
    ("moe_single_grouped_weight", "a single grouped weight has no per-expert weight{e} to fold"),
    ("single_grouped_weight", "a single grouped weight has no per-expert weight{e} to fold"),
)


def check_foldable(config, scalevec: ScaleVecConfig) -> None:
    """One clear line for each TE option a folded module cannot honour."""
    for name, why in _REFUSED:
        if getattr(config, name, False):
            raise NotImplementedError(f"scale vectors folded into TE weights do not support "
                                      f"config.{name}=True: {why}")
    if scalevec.apply_mode == "activation":
        raise ValueError("Transformer Engine linears fold the vectors into their weight: use "
                         "apply_mode 'weight' or 'auto' with transformer_impl="
                         "'transformer_engine'")


def pre_norm_has_gamma(scalevec: ScaleVecConfig) -> bool:
    """Whether the Pre-Norm keeps a trainable gamma (``shared``); HG / ``none``: scale-free."""
    return scalevec.vectors and not scalevec.hg


def freeze_identity(module: torch.nn.Module, name: str, zero_centered: bool) -> None:
    """Make ``module.<name>`` a frozen identity scale (1, or 0 when the kernel uses 1 + gamma),
    left out of state_dict (and so of sharded_state_dict) and not required on load."""
    param = getattr(module, name)
    with torch.no_grad():
        param.fill_(0.0 if zero_centered else 1.0)
    param.requires_grad_(False)

    def drop(mod, state, prefix, local_metadata):
        state.pop(prefix + name, None)
        return state

    def allow_missing(mod, keys):
        missing = [k for k in keys.missing_keys if k.endswith("." + name) or k == name]
        for key in missing:
            keys.missing_keys.remove(key)

    module._register_state_dict_hook(drop)
    module.register_load_state_dict_post_hook(allow_missing)


def _out_local(output_size: int, is_expert: bool) -> int:
    return output_size // sharding.group_size(sharding.tp_group(is_expert))


def make_te_classes(base: dict) -> dict:
    """Our TE classes over megatron-core's (``base``: its class names -> classes); tests pass
    stand-ins here. Keys: ln_column, column, grouped_column, norm, row, grouped_row, attention."""

    class _Folded(ScaleVecLinearMixin):
        def _init_folded(self, scalevec, branches, config, input_size, output_size, is_expert):
            check_foldable(config, scalevec)
            group = sharding.tp_group(is_expert)
            self._init_scale_vectors(scalevec, branches, config, input_size,
                                     _out_local(output_size, is_expert), is_expert, group,
                                     "weight")
            if self.has_scale_vectors:
                # fused wgrad accumulation writes weight.main_grad of the tensor TE is given;
                # that is our folded weight, so let autograd route the gradient instead.
                self.fuse_wgrad_accumulation = False

        def _get_weight_tensors(self):
            weights = super()._get_weight_tensors()
            if not self.has_scale_vectors:
                return weights
            return [self.forward_weight(weights[0])]

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            return self.scale_vector_sharded_state_dict(sd, prefix, sharded_offsets, metadata)

    class ScaleVecTELayerNormColumnParallelLinear(_Folded, base["TELayerNormColumnParallelLinear"]):
        """TE's fused norm + column linear; branch vectors folded, norm frozen unless shared."""

        def __init__(self, input_size, output_size, *, scalevec: ScaleVecConfig, branches: str,
                     config, **kwargs):
            if scalevec.vectors and not scalevec.hg and scalevec.parameterization != "plain":
                raise NotImplementedError(
                    f"{scalevec.to_string()} under TE: the fused norm's gamma is a plain TE "
                    "parameter; use the local path for OR / ER on a shared gamma")
            super().__init__(input_size, output_size, config=config, **kwargs)
            self._init_folded(scalevec, branches, config, input_size, output_size, False)
            if not pre_norm_has_gamma(scalevec):
                freeze_identity(self, "layer_norm_weight", config.layernorm_zero_centered_gamma)

    class ScaleVecTEColumnParallelLinear(_Folded, base["TEColumnParallelLinear"]):
        """TE column linear (sequential and shared experts) with branch vectors folded."""

        def __init__(self, input_size, output_size, *, scalevec: ScaleVecConfig, branches: str,
                     config, is_expert: bool = False, **kwargs):
            super().__init__(input_size, output_size, config=config, is_expert=is_expert,
                             **kwargs)
            self._init_folded(scalevec, branches, config, input_size, output_size, is_expert)

    class ScaleVecTENorm:
        """TE's norm (a factory, like megatron-core's TENorm); scale-free unless shared."""

        def __new__(cls, config, hidden_size, eps=1e-5, *, scalevec: ScaleVecConfig):
            norm = base["TENorm"](config=config, hidden_size=hidden_size, eps=eps)
            if not pre_norm_has_gamma(scalevec):
                freeze_identity(norm, "weight", config.layernorm_zero_centered_gamma)
            return norm

    return dict(ln_column=ScaleVecTELayerNormColumnParallelLinear,
                column=ScaleVecTEColumnParallelLinear, norm=ScaleVecTENorm,
                grouped_column=make_grouped_class(base["TEColumnParallelGroupedLinear"]),
                row=base["TERowParallelLinear"], grouped_row=base["TERowParallelGroupedLinear"],
                attention=base["TEDotProductAttention"], grouped_mlp=base["TEGroupedMLP"])


class _ExpertVectors(ScaleVecLinearMixin, torch.nn.Module):
    """One expert's fc1 vectors inside a grouped linear (same layout as a sequential fc1)."""

    def __init__(self, scalevec, config, input_size, out_local, group, weight):
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "weight", weight)  # read for `allreduce`, not registered
        self._init_scale_vectors(scalevec, "fc1", config, input_size, out_local, True, group,
                                 "weight")


def make_grouped_class(base):
    """``TEColumnParallelGroupedLinear`` subclass folding expert e's vectors into weight{e}
    (HG / DP and OR / ER; DNP needs a per-expert norm between the GEMMs TEGroupedMLP runs)."""

    class ScaleVecTEColumnParallelGroupedLinear(base):
        def __init__(self, num_gemms, input_size, output_size, *, scalevec: ScaleVecConfig,
                     config, **kwargs):
            check_foldable(config, scalevec)
            if scalevec.dnp or scalevec.expert_vectors == "shared" and \
                    (scalevec.hg or scalevec.dp):
                raise NotImplementedError(
                    f"{scalevec.to_string()} (expert_vectors={scalevec.expert_vectors}) with TE "
                    "grouped experts: DNP and shared expert vectors run on sequential experts "
                    "or on the local grouped experts (transformer_impl='local')")
            if scalevec.dp and config.add_bias_linear:
                raise ValueError("DP output-side vectors with a linear bias are not supported: "
                                 "set add_bias_linear=False")
            super().__init__(num_gemms, input_size, output_size, config=config, **kwargs)
            self.scalevec = scalevec  # read by layers/fold_cache.py
            group = sharding.tp_group(is_expert=True)
            self.scale_vectors = torch.nn.ModuleList(
                _ExpertVectors(scalevec, config, input_size, _out_local(output_size, True),
                               group, getattr(self, f"weight{e}")) for e in range(num_gemms))
            self.has_scale_vectors = self.scale_vectors[0].has_scale_vectors
            if self.has_scale_vectors:
                self.fuse_wgrad_accumulation = False

        def _get_weight_tensors(self):
            from megatron_scalevec.layers.grouped import stacked_forward_weight  # noqa

            weights = list(super()._get_weight_tensors())
            if not self.has_scale_vectors:
                return weights
            return list(stacked_forward_weight(self, _VectorsView(self.scale_vectors),
                                               weights).unbind(0))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """The vectors at their global expert ids, under the sequential experts' keys
            (TEGroupedMLP maps ``linear_fc1.`` to ``experts.linear_fc1.``)."""
            from megatron.core import parallel_state as ps  # noqa: PLC0415
            from megatron.core.dist_checkpointing.utils import (  # noqa: PLC0415
                replace_prefix_for_sharding,
            )

            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            for key in [k for k in sd if k.startswith(f"{prefix}scale_vectors.")]:
                del sd[key]
            n = len(self.scale_vectors)
            first = ps.get_expert_model_parallel_rank() * n
            total = ps.get_expert_model_parallel_world_size() * n
            copy = ps.get_expert_data_parallel_rank()
            for e, vectors in enumerate(self.scale_vectors):
                offsets = (*sharded_offsets, (len(sharded_offsets), first + e, total))
                local, part = f"{prefix}scale_vectors.{e}.", {}
                for dict_name in ("scale_in", "scale_out"):
                    for name, vec in getattr(vectors, dict_name).items():
                        part.update(vec.sharded_state_dict(f"{local}{dict_name}.{name}.",
                                                           offsets, metadata))
                replace_prefix_for_sharding(part, local, prefix)  # keys as sequential's
                for sh in part.values():
                    sh.replica_id = (*sh.replica_id[:2], copy)
                sd.update(part)
            return sd

    return ScaleVecTEColumnParallelGroupedLinear


class _VectorsView:
    def __init__(self, holders):
        self.experts = list(holders)
        self.groups, self.slots, self.rows = holders[0].groups, holders[0].slots, holders[0].rows

    def __getattr__(self, name):
        return getattr(self.experts[0], name)


def te_grouped_experts_spec(cfg: ScaleVecConfig):
    """megatron-core's TEGroupedMLP with our folded grouped fc1 (a ModuleSpec)."""
    from megatron.core.transformer.mlp import MLPSubmodules  # noqa: PLC0415
    from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: PLC0415

    parts = te_modules()
    fc1 = ModuleSpec(module=parts["grouped_column"], params={"scalevec": cfg})
    return ModuleSpec(module=parts["grouped_mlp"],
                      submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=parts["grouped_row"]))


def megatron_te_bases() -> dict:
    from megatron.core.extensions import transformer_engine as ext  # noqa: PLC0415
    from megatron.core.transformer.moe.experts import TEGroupedMLP  # noqa: PLC0415

    names = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
             "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TENorm",
             "TEDotProductAttention")
    return {**{n: getattr(ext, n) for n in names}, "TEGroupedMLP": TEGroupedMLP}


def te_modules() -> dict:
    """Our TE classes over megatron-core's (built once); a clear error without TE."""
    if not HAVE_TE:
        raise ImportError("transformer_impl='transformer_engine' needs Transformer Engine "
                          "(pip install 'megatron_scalevec[te]' on a CUDA machine); use "
                          "transformer_impl='local' otherwise")
    if not _CACHE:
        _CACHE.update(make_te_classes(megatron_te_bases()))
    return _CACHE
