"""The CPU stand-ins of TE's FP8 kernels (scalevec_testing/te_fp8.py) against plain scalar
transcriptions of the C++ rules they follow, written here from TE's sources (v2.11 and v2.17.1,
the same rules in both): ``common/recipe/delayed_scaling.cu`` ``kernel_bulk``,
``common/recipe/recipe_common.cuh`` ``compute_scale_from_amax``, ``common/gemm/cublaslt_gemm.cu``
``CanonicalizeGemmInput``. No TE import: the stand-ins run on tensors alone here; their use by
TE's Python is tests/layers/test_te_fp8.py's."""

import itertools
import math
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from scalevec_testing import te_fp8

E4M3, E5M2 = SimpleNamespace(name="kFloat8E4M3"), SimpleNamespace(name="kFloat8E5M2")
F32 = np.float32
FLT_MAX = float(np.finfo(F32).max)


# ---------------------------------------------------------------- transcriptions
def kernel_bulk_column(reduced, history, scale, algo, scaled_max):
    """One amax slot of ``kernel_bulk``, scalar by scalar (fp32 throughout); returns the new
    (history, scale)."""
    length = len(history)
    last = reduced if reduced != 0.0 else history[0]  # NaN != 0: the reduced NaN is taken
    amax = F32(0)
    if last != 0.0:
        rolled = []
        for i in range(length):
            a = history[i + 1] if i < length - 1 else last
            amax = np.fmax(amax, F32(a))
            rolled.append(a if i > 0 else 0.0)
        history = rolled
    if algo == "most_recent":
        amax = F32(last)
    if math.isfinite(amax) and amax > 0:
        new = F32(scaled_max) / F32(amax)
    else:
        new = F32(scale)
    if math.isinf(new):
        new = F32(FLT_MAX)
    return [float(h) for h in history], float(new)


def compute_scale_from_amax(amax, max_fp8, force_pow_2, epsilon):
    """``compute_scale_from_amax`` with value_for_inf = FLT_MAX, scalar."""
    amax = F32(amax)
    if amax < epsilon:
        amax = F32(epsilon)
    if math.isinf(amax) or amax == 0 or math.isnan(amax):
        return 1.0
    scale = F32(max_fp8) / amax
    if math.isinf(scale):
        scale = F32(FLT_MAX)
    if force_pow_2:
        bits = struct.unpack("<I", struct.pack("<f", scale))[0] & 0xFF800000
        scale = F32(struct.unpack("<f", struct.pack("<I", bits))[0])
    return float(scale)


def canonical_copy(side, trans, has_data, has_columnwise, non_tn):
    """Which copy cuBLASLt reads for a per-tensor FP8 operand, or the error's text
    (``NVTETensorFromFloat8Tensor``'s check, then the A / B branch of
    ``CanonicalizeGemmInput``; a null row-wise pointer read is reported as missing)."""
    if not (has_data or has_columnwise):
        return "No data found"
    reads_transposed = (not trans) if side == "A" else trans
    if not non_tn and reads_transposed:
        return "columnwise" if has_columnwise else "missing column-wise"
    if non_tn and not has_data:
        return "columnwise" if has_columnwise else "missing column-wise"
    return "rowwise" if has_data else "missing row-wise"


# ---------------------------------------------------------------- delayed scaling
_VALUES = [0.0, 0.0, 1e-3, 0.25, 3.0, 7.0, 448.0, 1e-44, float("inf"), float("nan")]


def _update_cases():
    g = np.random.default_rng(0)
    for length, algo, margin in itertools.product((1, 2, 5), ("max", "most_recent"), (0, 1, 3)):
        for _ in range(6):
            n = 7
            hist = g.choice(_VALUES, size=(length, n)).astype(F32)
            hist[:, 0] = [0.0] + [5.0] * (length - 1)  # a cached weight: amax 0, history kept
            reduced = g.choice(_VALUES, size=n).astype(F32)
            reduced[0] = 0.0
            scale = g.choice([1.0, 2.0, 224.0], size=n).astype(F32)
            yield length, algo, margin, hist, reduced, scale


def test_delayed_update_is_kernel_bulk():
    """Every slot (history 1, 2, 5; max and most_recent; margin 0, 1, 3; zero, tiny, inf and
    NaN amaxes in the buffer and the history) as the scalar transcription computes it, history
    and scale bit for bit. Two tensors in one call: the buffer is read at each one's offset."""
    cases = 0
    for length, algo, margin, hist, reduced, scale in _update_cases():
        split = 3
        h = [torch.from_numpy(hist[:, :split].copy()), torch.from_numpy(hist[:, split:].copy())]
        s = [torch.from_numpy(scale[:split].copy()), torch.from_numpy(scale[split:].copy())]
        te_fp8.fused_amax_and_scale_update_after_reduction(
            torch.from_numpy(reduced), h, s, algo, E4M3, margin)
        got_h, got_s = torch.cat(h, 1).numpy(), torch.cat(s).numpy()
        scaled_max = F32(448.0) * F32(2.0) ** F32(-margin)
        for j in range(hist.shape[1]):
            want_h, want_s = kernel_bulk_column(float(reduced[j]), [float(x) for x in hist[:, j]],
                                                float(scale[j]), algo, scaled_max)
            np.testing.assert_array_equal(got_h[:, j], np.array(want_h, F32),
                                          err_msg=f"{length} {algo} slot {j}")
            np.testing.assert_array_equal(got_s[j], F32(want_s), err_msg=f"{algo} slot {j}")
            cases += 1
    assert cases == 3 * 2 * 3 * 6 * 7


def test_delayed_update_keeps_a_cached_weights_scale():
    """The issue's probe: history 4, ``max``, a cached FP8 weight reporting amax 0 after its
    step's first micro-batch. TE's kernel keeps the scale (224) and the history; TE's Python
    fallback (roll always, the history's max) would move the scale to 448 / 1 = 448."""
    hist = torch.tensor([[0.0], [1.0], [2.0], [0.5]])
    scale = torch.tensor([224.0])
    te_fp8.fused_amax_and_scale_update_after_reduction(torch.zeros(1), [hist], [scale], "max",
                                                       E4M3, 0)
    assert scale.tolist() == [224.0] and hist.flatten().tolist() == [0.0, 1.0, 2.0, 0.5]
    # a non-zero amax rolls: slot 0 zeroed, the oldest entry (1.0) still counted this once
    te_fp8.fused_amax_and_scale_update_after_reduction(torch.tensor([0.5]), [hist], [scale],
                                                       "max", E4M3, 0)
    assert hist.flatten().tolist() == [0.0, 2.0, 0.5, 0.5] and scale.tolist() == [224.0]


def test_delayed_update_refuses_an_unknown_algorithm():
    with pytest.raises(RuntimeError, match="Unsupported amax compute algorithm"):
        te_fp8.fused_amax_and_scale_update_after_reduction(
            torch.zeros(1), [torch.zeros(1, 1)], [torch.ones(1)], "mean", E4M3, 0)


# ---------------------------------------------------------------- current scaling
def test_current_scale_is_compute_scale_from_amax():
    """Scale from amax for both formats, with and without power-of-2 scales and an epsilon:
    random amaxes over 80 binades plus 0, NaN, inf, an amax below the epsilon and one whose
    quotient overflows fp32 (FLT_MAX, then 2^127 as a power of 2), bit for bit."""
    g = np.random.default_rng(1)
    amaxes = np.concatenate([np.exp2(g.uniform(-40, 40, 200)),
                             [0.0, np.nan, np.inf, 1e-45, 1e-40, 3e-39, 448.0]]).astype(F32)
    for fmt, top in ((E4M3, 448.0), (E5M2, 57344.0)):
        for pow2, eps in itertools.product((False, True), (0.0, 1e-6)):
            got = te_fp8.compute_scale_from_amax(torch.from_numpy(amaxes), top, pow2, eps)
            want = [compute_scale_from_amax(a, top, pow2, eps) for a in amaxes]
            np.testing.assert_array_equal(got.numpy(), np.array(want, F32),
                                          err_msg=f"{fmt.name} pow2={pow2} eps={eps}")
            assert te_fp8.fp8_max(fmt) == top


def test_cast_amax_ignores_nan_and_empty_input_is_left_alone():
    """The amax the cast kernels reduce (``fmaxf`` from 0): NaN ignored, 0 for nothing; and
    the delayed cast's amax update is an atomic max into the slot."""
    assert te_fp8._amax(torch.tensor([1.0, float("nan"), -3.0])).tolist() == [3.0]
    assert te_fp8._amax(torch.tensor([float("nan")])).tolist() == [0.0]
    assert te_fp8._amax(torch.empty(0)).tolist() == [0.0]
    slot = torch.tensor([2.0])
    te_fp8._fmax(slot, torch.tensor([1.0]))
    te_fp8._fmax(slot, torch.tensor([float("nan")]))
    assert slot.tolist() == [2.0]


# ---------------------------------------------------------------- GEMM operands
def _fp8(rows, cols, has_data, has_t, invalid=False):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    x = torch.randn(rows, cols, generator=g) * 4
    bits = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return SimpleNamespace(_data=bits if has_data else None,
                           _transpose=bits.t().contiguous() if has_t else None,
                           _transpose_invalid=invalid, _fp8_dtype=E4M3,
                           _scale_inv=torch.tensor([0.5])), bits


@pytest.mark.parametrize("non_tn", [False, True], ids=["hopper", "non_tn"])
def test_gemm_operand_is_cublaslt_canonicalization(non_tn):
    """For A and B, each transpose flag and each presence of the two copies (an invalid
    transpose counted as absent): the copy read, or the error, as the transcription says; the
    values read are that copy's (a transpose zeroed where it is read shows)."""
    for side, trans, has_data, has_t, invalid in itertools.product(
            "AB", (False, True), (False, True), (False, True), (False, True)):
        t, bits = _fp8(32, 16, has_data, has_t, invalid)
        want = canonical_copy(side, trans, has_data, has_t and not invalid, non_tn)
        if want in ("rowwise", "columnwise"):
            values, copy = te_fp8.gemm_operand(t, trans, side, non_tn)
            assert copy == want, (side, trans, has_data, has_t, invalid)
            assert torch.equal(values, bits.view(torch.float8_e4m3fn).float() * 0.5)
            if copy == "columnwise":
                t._transpose.zero_()
                assert not te_fp8.gemm_operand(t, trans, side, non_tn)[0].any()
        else:
            with pytest.raises(RuntimeError, match=want):
                te_fp8.gemm_operand(t, trans, side, non_tn)
