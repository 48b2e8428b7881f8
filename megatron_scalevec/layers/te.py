"""Transformer Engine parts with scale vectors folded into TE's own weights (optional, guarded).

TE's ``Linear``, ``LayerNormLinear`` and ``GroupedLinear`` obtain their weights through
``_get_weight_tensors()``, a private method (TE has no public hook that transforms a weight
before its GEMM; checked on TE 2.11.0 with megatron-core 0.16.1 and 2.17.1 with 0.19.2 by
tests/layers/test_te_spec.py and test_te_grouped.py; ``../shared/TE_NOTES.md``): we return
``diag(a) W diag(gamma)`` there, a non-leaf that gets correct gradients and is quantized by the
module's own FP8 weight quantizer. So the fused QKV / fc1 GEMM runs once, and TE's fused norm
(and its fused FP8 cast) is kept:

* dense ``linear_qkv`` / ``linear_fc1``: a ``TELayerNormColumnParallelLinear`` subclass. Under
  HG (and ``none``) its ``layer_norm_weight`` is frozen at identity (1, or 0 under
  ``layernorm_zero_centered_gamma``): not trained, not decayed, not saved. Under ``shared`` it
  is the stock trainable gamma under the stock name, marked an Input-Norm vector
  (``parameterizations.mark``) for the optimizer's rules (IWD, the vectors' LR). A LayerNorm's
  ``layer_norm_bias`` stays trainable (``ScaleVecConfig.layernorm_bias``, as the local norms).
* sequential and shared experts: a ``TEColumnParallelLinear`` subclass; grouped experts:
  layers/te_grouped.py.
* the MoE pre-norm (and the ``shared`` final norm): TE's LayerNorm or RMSNorm, scale-free
  (frozen identity) unless ``shared``.

This module is the behaviour (:class:`FoldedTELinear`, the checks and helpers) and imports no
TE; the classes over megatron-core's TE wrappers are layers/te_classes.py.

The fold is layers/fold.py's, the one the local path runs, evaluated in every forward through
the module's own call. TE keeps the weight it is given for its backward (and pins it on
``ctx``): the folded weight's storage is released after the module's forward and refolded in
place right before its backward (``fold.FoldedWeights``), so nothing weight-sized is kept per
micro-batch in flight, as on the local path. Under TE's FP8 its GEMMs read only quantized
copies: the fold runs only where TE quantizes the weight (:func:`te_reads_weight`, TE's own
rule: the step's first micro-batch under megatron-core's schedule), TE gets an unread W_eff of
the right shape and dtype elsewhere, and nothing is refolded for the FP8 backward (except under
TE 2.17's ``backward_override='high_precision'``, whose backward reads the weight).
Tested against TE's real Python (2.11.0 with megatron-core 0.16.1, 2.17.1 with 0.19.2) over
megatron-core's real TE wrappers: tests/layers/test_te_spec.py, on CPU through the test-only
stand-in for TE's compiled extension (scalevec_testing/te_stub.py, te_ops.py), TE's own fp32 and
bf16 forward and backward included; FP8 (delayed and current scaling) through TE's own FP8 Python in
tests/layers/test_te_fp8.py; on a CUDA machine with TE, tools/te_check.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys

import torch

from megatron_scalevec import parameterizations, sharding
from megatron_scalevec.config import ScaleVecConfig
from megatron_scalevec.declared import Declared
from megatron_scalevec.layers import fold
from megatron_scalevec.layers.linear import ScaleVecLinearMixin


def _te_usable() -> bool:
    """TE's Python and its compiled extension (the pure-Python wheel alone cannot run)."""
    try:
        return all(importlib.util.find_spec(name) is not None
                   for name in ("transformer_engine", "transformer_engine_torch"))
    except (ImportError, ValueError):
        return False


HAVE_TE = _te_usable()

# (config attribute, why a folded module cannot run with it). TransformerConfig fields in
# megatron-core 0.16.1 and 0.19.2: delay_wgrad_compute, fp8_param; moe_single_grouped_weight
# and use_transformer_engine_op_fuser from 0.19 (tests/layers/test_te_spec.py checks each).
# use_te_op_fuser is a spec-builder argument (our specs never build TEFusedMLP) and
# use_megatron_fsdp / use_custom_fsdp are DDP-config fields: read here only if a caller sets
# them on the TransformerConfig.
_REFUSED = (
    ("delay_wgrad_compute", "TE's backward_dw recomputes the weight and writes .grad onto a "
                            "fresh tensor: the folded weight's gradient would be lost"),
    ("use_te_op_fuser", "TEFusedMLP reads linear_fc1.weight directly, bypassing the fold"),
    ("use_transformer_engine_op_fuser", "TE's fused ops (TEFusedMLP, the fused grouped MLP) "
                                        "read the weights directly, bypassing the fold"),
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


def freeze_scale_free(module: torch.nn.Module, weight: str, bias: str, config,
                      scalevec: ScaleVecConfig) -> None:
    """TE's norm ``module`` as the strategy reads it: its ``weight`` a frozen identity (1, or 0
    when the kernel uses 1 + gamma) unless the Pre-Norm keeps its gamma (``shared``); its
    ``bias`` (LayerNorm) a frozen 0 unless ``layernorm_bias='stock'`` keeps it trainable, as
    the local norms do (norms.py): ``N(x) + beta`` before the folded branch vectors."""
    if not pre_norm_has_gamma(scalevec):
        _freeze(module, weight, 0.0 if config.layernorm_zero_centered_gamma else 1.0)
    else:  # the Pre-Norm (or final norm) gamma: a stock (plain) Input-Norm vector
        stock = parameterizations.stock_name()
        parameterizations.mark(getattr(module, weight), stock,
                               parameterizations.get(stock).parts[0].name, "input")
        module._scalevec_gamma = weight  # declared by te_norm_gamma
    if getattr(module, bias, None) is not None and scalevec.layernorm_bias != "stock":
        _freeze(module, bias, 0.0)


def te_norm_gamma(module: torch.nn.Module, target=None):
    """The declaration (declared.py) of TE's norm gamma that :func:`freeze_scale_free` left
    trainable (``shared``): a plain TE parameter, an Input-Norm vector; else nothing."""
    name = getattr(module, "_scalevec_gamma", None)
    if name is not None:
        yield Declared(name, getattr(module, name), "input", "pre", target)


def _freeze(module: torch.nn.Module, name: str, value: float) -> None:
    """``module.<name>`` filled with ``value`` and frozen, left out of state_dict (and so of
    sharded_state_dict) and not required on load."""
    param = getattr(module, name)
    with torch.no_grad():
        param.fill_(value)
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


def release_output(folds: fold.FoldedWeights, out):
    """A TE module's output ``(out, bias)`` (or ``out``) through ``folds``' refold point."""
    if isinstance(out, tuple):
        return (folds.release_until_backward(out[0]), *out[1:])
    return folds.release_until_backward(out)


@contextlib.contextmanager
def fold_checked(module):
    """Around a folded TE module's forward: its first one fails loudly unless TE asked our
    ``_get_weight_tensors()`` (which sets ``module._fold_seen``) for the weights it multiplied;
    a TE build that reads its weights another way would train without the scale vectors."""
    if module._fold_checked:
        yield
        return
    module._fold_seen = False
    yield
    if not module._fold_seen:
        raise RuntimeError(
            f"{type(module).__name__}: this Transformer Engine did not call "
            f"_get_weight_tensors() in its forward, where the scale vectors are folded into the "
            f"weight (TE 2.11.0 and 2.17.1 do): the vectors would not be applied; use a checked "
            f"TE version or transformer_impl='local'")
    module._fold_checked = True


def local_output_size(output_size: int, is_expert: bool) -> int:
    """A column-parallel linear's output rows on this rank (dense or expert TP)."""
    return output_size // sharding.group_size(sharding.tp_group(is_expert))


def _first_microbatch(module):
    """The ``is_first_microbatch`` megatron-core's TE wrapper is about to pass TE (its
    ``forward``, megatron-core 0.16.1 and 0.19.2): None where the transpose cache is off."""
    if getattr(module, "disable_parameter_transpose_cache", False):
        return None
    return getattr(module, "is_first_microbatch", None)


def te_reads_weight(module, x, cache_names) -> tuple:
    """(forward, backward): whether the TE forward about to run reads the values of the weights
    ``_get_weight_tensors()`` hands it, and whether its backward does. Without FP8 both do. Under
    per-tensor FP8 TE's GEMMs read only the quantized copies, so the forward reads the weights
    only where it quantizes them (TE's own rule, 2.11 ``get_weight_workspace``, 2.17.1
    ``quantize_weight`` / ``_is_weight_workspace_valid``; the usage each module kind sets in
    ``layernorm_linear.py``, ``linear.py``, ``grouped_linear.py``): no step cache
    (``is_first_microbatch`` None), the step's first micro-batch, a CUDA-graph skip flag, a
    workspace not cached yet, or one cached without the transpose a Hopper GEMM now needs. The
    backward reads them only under 2.17's ``backward_override='high_precision'`` (then both
    read them on every micro-batch, as without FP8). Private TE
    state read: ``FP8GlobalStateManager``, ``module._fp8_workspaces``, the recompute phase."""
    quant = sys.modules.get("transformer_engine.pytorch.quantization")
    state = getattr(quant, "FP8GlobalStateManager", None)
    if state is None or not state.is_fp8_enabled():
        return True, True
    recipe = state.get_fp8_recipe()
    if not (recipe.delayed() or recipe.float8_current_scaling()):
        return True, True  # other recipes are refused (config.UNSUPPORTED): assume reads
    override = getattr(recipe, "backward_override", None)
    if override == "high_precision":  # its backward multiplies the saved weight: folded
        return True, True
    first = _first_microbatch(module)
    if first is None or first or state.fp8_graph_capturing() or getattr(module, "is_fsdp2", 0):
        return True, False
    te = sys.modules["transformer_engine.pytorch"]
    if any(c.__name__ == "LayerNormLinear" for c in type(module).__mro__):
        transpose = torch.is_grad_enabled() and override is None
    else:
        dist = importlib.import_module("transformer_engine.pytorch.distributed")
        transpose = (torch.is_grad_enabled() and x.requires_grad and override is None) or (
            dist.is_fp8_activation_recompute_enabled()
            and not dist.in_fp8_activation_recompute_phase())
    transpose = transpose and not te.utils.is_non_tn_fp8_gemm_supported()
    for name in cache_names:
        ws = module._fp8_workspaces.get(name)
        if ws is None or type(ws).__name__ not in ("Float8Tensor", "Float8TensorStorage") or (
                transpose and ws._transpose is None):
            return True, False
    return False, False


@contextlib.contextmanager
def unread_checked(module, read: bool, cache_names):
    """Around a TE forward handed unread weights (:func:`te_reads_weight` said TE would not
    quantize them): fails loudly if TE made a new FP8 workspace anyway (a TE whose rule
    differs), instead of training on a copy quantized from unread values."""
    before = None if read else [module._fp8_workspaces.get(n) for n in cache_names]
    yield
    if before is not None and any(module._fp8_workspaces.get(n) is not b
                                  for n, b in zip(cache_names, before)):
        raise RuntimeError(f"{type(module).__name__}: Transformer Engine re-quantized a weight "
                           f"where this TE version's rule said it reuses its FP8 copy; the "
                           f"folded weight was not computed (layers/te.py te_reads_weight)")


def require_te() -> None:
    """One clear error where Transformer Engine is asked for and not usable."""
    if not HAVE_TE:
        raise ImportError("transformer_impl='transformer_engine' needs Transformer Engine "
                          "(pip install 'megatron_scalevec[te]' on a CUDA machine); use "
                          "transformer_impl='local' otherwise")


class FoldedTELinear(ScaleVecLinearMixin):
    """A TE linear with its branch vectors folded into its weight (module doc): above a
    megatron-core TE linear in the MRO (layers/te_classes.py), ``_init_folded`` after its
    ``__init__``."""

    def _init_folded(self, scalevec, branches, config, input_size, output_size, is_expert):
        check_foldable(config, scalevec)
        group = sharding.tp_group(is_expert)
        self._init_scale_vectors(scalevec, branches, config, input_size,
                                 local_output_size(output_size, is_expert), is_expert, group,
                                 "weight")
        self._folds = fold.FoldedWeights()
        self._step_map, self._step = fold.StepMap(), None
        self._fused_accumulation = self.fuse_wgrad_accumulation  # as configured
        self._fold_checked = self._fold_seen = False  # fold_checked

    def forward(self, x, *args, **kwargs):
        if not self.has_scale_vectors:
            return super().forward(x, *args, **kwargs)
        # Under megatron-core's DDP and calculator G = dL/dW_eff is summed in W's main_grad
        # (by TE's fused wgrad accumulation where configured: W_eff carries W's main_grad)
        # and the step's last micro-batch maps it (fold.StepMap); elsewhere autograd routes
        # G through the fold. TE reads the flag in each forward (checked on 2.11.0, 2.17.1).
        self._step = self._step_map.mode(self.weight)
        self.fuse_wgrad_accumulation = self._fused_accumulation and self._step is not None
        # folded only where TE reads W_eff (under FP8: where it quantizes it)
        read = te_reads_weight(self, x, ("weight",))
        with self._folds.plan(*read), fold_checked(self), \
                unread_checked(self, read[0], ("weight",)):
            # TE keeps W_eff: released until backward
            return release_output(self._folds, super().forward(x, *args, **kwargs))

    def _get_weight_tensors(self):  # TE private, checked on 2.11.0 and 2.17.1 (above)
        weights = super()._get_weight_tensors()
        if not self.has_scale_vectors:
            return weights
        self._fold_seen = True
        row, col = self.fold_vectors(self._step)
        if self._step is None:
            return [self._folds([weights[0]], fold.single(row), fold.single(col),
                                self.fold_layout)[0]]
        return self._folds.once_per_step(weights[:1], fold.single(row), fold.single(col),
                                         self.fold_layout, (self._step, self._step_map,
                                                            self.fuse_wgrad_accumulation))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return self.scale_vector_sharded_state_dict(sd, prefix, sharded_offsets, metadata)
