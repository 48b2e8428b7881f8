#!/usr/bin/env python
"""How far the CPU stand-in's FP8 GEMM is from the device's (tools/gpu_check.sh, part 2).

The same per-tensor e4m3 operands (random, with a few outliers; scales from their amax as current
scaling sets them) go through ``torch._scaled_mm`` with fast accumulation on and off, and through
the stand-in's cast-and-matmul (scalevec_testing/te_fp8.py: the dequantized operands multiplied in
fp32). Each is compared with the exact product of the dequantized
operands (float64): the relative error (max |D - exact| / max |exact|) of each, and the largest
gap between ``_scaled_mm`` and the stand-in; all on the device (the stand-in's fp32 matmul with
TF32 off: fp32 sums, in the device's order). On Hopper this measures the tensor cores'
accumulation (fast: a reduced-precision accumulator; off: promoted to fp32 every few K steps)
against the stand-in's fp32 sums. Bounded by ``--seconds``; CPU runs it too (CI, shapes shrunk).

Usage: python tools/fp8_gemm_check.py [--device cuda] [--shapes 4096x4096x4096 ...]
       [--seconds 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

E4M3 = SimpleNamespace(name="kFloat8E4M3")


def operands(m: int, n: int, k: int, seed: int, device: str) -> tuple:
    """(A [m, k], B [n, k]) e4m3 and their fp32 inverse scales: ``D = A B^T``, both K-major as
    a TN GEMM reads them."""
    from scalevec_testing import te_fp8

    g = torch.Generator().manual_seed(seed)
    out = []
    for rows in (m, n):
        x = torch.randn(rows, k, generator=g)
        x[torch.rand(rows, k, generator=g) < 1e-3] *= 30.0  # outliers set the amax
        scale = te_fp8.compute_scale_from_amax(x.abs().amax().reshape(1), 448.0, False, 0.0)
        bits = te_fp8._encode(x * scale, E4M3)
        out += [bits.view(torch.float8_e4m3fn).to(device), (1.0 / scale).to(device)]
    return tuple(out)


def check(shape: tuple, seed: int, device: str) -> list:
    """Rows for one shape: fast accumulation off and on."""
    from scalevec_testing import te_fp8

    m, n, k = shape
    a, sa, b, sb = operands(m, n, k, seed, device)
    exact = (a.double() * sa.double()) @ (b.double() * sb.double()).t()
    top = float(exact.abs().max())
    va = te_fp8._decode(a.view(torch.uint8), E4M3) * sa
    vb = te_fp8._decode(b.view(torch.uint8), E4M3) * sb
    stand_in = va @ vb.t()  # the stand-in's GEMM: dequantized operands, fp32 matmul (no TF32)
    rows = []
    for fast in (False, True):
        d = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32,
                             use_fast_accum=fast).double()
        rows.append(dict(shape="x".join(map(str, shape)), fast_accum=fast,
                         device_err=float((d - exact).abs().max()) / top,
                         stand_in_err=float((stand_in.double() - exact).abs().max()) / top,
                         gap=float((d - stand_in.double()).abs().max()) / top))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shapes", nargs="+", default=["4096x4096x4096", "8192x1024x4096",
                                                   "4096x4096x16384"])
    p.add_argument("--seconds", type=float, default=30.0)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # the stand-in sums in IEEE fp32
    start, rows = time.monotonic(), []
    for i, text in enumerate(args.shapes):
        if time.monotonic() - start > args.seconds:
            print(f"stopped after {args.seconds:.0f} s: {len(args.shapes) - i} shapes not run")
            break
        rows += check(tuple(int(v) for v in text.split("x")), i, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device={name} torch={torch.__version__}")
    print("| M x N x K | fast accum | _scaled_mm rel. error | stand-in rel. error "
          "| gap |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['fast_accum']} | {r['device_err']:.2e} | "
              f"{r['stand_in_err']:.2e} | {r['gap']:.2e} |")
    if not rows:
        sys.exit(1)


if __name__ == "__main__":
    main()
