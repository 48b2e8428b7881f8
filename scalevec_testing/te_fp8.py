"""Test-only torch versions of the Transformer Engine extension functions of its per-tensor FP8
path (delayed scaling, ``Float8Quantizer``; current scaling, ``Float8CurrentScalingQuantizer``),
so that TE's own Python (quantizers, ``Float8Tensor``, weight workspaces, ``fp8_autocast``, the
delayed-scaling amax history) runs with our layers on CPU. Read from TE 2.11 and 2.17.1
(``pytorch/csrc/extensions/cast.cpp``, ``csrc/quantizer.cpp``, ``common/recipe``); written here,
not copied. Installed on te_stub's stand-in extension beside te_ops.

FP8 values are torch ``float8_e4m3fn`` / ``float8_e5m2`` stored as uint8, as TE stores them.
Casts saturate at the format's largest finite value as TE's kernels do (torch's CPU cast
overflows e5m2 to inf). An FP8 GEMM is the dequantized operands' fp32 matmul: the same products
a GPU's FP8 tensor cores accumulate in fp32, without their split-accumulator order. Block
scaling, MXFP8 and NVFP4 quantizers raise: their layouts are not implemented here.
"""

from __future__ import annotations

import importlib
import sys

import torch

_TORCH = {"kFloat32": torch.float32, "kFloat16": torch.float16, "kBFloat16": torch.bfloat16,
          "kInt32": torch.int32, "kByte": torch.uint8}


def torch_dtype(te_dtype, default):
    """A TE dtype enum (or a torch dtype, or None: ``default``) as a torch dtype."""
    if te_dtype is None:
        return default
    if isinstance(te_dtype, torch.dtype):
        return te_dtype
    return _TORCH[te_dtype.name]


_FORMATS = {"kFloat8E4M3": torch.float8_e4m3fn, "kFloat8E5M2": torch.float8_e5m2}
_PER_TENSOR = ("Float8Quantizer", "Float8CurrentScalingQuantizer")


def _te(name: str):
    return importlib.import_module(f"transformer_engine.pytorch.{name}")


_STORAGE = "transformer_engine.pytorch.tensor.storage.float8_tensor_storage"


def _storage_class():
    return importlib.import_module(_STORAGE).Float8TensorStorage


def is_fp8(t) -> bool:
    """A per-tensor FP8 tensor of TE's (never, where TE's Python was not imported)."""
    storage = sys.modules.get(_STORAGE)
    return storage is not None and isinstance(t, storage.Float8TensorStorage)


def _format(te_dtype) -> torch.dtype:
    if te_dtype.name not in _FORMATS:
        raise NotImplementedError(f"CPU stand-in FP8: format {te_dtype.name} is not implemented")
    return _FORMATS[te_dtype.name]


def fp8_max(te_dtype) -> float:
    return float(torch.finfo(_format(te_dtype)).max)


def _encode(scaled: torch.Tensor, te_dtype) -> torch.Tensor:
    """fp32 values already multiplied by the scale -> saturated FP8 bits (uint8)."""
    top = fp8_max(te_dtype)
    return scaled.clamp(-top, top).to(_format(te_dtype)).view(torch.uint8)


def _decode(bits: torch.Tensor, te_dtype) -> torch.Tensor:
    return bits.view(_format(te_dtype)).float()


def _non_tn() -> bool:
    """Whether the claimed GPU takes FP8 GEMMs in any layout (then TE keeps no transpose)."""
    return _te("utils").is_non_tn_fp8_gemm_supported()


def _check(quantizer) -> str:
    kind = type(quantizer).__name__
    if kind not in _PER_TENSOR:
        raise NotImplementedError(f"CPU stand-in FP8: {kind} (block / MX / NVFP4 scaling) is not "
                                  "implemented; per-tensor delayed and current scaling are")
    return kind


def _transpose_of(bits: torch.Tensor) -> torch.Tensor:
    """TE's column-wise copy: the last dimension first, the rest flattened behind it."""
    return bits.reshape(-1, bits.shape[-1]).t().contiguous().reshape(
        bits.shape[-1], *bits.shape[:-1])


def _usages(quantizer) -> tuple:
    """(row-wise data, transpose) a quantizer's output holds: the data unless only a transpose
    is used, a transpose where the GPU needs one for column-wise use."""
    return (quantizer.rowwise_usage or _non_tn(), quantizer.columnwise_usage and not _non_tn())


def _new_output(quantizer, shape, fake_dtype, device):
    """The tensor TE's ``create_tensor`` builds (:func:`_usages`), ``Float8TensorStorage`` for
    internal quantizers."""
    with_data, with_t = _usages(quantizer)
    data = torch.empty(shape, dtype=torch.uint8, device=device) if with_data else None
    t = torch.empty([shape[-1], *shape[:-1]], dtype=torch.uint8, device=device) if with_t \
        else None
    kw = dict(data=data, fp8_scale_inv=torch.empty(1, dtype=torch.float32, device=device),
              fp8_dtype=quantizer.dtype, data_transpose=t, quantizer=quantizer)
    if quantizer.internal:
        return _storage_class()(**kw)
    return _te("tensor.float8_tensor").Float8Tensor(shape=list(shape), dtype=fake_dtype, **kw)


def _coerce(quantizer, out):
    """An existing output's buffers made to match the quantizer's usages (TE's
    ``convert_and_update_tensor``)."""
    if not isinstance(out, _te("tensor.float8_tensor").Float8Tensor):
        raise TypeError("CPU stand-in FP8: a per-tensor quantizer writes into a Float8Tensor, "
                        f"got {type(out).__name__}")
    shape = list(out._data.shape) if out._data is not None else \
        [*out._transpose.shape[1:], out._transpose.shape[0]]
    need_data, need_t = _usages(quantizer)
    device = (out._data if out._data is not None else out._transpose).device
    if need_data and out._data is None:
        out._data = torch.empty(shape, dtype=torch.uint8, device=device)
    elif not need_data:
        out._data = None
    if need_t and out._transpose is None:
        out._transpose = torch.empty([shape[-1], *shape[:-1]], dtype=torch.uint8, device=device)
    elif not need_t:
        out._transpose = None
    out._transpose_invalid = not need_t
    out._fp8_dtype = quantizer.dtype
    return out


def _scale(top: float, amax: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``top / amax``; ``fallback`` where amax is 0 or not finite, fp32's largest value where the
    quotient overflows (both recipes' rule)."""
    scale = torch.where((amax > 0) & torch.isfinite(amax), top / amax, fallback)
    return torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max),
                       scale)


def _current_scale(quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Current scaling's scale from this tensor's amax (all-reduced over the quantizer's group
    first, where it asks): largest FP8 value / max(amax, epsilon), 1 where that is 0 or not
    finite, optionally rounded down to a power of 2. TE 2.11's quantizer holds the amax and
    scale buffers the kernel writes; from 2.15 the kernel keeps them to itself."""
    amax = amax.float().clone()
    if quantizer.with_amax_reduction:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                     group=quantizer.amax_reduction_group)
    a = amax.clamp_min(quantizer.amax_epsilon)
    scale = _scale(fp8_max(quantizer.dtype), a, torch.ones_like(a))
    if quantizer.force_pow_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    for name, value in (("amax", amax), ("scale", scale)):
        if isinstance(getattr(quantizer, name, None), torch.Tensor):
            getattr(quantizer, name).copy_(value.reshape(getattr(quantizer, name).shape))
    return scale


def cast(x: torch.Tensor, quantizer, output=None, noop_flag=None, fake_dtype=None):
    """The one FP8 cast behind ``quantize``, ``split_quantize``, ``bgrad_quantize`` and the norms'
    output quantizer; ``fake_dtype``: the nominal dtype of a new ``Float8Tensor``."""
    kind = _check(quantizer)
    if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
        return output  # TE's kernels skip their whole work on a set flag (CUDA graphs)
    xf = x.contiguous().float()
    out = _coerce(quantizer, output) if output is not None else \
        _new_output(quantizer, list(x.shape), fake_dtype or x.dtype, x.device)
    amax = xf.abs().amax().reshape(1) if xf.numel() else xf.new_zeros(1)
    if kind == "Float8CurrentScalingQuantizer":
        scale = _current_scale(quantizer, amax)
    else:  # delayed: the cast records its amax into the history slot it was given
        torch.maximum(quantizer.amax, amax.reshape(quantizer.amax.shape), out=quantizer.amax)
        scale = quantizer.scale
    bits = _encode(xf * scale.float(), quantizer.dtype)
    if out._data is not None:
        out._data.copy_(bits.reshape(out._data.shape))
    if out._transpose is not None:
        out._transpose.copy_(_transpose_of(bits))
        out._transpose_invalid = False
    out._scale_inv.copy_(1.0 / scale.float().reshape(out._scale_inv.shape))
    return out


def quantize(tensor, quantizer, output=None, noop_flag=None):
    """``tex.quantize``: cast with the quantizer's scale (delayed) or this tensor's own (current),
    into ``output`` where given."""
    return cast(tensor, quantizer, output, noop_flag)


def split_quantize(tensor, split_sections, quantizer_list, disable_bulk_allocation=False):
    """``tex.split_quantize``: row blocks of ``tensor``, each with its own quantizer (2.17's
    ``disable_bulk_allocation`` only chooses how the outputs are allocated)."""
    return [cast(part, q) for part, q in
            zip(torch.split(tensor, list(split_sections)), quantizer_list)]


def bgrad_quantize(grad, quantizer):
    """``tex.bgrad_quantize``: (bias gradient over tokens, quantized gradient)."""
    bias_grad = grad.reshape(-1, grad.shape[-1]).float().sum(0).to(grad.dtype)
    return bias_grad, cast(grad, quantizer)


def value(t) -> torch.Tensor:
    """A quantized tensor's logical values in fp32 (from its data, else its transpose)."""
    if t._data is not None:
        return _decode(t._data, t._fp8_dtype) * t._scale_inv.float()
    bits = t._transpose
    logical = bits.reshape(bits.shape[0], -1).t().reshape(*bits.shape[1:], bits.shape[0])
    return _decode(logical, t._fp8_dtype) * t._scale_inv.float()


def dequantize(tensor, otype):
    """``tex.dequantize``: FP8 -> ``otype``."""
    return value(tensor).to(torch_dtype(otype, torch.float32))


def fp8_transpose(data, fp8_dtype, out=None):
    """``tex.fp8_transpose``: the column-wise copy of FP8 bits."""
    _format(fp8_dtype)
    t = _transpose_of(data)
    if out is None:
        return t
    out.copy_(t.reshape(out.shape))
    return out


def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer, amax_histories, scales,
                                                amax_compute_algo, fp8_dtype, margin):
    """Delayed scaling's update: each reduced amax into its history's newest slot, the scale
    from the history's max (or newest), the history rolled by one and its newest slot zeroed."""
    if amax_compute_algo not in ("max", "most_recent"):
        raise NotImplementedError(f"CPU stand-in FP8: amax_compute_algo={amax_compute_algo!r}")
    top, start = fp8_max(fp8_dtype), 0
    for history, scale in zip(amax_histories, scales):
        n = history.shape[-1]
        history[0].copy_(amax_reduction_buffer[start:start + n])
        start += n
        amax = history.amax(0) if amax_compute_algo == "max" else history[0].clone()
        scale.copy_(_scale(top / 2.0 ** margin, amax, scale))
        history.copy_(torch.roll(history, -1, 0))
        history[0].zero_()


def _row_blocks(src, dst, src_splits, dst_splits) -> None:
    """Group i's first min(src, dst) rows copied from its block in ``src`` to its block in
    ``dst``; the rest of ``dst``'s block zero."""
    s = d = 0
    for m, n in zip(src_splits, dst_splits):
        k = min(m, n)
        dst[d:d + k].copy_(src[s:s + k])
        dst[d + k:d + n].zero_()
        s, d = s + m, d + n


def fused_multi_row_padding(inp, out, m_splits, padded_m_splits):
    """``tex.fused_multi_row_padding``: each expert's rows padded with zero rows to the FP8
    GEMM's alignment (TE's Fp8Padding, megatron-core's grouped experts under FP8)."""
    _row_blocks(inp, out, m_splits, padded_m_splits)


def fused_multi_row_unpadding(inp, out, padded_m_splits, m_splits):
    """``tex.fused_multi_row_unpadding``: the padding rows dropped again."""
    _row_blocks(inp, out, padded_m_splits, m_splits)


FUNCTIONS = (quantize, split_quantize, bgrad_quantize, dequantize, fp8_transpose,
             fused_amax_and_scale_update_after_reduction, fused_multi_row_padding,
             fused_multi_row_unpadding)
