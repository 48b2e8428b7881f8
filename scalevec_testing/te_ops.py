"""Test-only torch versions of the Transformer Engine extension functions that TE's non-FP8
forward and backward of ``LayerNormLinear``, ``Linear`` and ``GroupedLinear`` call (TE 2.11 and
2.17.1, read from ``cpp_extensions/gemm.py`` and ``module/_common.py`` / ``layernorm_linear.py``
of each): ``generic_gemm``, ``te_general_grouped_gemm``, ``rmsnorm_fwd`` / ``rmsnorm_bwd``,
``layernorm_fwd`` / ``layernorm_bwd``; plus the queries the modules make
(``get_num_cublas_streams``, ``get_cudnn_version``, ``get_cublasLt_version``, and
``get_fused_attn_backend``: none, so TE's attention runs its unfused torch path in bf16 too).
Installed on te_stub's stand-in extension, with te_fp8.py's FP8 kernels.

GEMM convention (cuBLAS column-major, as TE calls it), in row-major torch terms:
``D = op(B) @ op(A)`` with ``op(X) = X.T`` when that operand's ``trans`` flag is set: TN is
``x @ W.T`` (forward), NN ``dy @ W`` (dgrad), NT ``dy.T @ x`` (wgrad). Per-tensor FP8 operands
(both or neither) are multiplied dequantized, in fp32, from the copy cuBLASLt reads on the
claimed GPU (Hopper: dgrad reads W's column-wise copy, wgrad those of x and dy;
te_fp8.gemm_operand); other quantized operands, output quantizers, GELU fusion and
communication overlap raise.
"""

from __future__ import annotations

import collections
import functools
import math

import torch

from scalevec_testing import te_fp8


def _operand(t) -> torch.Tensor:
    """A high-precision GEMM operand as it is; quantized kinds other than per-tensor FP8 raise."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise NotImplementedError(f"CPU stand-in GEMM: {type(t).__name__} operands (block / MX "
                                  "/ NVFP4 quantized tensors) are not implemented")
    return t


def _flat(shape) -> tuple:
    """(first, last): cuBLASLt's ``flat_first_dim`` / ``flat_last_dim`` of a logical shape."""
    return math.prod(shape[:-1]), shape[-1]


def _fp8_operands(A, transa, B, transb) -> tuple:
    """Both FP8 operands' values as cuBLASLt reads them on this GPU (te_fp8.gemm_operand), after
    ``CanonicalizeGemmInput``'s leading-dimension rule: 16 FP8 elements (on Hopper, both
    ``lda`` and ``ldb`` are the contraction length k)."""
    non_tn = te_fp8.non_tn()
    a, a_copy = te_fp8.gemm_operand(A, transa, "A", non_tn)
    b, b_copy = te_fp8.gemm_operand(B, transb, "B", non_tn)
    (a0, a1), (b0, b1) = _flat(te_fp8.logical_shape(A)), _flat(te_fp8.logical_shape(B))
    m, n, k = (a0 if transa else a1), (b1 if transb else b0), (a1 if transa else a0)
    lda = (k if transa else m) if a_copy == "rowwise" else (m if transa else k)
    ldb = (n if transb else k) if b_copy == "rowwise" else (k if transb else n)
    if lda % 16:
        raise RuntimeError("Leading dimension requirement on A for FP8 GEMM. Caller must pad.")
    if ldb % 16:
        raise RuntimeError("Leading dimension requirement on B for FP8 GEMM. Caller must pad.")
    return a, b


def _no(**options) -> None:
    for name, value in options.items():
        if value:
            raise NotImplementedError(f"CPU stand-in: {name} is not implemented")


def _matmul(A, transa, B, transb):
    """Returns (D, B's values): D in fp32."""
    if te_fp8.is_fp8(A) != te_fp8.is_fp8(B):  # TE's GEMM: both FP8 or neither
        raise TypeError("CPU stand-in GEMM: one FP8 and one high-precision operand")
    if te_fp8.is_fp8(A):
        b_shape = te_fp8.logical_shape(B)
        a, b = _fp8_operands(A, transa, B, transb)
        B = b.reshape(b_shape)
    else:
        A, B = _operand(A), _operand(B)
        if A.dtype != B.dtype:  # TE's non-FP8 GEMM takes operands of one type
            raise TypeError(f"CPU stand-in GEMM: operands of one dtype, got {A.dtype} and "
                            f"{B.dtype}")
        a, b = A.reshape(-1, A.shape[-1]), B.reshape(-1, B.shape[-1])
    d = (b.t() if transb else b).float() @ (a.t() if transa else a).float()
    if not transb and B.dim() > 2:
        d = d.reshape(*B.shape[:-1], d.shape[-1])
    return d, B


def _store(d, out, accumulate, alpha=1.0, beta=None):
    d = d * alpha if alpha != 1.0 else d
    if out is None:
        return d
    if out.numel() != d.numel() or out.shape[-1] != d.shape[-1]:
        raise ValueError(f"CPU stand-in GEMM: out of shape {tuple(out.shape)} for a result of "
                         f"shape {tuple(d.shape)}")
    if accumulate:
        if beta is not None and beta != 1.0:  # cuBLAS scales C in the GEMM: no pass of its own
            out.mul_(beta)
        out.add_(d.reshape(out.shape).to(out.dtype))
    else:
        out.copy_(d.reshape(out.shape))
    return out


def generic_gemm(A, transa, B, transb, out, quantizer, out_dtype, bias, bias_type, gelu,
                 gelu_in, grad, workspace, workspace_size, accumulate, use_split_accumulator,
                 comm_overlap=None, comm_type=None, extra_output=None, bulk_overlap=False,
                 alpha=1.0, beta=None):
    """One GEMM; returns (D, bias gradient, GELU input, extra output) as TE's binding does."""
    _no(output_quantizer=quantizer is not None, gelu=gelu, comm_overlap=comm_overlap is not None,
        bulk_overlap=bulk_overlap)
    fp8 = te_fp8.is_fp8(B)
    if fp8 and out is None and out_dtype is None:
        raise TypeError("CPU stand-in GEMM: an FP8 GEMM needs out or out_dtype")
    d, B = _matmul(A, transa, B, transb)
    bias_grad = None
    if bias is not None and bias.numel():
        if grad:  # wgrad GEMM: the bias gradient is dY summed over tokens (B is dY here)
            bias_grad = B.reshape(-1, B.shape[-1]).float().sum(0).to(bias.dtype)
        else:
            d = d + bias.float()
    dtype = out.dtype if out is not None else te_fp8.torch_dtype(out_dtype, B.dtype)
    d = _store(d, out, accumulate, alpha, beta)
    return d.to(dtype) if out is None else d, bias_grad, None, extra_output


def te_general_grouped_gemm(A, transa, B, transb, out, out_dtype, m_splits, bias, bias_dtype,
                            single_output, gelu_input, grad, workspaces, workspace_size,
                            accumulate, use_split_accumulator, sm_margin=0):
    """One GEMM per group (A[i], B[i]); with ``single_output`` the results are the row blocks
    of ``out[0]`` (sizes ``m_splits``). Returns the bias list (gradients when ``grad``)."""
    _no(gelu=gelu_input is not None and any(g is not None and g.numel() for g in gelu_input))
    start = 0
    for i, (a, b) in enumerate(zip(A, B)):
        d, b = _matmul(a, transa, b, transb)
        has_bias = bias is not None and i < len(bias) and bias[i] is not None and bias[i].numel()
        if has_bias and grad:
            bias[i].copy_(b.reshape(-1, b.shape[-1]).float().sum(0))
        elif has_bias:
            d = d + bias[i].float()
        if single_output:
            rows = d.shape[0]
            _store(d, out[0][start:start + rows], accumulate)
            start += rows
        else:
            _store(d, out[i], accumulate)
    return bias


def _norm_out(y, ln_out, quantizer, otype, x):
    """The norm's output from its fp32 result: FP8 as te_fp8.norm_output, else in ``otype``."""
    dtype = te_fp8.torch_dtype(otype, x.dtype)
    if quantizer is not None:
        return te_fp8.norm_output(y, ln_out, quantizer, dtype)
    y = y.to(dtype)
    if ln_out is not None:
        ln_out.copy_(y.reshape(ln_out.shape))
        return ln_out
    return y


def rmsnorm_fwd(x, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    """Returns (y, None, rsigma); rsigma per row, in fp32 as TE keeps it."""
    xf = x.float()
    rsigma = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    gamma = weight.float() + (1.0 if zero_centered_gamma else 0.0)
    y = xf * rsigma.unsqueeze(-1) * gamma
    return _norm_out(y, ln_out, quantizer, otype, x), None, rsigma


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    """Returns (dx, dgamma)."""
    xf, dzf, rs = x.float(), dz.float().reshape(x.shape), rsigma.float().unsqueeze(-1)
    g = gamma.float() + (1.0 if zero_centered_gamma else 0.0)
    xhat = xf * rs
    dxhat = dzf * g
    dx = rs * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dgamma = (dzf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def layernorm_fwd(x, weight, bias, eps, ln_out, quantizer, otype, sm_margin,
                  zero_centered_gamma):
    """Returns (y, mu, rsigma)."""
    xf = x.float()
    mu = xf.mean(-1)
    rsigma = torch.rsqrt((xf - mu.unsqueeze(-1)).pow(2).mean(-1) + eps)
    gamma = weight.float() + (1.0 if zero_centered_gamma else 0.0)
    y = (xf - mu.unsqueeze(-1)) * rsigma.unsqueeze(-1) * gamma + bias.float()
    return _norm_out(y, ln_out, quantizer, otype, x), mu, rsigma


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    """Returns (dx, dgamma, dbeta)."""
    xf, dzf = x.float(), dz.float().reshape(x.shape)
    rs = rsigma.float().unsqueeze(-1)
    g = gamma.float() + (1.0 if zero_centered_gamma else 0.0)
    xhat = (xf - mu.float().unsqueeze(-1)) * rs
    dxhat = dzf * g
    dx = rs * (dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1,
                                                                                keepdim=True))
    flat = dzf.reshape(-1, x.shape[-1])
    return (dx.to(x.dtype), (flat * xhat.reshape(flat.shape)).sum(0).to(gamma.dtype),
            flat.sum(0).to(gamma.dtype))


def scaled_softmax_forward(inputs, scale):
    """softmax(scale * x) over the last dim, in fp32, returned in the input's dtype (TE's fused
    softmax for bf16 / fp16 attention scores [b, heads, sq, sk])."""
    return torch.softmax(inputs.float() * float(scale), -1).to(inputs.dtype)


def scaled_masked_softmax_forward(inputs, mask, scale):
    """As scaled_softmax_forward with ``mask`` (True / 1: masked, [b or 1, 1, sq, sk]) filled
    with -10000 first, as TE's own torch path (attention_mask_func) does."""
    scores = (inputs.float() * float(scale)).masked_fill(mask.bool(), -10000.0)
    return torch.softmax(scores, -1).to(inputs.dtype)


def scaled_softmax_backward(output_grads, softmax_results, scale):
    """d(scale * x) of either forward, from its output y: ``scale * y * (dy - sum(dy * y))``
    (masked entries have y = 0, so they get none)."""
    y, dy = softmax_results.float(), output_grads.float()
    dx = float(scale) * y * (dy - (dy * y).sum(-1, keepdim=True))
    return dx.to(output_grads.dtype)


def scaled_masked_softmax_backward(output_grads, softmax_results, scale):
    return scaled_softmax_backward(output_grads, softmax_results, scale)


FUNCTIONS = (generic_gemm, te_general_grouped_gemm, rmsnorm_fwd, rmsnorm_bwd, layernorm_fwd,
             layernorm_bwd, scaled_softmax_forward,
             scaled_softmax_backward, scaled_masked_softmax_forward,
             scaled_masked_softmax_backward)


CALLS: collections.Counter = collections.Counter()  # name -> calls (tests: what TE reached)


def _counted(fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        CALLS[fn.__name__] += 1
        return fn(*args, **kwargs)

    return counted


def install(mod) -> None:
    """Put the implemented functions on the stand-in extension module."""
    for fn in FUNCTIONS + te_fp8.FUNCTIONS:
        setattr(mod, fn.__name__, _counted(fn))
    mod.get_num_cublas_streams = lambda: 4
    mod.get_cublasLt_version = lambda: 120900  # TE's FP8 support check (>= 12.1.3)
    # no fused (cuDNN) attention here: TE's DotProductAttention then runs its unfused torch path
    # for bf16 / FP8 as it does for fp32 (flash-attn is not installed)
    mod.get_fused_attn_backend = lambda *args, **kwargs: \
        mod.NVTE_Fused_Attn_Backend.NVTE_No_Backend
    # DotProductAttention's constructor reads it (encoded as cudnn does: 9.10.0)
    mod.get_cudnn_version = lambda: 91000
