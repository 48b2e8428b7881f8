"""FP8 numerics of scale vectors, emulated on CPU: where should gamma live when a GEMM is FP8?

A fused projection (QKV, fc1) of a branch variant computes, per branch ``b``,
``Y_b = a_b * (W_b (gamma_b * N(x)))``. In real arithmetic every placement of the vectors is
the same function; in FP8 each placement quantizes different tensors:

=============  ==============================================  ===============================
placement      FP8 operands of the GEMM                         how a TE layer would run it
=============  ==============================================  ===============================
``stock``      ``gamma_b * N(x)`` (one scale for the module),   megatron's fused norm-linear
               ``W``; ``a_b`` after the GEMM in fp32            (one input quantizer)
``branch``     ``gamma_b * N(x)``, one scale *per branch*;      the activation path
               ``W``; ``a_b`` after                             (layers/linear.py, one call
                                                                per branch)
``folded``     ``N(x)`` and ``W_eff = diag(a) W diag(gamma)``   folded TE weight (one GEMM)
``mean_kept``  ``c * N(x)`` and ``diag(a) W diag(gamma / c)``,  folded, with ``c`` in TE's
               ``c`` = branch mean of gamma (:func:`split_     fused norm weight
               common_gamma`)
=============  ==============================================  ===============================

Quantization follows Transformer Engine's recipes: per-tensor *current* scaling (scale =
fp8_max / amax, E4M3 forward, E5M2 gradients: the HYBRID format) and ``Float8BlockScaling``
(1x128 blocks for activations and gradients, 128x128 for weights, power-of-two scales; the
wgrad GEMM quantizes its operands column-wise, 128 tokens x 1). ``torch._scaled_mm`` on CPU
runs tensor-wise and row-wise scales only (checked in the tests against this emulation), so
every GEMM here multiplies *dequantized* operands in fp32, which is what a scaled FP8 GEMM
with fp32 accumulation computes up to summation order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PLACEMENTS = ("stock", "branch", "folded", "mean_kept")


def fp8_max(fmt: str) -> float:
    return float(torch.finfo(FORMATS[fmt]).max)


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How one GEMM operand is scaled: ``block=None`` is one scale per tensor, else the
    (rows, cols) of a block of the 2-D operand; ``pow2`` rounds each scale down to 2^k."""

    fmt: str = "e4m3"
    block: Optional[tuple] = None
    pow2: bool = False


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Scalings of the three GEMMs of a linear layer (TE's names: fprop, dgrad, wgrad)."""

    name: str
    act: Scaling  # forward input, [tokens, in]
    weight: Scaling  # [out, in]
    grad: Scaling  # output gradient for dgrad, [tokens, out]
    grad_t: Scaling  # output gradient for wgrad, [tokens, out], blocks along tokens
    act_t: Scaling  # forward input for wgrad, [tokens, in], blocks along tokens


def recipe(name: str, grad_fmt: str = "e5m2") -> Recipe:
    """``tensorwise`` (TE Float8CurrentScaling, HYBRID) or ``blockwise`` (Float8BlockScaling)."""
    if name == "tensorwise":
        fwd, bwd = Scaling("e4m3"), Scaling(grad_fmt)
        return Recipe(name, fwd, fwd, bwd, bwd, fwd)
    if name == "blockwise":
        row, col, tile = (1, 128), (128, 1), (128, 128)
        return Recipe(name, Scaling("e4m3", row, True), Scaling("e4m3", tile, True),
                      Scaling(grad_fmt, row, True), Scaling(grad_fmt, col, True),
                      Scaling("e4m3", col, True))
    raise ValueError(f"FP8 recipe must be 'tensorwise' or 'blockwise', got {name!r}")


def compute_scale(amax: torch.Tensor, fmt: str, pow2: bool = False) -> torch.Tensor:
    """TE's scale: ``fp8_max / amax`` (1 where amax is 0 or not finite), optionally rounded
    down to a power of two so that dequantization is exact."""
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    scale = torch.where(ok, fp8_max(fmt) / torch.where(ok, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _block_amax(x: torch.Tensor, block: tuple) -> torch.Tensor:
    """amax of each (br, bc) block of a 2-D tensor, expanded back to x's shape (edge blocks
    are partial, as if padded with zeros)."""
    br, bc = block
    rows, cols = x.shape
    pr, pc = -rows % br, -cols % bc
    xp = torch.nn.functional.pad(x.abs(), (0, pc, 0, pr))
    r, c = xp.shape[0] // br, xp.shape[1] // bc
    amax = xp.view(r, br, c, bc).amax(dim=(1, 3))  # [r, c]
    full = amax.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return full[:rows, :cols]


def quantize(x: torch.Tensor, s: Scaling, amax: Optional[torch.Tensor] = None):
    """(fp8 tensor, dequantization scale broadcastable to x). ``amax`` overrides the
    per-tensor amax (one scale shared by several tensors, as one TE quantizer would)."""
    x = x.float()
    if s.block is None:
        a = x.abs().amax() if amax is None else amax
    else:
        if x.dim() != 2:
            raise ValueError(f"block-wise scaling needs a 2-D operand, got shape {tuple(x.shape)}")
        a = _block_amax(x, s.block)
    scale = compute_scale(a, s.fmt, s.pow2)
    m = fp8_max(s.fmt)
    q = (x * scale).clamp(-m, m).to(FORMATS[s.fmt])  # saturate, then round to nearest even
    return q, 1.0 / scale


def fake_quant(x: torch.Tensor, s: Scaling, amax: Optional[torch.Tensor] = None):
    """x rounded through FP8 and back to fp32 (what the GEMM sees)."""
    q, inv = quantize(x, s, amax)
    return q.float() * inv


# --- the placements ------------------------------------------------------------------------
def split_common_gamma(gammas: torch.Tensor):
    """The mitigation: (common [in], ratios [B, in]) with ``common * ratios == gammas``.

    ``common`` is the branch mean of the input vectors; it stays on the activation (TE's fused
    norm weight, quantized with N(x) as stock does) and only each branch's ratio to it is
    folded into the weight. With one branch, or equal vectors, the ratios are 1 and the
    GEMM is exactly the stock one. A mean of 0 (vectors of opposite signs) falls back to 1.
    """
    if gammas.dim() != 2:
        raise ValueError(f"split_common_gamma needs [branches, width] vectors, got "
                         f"{tuple(gammas.shape)}")
    g = gammas.float()
    common = g.mean(0)
    common = torch.where(common.abs() > 1e-12, common, torch.ones_like(common))
    return common, g / common


@dataclasses.dataclass
class FusedBranches:
    """One fused projection of one layer: the tensors every placement is built from.

    ``weight`` [out, in] with rows viewed ``[G, S, r]``; ``slots`` names the branch of each of
    the S slots; ``gin`` [S, in] input vectors per slot, ``gout`` [S, r] output vectors.
    """

    weight: torch.Tensor
    slots: list
    groups: int
    rows: int
    gin: torch.Tensor
    gout: torch.Tensor

    @property
    def branches(self) -> list:
        return list(dict.fromkeys(self.slots))

    def row_branch(self) -> list:
        """Branch name of every output row."""
        return [b for _ in range(self.groups) for b in self.slots for _ in range(self.rows)]

    def rows_of(self, branch: str) -> torch.Tensor:
        return torch.tensor([b == branch for b in self.row_branch()])

    def expand_in(self) -> torch.Tensor:
        """[out, in]: the input vector of every output row's branch."""
        s, k = self.gin.shape
        return self.gin[None, :, None, :].expand(self.groups, s, self.rows, k).reshape(-1, k)

    def expand_out(self) -> torch.Tensor:
        """[out, 1]: the output-vector entry of every row."""
        s = self.gout.shape[0]
        return self.gout[None].expand(self.groups, s, self.rows).reshape(-1, 1)

    def branch_gamma(self) -> torch.Tensor:
        """[B, in] one input vector per distinct branch."""
        return torch.stack([self.gin[self.slots.index(b)] for b in self.branches])

    def plan(self, placement: str):
        """(groups of (activation vector [in], row mask), fused GEMM weight [out, in], post-GEMM
        row scale [out], dW chain factor [out, in], activation scale scope)."""
        w = self.weight.float()
        gin_rows, gout_rows = self.expand_in(), self.expand_out()
        ones = torch.ones(w.shape[0])
        all_rows = torch.ones(w.shape[0], dtype=torch.bool)
        if placement in ("stock", "branch"):
            groups = [(self.gin[self.slots.index(b)], self.rows_of(b)) for b in self.branches]
            scope = "module" if placement == "stock" else "branch"
            return groups, w, gout_rows[:, 0], torch.ones_like(w), scope
        if placement == "folded":
            chain = gout_rows * gin_rows
            return [(torch.ones(w.shape[1]), all_rows)], w * chain, ones, chain, "module"
        if placement == "mean_kept":
            common, _ = split_common_gamma(self.branch_gamma())
            chain = gout_rows * gin_rows / common
            return [(common, all_rows)], w * chain, ones, chain, "module"
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def _q(x, s: Scaling, rec: Optional[Recipe], amax=None):
    return x if rec is None else fake_quant(x, s, amax)


def run_placement(fb: FusedBranches, n: torch.Tensor, dy: torch.Tensor, placement: str,
                  rec: Optional[Recipe]) -> dict:
    """Forward output Y [T, out], dN [B, T, in] (each branch's share of the input gradient)
    and dW [out, in] (gradient of the stored weight W) under ``rec`` (None: fp32).

    ``n`` is N(x) [T, in]; ``dy`` the gradient of the layer's output [T, out]. A placement
    with several activation groups runs one GEMM per group; with scope ``module`` their
    activations share one scale and the output gradient is quantized once over all rows,
    with scope ``branch`` each GEMM sees its own activation and its rows of the gradient
    (zeros elsewhere, as a masked TE call does).
    """
    groups, wf, post, chain, scope = fb.plan(placement)
    qw = _q(wf, rec.weight if rec else None, rec)
    acts = [n.float() * c for c, _ in groups]
    g = dy.float() * post
    act_amax = None
    if scope == "module":
        act_amax = torch.stack([a.abs().amax() for a in acts]).amax()
    y = torch.zeros(n.shape[0], wf.shape[0])
    dn = torch.zeros(len(fb.branches), *n.shape)
    dw = torch.zeros_like(wf)
    masks = [fb.rows_of(b) for b in fb.branches]
    for (c, rows), a in zip(groups, acts):
        g_k = g if scope == "module" else g * rows
        qa = _q(a, rec.act if rec else None, rec, act_amax)
        qg = _q(g_k, rec.grad if rec else None, rec)
        qg_t = _q(g_k, rec.grad_t if rec else None, rec)
        qa_t = _q(a, rec.act_t if rec else None, rec, act_amax)
        y[:, rows] = qa @ qw[rows].t()
        dw[rows] = qg_t[:, rows].t() @ qa_t
        for bi, m in enumerate(masks):  # each branch's share of dN (its rows lie in a group)
            if bool((m & rows).any()):
                dn[bi] = (qg[:, m] @ qw[m]) * c
    return dict(y=y * post, dn=dn, dw=dw * chain)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    d = float(ref.norm())
    return float((x - ref).norm()) / d if d > 0 else float((x - ref).norm())


def measure(fb: FusedBranches, n: torch.Tensor, dy: torch.Tensor, recipes: list,
            placements=PLACEMENTS) -> list:
    """Relative errors against fp32, per branch: rows of {branch, recipe, placement, fwd,
    dgrad, wgrad}. fwd and wgrad over the branch's output rows, dgrad over its share of dN."""
    ref = run_placement(fb, n, dy, "stock", None)
    out = []
    masks = {b: fb.rows_of(b) for b in fb.branches}
    for rec in recipes:
        for p in placements:
            got = run_placement(fb, n, dy, p, rec)
            for bi, b in enumerate(fb.branches):
                m = masks[b]
                out.append(dict(branch=b, recipe=rec.name, placement=p,
                                fwd=rel_err(got["y"][:, m], ref["y"][:, m]),
                                dgrad=rel_err(got["dn"][bi], ref["dn"][bi]),
                                wgrad=rel_err(got["dw"][m], ref["dw"][m])))
    return out


# --- fake-quantized linear layers for training ---------------------------------------------
class _FakeQuantGemm(torch.autograd.Function):
    """``y = Q(x) Q(w)^T``; backward ``dx = Q(dy) Q(w)``, ``dw = Q_t(dy)^T Q_t(x)``."""

    @staticmethod
    def forward(ctx, x, w, rec: Recipe):
        x2 = x.reshape(-1, x.shape[-1]).float()
        qx, qw = fake_quant(x2, rec.act), fake_quant(w.float(), rec.weight)
        ctx.save_for_backward(x2, qw)
        ctx.rec, ctx.shape, ctx.dtypes = rec, x.shape, (x.dtype, w.dtype)
        return (qx @ qw.t()).view(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2, qw = ctx.saved_tensors
        rec = ctx.rec
        g = dy.reshape(-1, dy.shape[-1]).float()
        dx = fake_quant(g, rec.grad) @ qw
        dw = fake_quant(g, rec.grad_t).t() @ fake_quant(x2, rec.act_t)
        return dx.view(ctx.shape).to(ctx.dtypes[0]), dw.to(ctx.dtypes[1]), None


def fake_quant_linear(x: torch.Tensor, w: torch.Tensor, rec: Recipe) -> torch.Tensor:
    return _FakeQuantGemm.apply(x, w, rec)
