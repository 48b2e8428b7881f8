"""Test-only torch versions of the Transformer Engine extension functions of its per-tensor FP8
path (delayed scaling, ``Float8Quantizer``; current scaling, ``Float8CurrentScalingQuantizer``),
so that TE's own Python (quantizers, ``Float8Tensor``, weight workspaces, ``fp8_autocast``, the
delayed-scaling amax history) runs with our layers on CPU. Each follows the CUDA kernel a Hopper
user runs, not TE's Python fallback, read from TE's C++ at v2.11 and v2.17.1 (the rules quoted are
the same in both; written here, not copied):

* delayed scaling's bulk update: ``common/recipe/delayed_scaling.cu`` ``kernel_bulk``
  (:func:`fused_amax_and_scale_update_after_reduction`);
* current scaling's scale: ``common/recipe/recipe_common.cuh`` ``compute_scale_from_amax``,
  its amax ``common/recipe/current_scaling.cu`` ``amax_kernel`` (:func:`current_scale`);
* casts: ``pytorch/csrc/quantizer.cpp`` (``Float8Quantizer::quantize``,
  ``Float8CurrentScalingQuantizer::quantize_impl``), the fused norms
  ``pytorch/csrc/extensions/normalization.cpp`` (:func:`norm_output`);
* GEMM operands: ``common/gemm/cublaslt_gemm.cu`` ``CanonicalizeGemmInput`` with
  ``pytorch/csrc/type_converters.cpp`` (:func:`gemm_operand`): on Hopper FP8 GEMMs are TN only,
  so a GEMM reads an operand's column-wise (transposed) copy where TE's backward asks for it.

FP8 values are torch ``float8_e4m3fn`` / ``float8_e5m2`` stored as uint8, as TE stores them.
Casts round to nearest even and saturate at the format's largest finite value
(``__NV_SATFINITE``; torch's CPU cast alone overflows e5m2 to inf). An FP8 GEMM is the selected
operands' dequantized fp32 matmul: the products a Hopper tensor core forms exactly, summed in
fp32 in another order than its (fast or split) accumulator; ``tools/gpu_check.sh`` measures the
gap against ``torch._scaled_mm``. Block scaling, MXFP8 and NVFP4 quantizers raise.
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


def non_tn() -> bool:
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
    return (quantizer.rowwise_usage or non_tn(), quantizer.columnwise_usage and not non_tn())


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


def create_empty_quantized_tensor(quantizer, shape, dtype, device, pin_memory=False):
    """``tex.create_empty_quantized_tensor`` (TE >= 2.17): ``Quantizer.make_empty``'s tensor,
    on the CPU (TE asks for its CUDA device)."""
    _check(quantizer)
    return _new_output(quantizer, list(shape), dtype, torch.device("cpu"))


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


_FLT_MAX = torch.finfo(torch.float32).max


def _amax(x: torch.Tensor) -> torch.Tensor:
    """[1] fp32: max |x| as TE's kernels reduce it (``fmaxf`` / ``__hmax`` from 0: NaN ignored,
    0 for an empty or all-NaN tensor)."""
    a = x.reshape(-1).abs().float()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    return (a.amax() if a.numel() else a.new_zeros(())).clamp_min(0).reshape(1)


def _fmax(into: torch.Tensor, amax: torch.Tensor) -> None:
    """``atomicMaxFloat(into, amax)`` (a NaN on either side yields the other)."""
    amax = amax.reshape(into.shape)
    into.copy_(torch.where(torch.isnan(into), amax, torch.fmax(into, amax)))


def compute_scale_from_amax(amax: torch.Tensor, fp8_top: float, force_pow_2: bool,
                            epsilon: float) -> torch.Tensor:
    """recipe_common.cuh ``compute_scale_from_amax`` (value_for_inf: FLT_MAX): amax floored at
    epsilon (a NaN passes the floor), scale 1 where that is inf, 0 or NaN, else ``top / amax``
    rounded to nearest, FLT_MAX where it overflows, then optionally its mantissa dropped (a
    power of 2 not above it)."""
    amax = amax.float()
    amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    bad = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    scale = torch.where(bad, torch.ones_like(amax), torch.full_like(amax, fp8_top) / amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLT_MAX), scale)
    if force_pow_2:  # scale_bits &= 0xFF800000 (sign and exponent kept)
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def current_scale(quantizer, amax: torch.Tensor) -> torch.Tensor:
    """Current scaling's scale (``quantize_impl``): this tensor's amax, all-reduced (MAX) over
    the quantizer's group where it asks, then :func:`compute_scale_from_amax`. TE 2.11's
    quantizer holds the amax and scale buffers the kernels write; from 2.15 they are the
    kernel's own."""
    amax = amax.float().clone()
    if quantizer.with_amax_reduction:
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                     group=quantizer.amax_reduction_group)
    scale = compute_scale_from_amax(amax, fp8_max(quantizer.dtype),
                                    bool(quantizer.force_pow_2_scales),
                                    float(quantizer.amax_epsilon))
    for name, value in (("amax", amax), ("scale", scale)):
        if isinstance(getattr(quantizer, name, None), torch.Tensor):
            getattr(quantizer, name).copy_(value.reshape(getattr(quantizer, name).shape))
    return scale


def cast(x: torch.Tensor, quantizer, output=None, noop_flag=None, fake_dtype=None):
    """The one FP8 cast behind ``quantize``, ``split_quantize``, ``bgrad_quantize`` and the norms'
    output quantizer; ``fake_dtype``: the nominal dtype of a new ``Float8Tensor``. An empty
    input is left as it is (both quantizers return before any kernel)."""
    kind = _check(quantizer)
    if noop_flag is not None and float(noop_flag.reshape(-1)[0]) == 1.0:
        return output  # TE's kernels skip their whole work when the flag is 1 (CUDA graphs)
    out = _coerce(quantizer, output) if output is not None else \
        _new_output(quantizer, list(x.shape), fake_dtype or x.dtype, x.device)
    if x.numel() == 0:
        return out
    xf = x.contiguous().float()
    if kind == "Float8CurrentScalingQuantizer":
        scale = current_scale(quantizer, _amax(xf))
    else:  # delayed: the cast atomically maxes its amax into the history slot it was given
        _fmax(quantizer.amax, _amax(xf))
        scale = quantizer.scale
    bits = _encode(xf * scale.float(), quantizer.dtype)
    if out._data is not None:
        out._data.copy_(bits.reshape(out._data.shape))
    if out._transpose is not None:
        out._transpose.copy_(_transpose_of(bits))
        out._transpose_invalid = False
    out._scale_inv.copy_(1.0 / scale.float().reshape(out._scale_inv.shape))
    return out


def norm_output(y: torch.Tensor, ln_out, quantizer, out_dtype: torch.dtype):
    """A fused norm's FP8 output from its fp32 result ``y``: delayed scaling fully fused (``y``
    scaled and cast, its amax taken before the scale); current scaling (FUSED_NORM_AMAX_FP8)
    writes ``y`` in the output dtype first and quantizes that, amax included."""
    if type(quantizer).__name__ == "Float8CurrentScalingQuantizer":
        y = y.to(out_dtype)
    return cast(y, quantizer, ln_out, fake_dtype=out_dtype)


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


def logical_shape(t) -> list:
    """A quantized tensor's logical shape (its data's, else its transpose's turned back)."""
    if t._data is not None:
        return list(t._data.shape)
    return [*t._transpose.shape[1:], t._transpose.shape[0]]


def value(t) -> torch.Tensor:
    """A quantized tensor's logical values in fp32 (from its data, else its transpose)."""
    if t._data is not None:
        return _decode(t._data, t._fp8_dtype) * t._scale_inv.float()
    bits = t._transpose
    logical = bits.reshape(bits.shape[0], -1).t().reshape(*bits.shape[1:], bits.shape[0])
    return _decode(logical, t._fp8_dtype) * t._scale_inv.float()


def gemm_operand(t, trans: bool, side: str, non_tn: bool) -> tuple:
    """(values [rows, cols] in fp32, which copy: "rowwise" / "columnwise") that cuBLASLt reads
    for a per-tensor FP8 GEMM operand ``t`` (``side``: "A" or "B", ``trans``: its transpose
    flag), as ``CanonicalizeGemmInput`` selects it. A copy exists where its buffer is set and,
    for the transpose, ``_transpose_invalid`` is False (``NVTETensorFromFloat8Tensor``). Hopper
    (``non_tn`` False) multiplies TN only: A untransposed and B transposed are read from their
    column-wise copy, which must exist; the other cases from the row-wise data. Non-TN GPUs read
    the row-wise data, the column-wise copy only where no data exists. Raises as TE does
    ("missing column-wise usage"; the row-wise case, a null pointer there, raises here too)."""
    has_data = t._data is not None
    has_t = t._transpose is not None and not t._transpose_invalid
    if not (has_data or has_t):
        raise RuntimeError("No data found for FP8 Tensor.")
    if non_tn:
        columnwise = not has_data
    else:
        columnwise = (not trans) if side == "A" else trans
    if columnwise and not has_t:
        raise RuntimeError(f"Input {side} is missing column-wise usage")
    if not columnwise and not has_data:
        raise RuntimeError(f"Input {side} is missing row-wise usage")
    if columnwise:
        bits = t._transpose
        logical = bits.reshape(bits.shape[0], -1).t()
    else:
        logical = t._data.reshape(-1, t._data.shape[-1])
    return _decode(logical, t._fp8_dtype) * t._scale_inv.float(), \
        "columnwise" if columnwise else "rowwise"


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
    """Delayed scaling's update as ``kernel_bulk`` computes it, per amax slot (history column):
    the amax is the reduced one if non-zero, else the history's newest; only a non-zero amax
    rolls the history (the oldest dropped and slot 0 zeroed, the amax appended last); the amax
    used is that one (``most_recent``) or the rolled entries' ``fmaxf`` from 0 (``max``: NaN
    ignored, 0 when nothing rolled); the scale is ``fp8_max * 2^-margin / amax`` where that
    amax is finite and > 0, else kept, FLT_MAX where it overflows. (TE's Python fallback,
    ``NVTE_UNFUSED_FP8_UPDATE``, rolls always and takes the whole history's max.)"""
    if amax_compute_algo not in ("max", "most_recent"):
        raise RuntimeError(f"Unsupported amax compute algorithm ({amax_compute_algo})")
    scaled_max = torch.tensor(fp8_max(fp8_dtype), dtype=torch.float32) * \
        torch.tensor(2.0, dtype=torch.float32).pow(-float(margin))
    start = 0
    for history, scale in zip(amax_histories, scales):
        n = history.shape[-1]
        newest = history[0]
        if amax_reduction_buffer is not None and amax_reduction_buffer.numel():
            reduced = amax_reduction_buffer[start:start + n]
            newest = torch.where(reduced != 0, reduced, newest)
        start += n
        rolls = newest != 0  # NaN != 0: a NaN amax rolls
        entries = torch.cat([history[1:], newest[None]])  # slot i <- i + 1, the amax last
        peak = torch.where(torch.isnan(entries), torch.zeros_like(entries), entries)
        peak = torch.where(rolls, peak.amax(0).clamp_min(0), torch.zeros_like(newest))
        rolled = torch.cat([torch.zeros_like(newest)[None], entries[1:]])
        history.copy_(torch.where(rolls, rolled, history))
        amax = newest if amax_compute_algo == "most_recent" else peak
        ok = torch.isfinite(amax) & (amax > 0)
        new = torch.where(ok, scaled_max / torch.where(ok, amax, torch.ones_like(amax)), scale)
        scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, _FLT_MAX), new))


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
             create_empty_quantized_tensor,
             fused_amax_and_scale_update_after_reduction, fused_multi_row_padding,
             fused_multi_row_unpadding)
