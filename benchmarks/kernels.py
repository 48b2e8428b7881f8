#!/usr/bin/env python
"""The fused DNP kernels alone against the stock layer's element-wise work they replace, at the
overhead benchmark's shapes (forward + backward, compiled as the trainer runs them):

* ``glu``: megatron-core's unfused GLU (``silu(gate) * up``) vs ``glu.glu_norm``;
* ``qkv``: megatron-core's split + RoPE on q and k vs ``fused.qkv_norm`` (norms and RoPE);
* ``experts``: grouped experts' GLU norm (4 experts) with per-expert vectors, their gradients
  from row-block sums (``glu.expert_rows``, ``blocks``) or row by row (per-row products and a
  one-hot GEMM over all rows, the round-5 method, ``by row``), each against the same kernel
  with one vector for all rows (``dnp``).

Each round times every kernel once (a few calls each); a ratio is the median over rounds of
the ratio within a round. A step-level benchmark (tools/bench_overhead.py) on a shared CPU
moves by a few percent; these ratios isolate the kernels from the rest of the step.

Usage: python -m benchmarks.kernels [--rounds 40] [--threads 2] [--compile off]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from benchmarks.heap import keep_freed_memory
from megatron_scalevec import compile
from megatron_scalevec.layers import fold, fused, glu


def _glu_cases(label, rows, width, experts):
    z = torch.randn(rows, 2 * width, requires_grad=True)
    dh = torch.randn(rows, width)
    a = [(1 + 0.1 * torch.randn(width)).requires_grad_() for _ in range(2)]

    def stock():
        gate, up = z.chunk(2, -1)
        torch.autograd.grad(F.silu(gate) * up, (z,), dh)

    def dnp(vectors, rows_=None):
        def run():
            h = glu.glu_norm(z, *vectors, F.silu, gated=True, normalization="RMSNorm",
                             eps=1e-5, experts=rows_)
            torch.autograd.grad(h, (z, *vectors), dh)
        return run

    cases = {f"{label} stock": stock, f"{label} dnp": dnp(a)}
    if experts > 1:
        counts = [rows // experts] * experts
        counts[-1] += rows - sum(counts)
        per_expert = [(1 + 0.1 * torch.randn(experts, width)).requires_grad_() for _ in range(2)]
        blocks = glu.expert_rows(counts)
        by_row = glu.ExpertRows(blocks.ids, None, blocks.ids)
        cases.update({f"{label} by row": dnp(per_expert, by_row),
                      f"{label} blocks": dnp(per_expert, blocks)})
    return cases


def _qkv_cases(seq, batch, groups, qpg, head_dim):
    mixed = torch.randn(seq, batch, groups, (qpg + 2) * head_dim, requires_grad=True)
    vectors = tuple((1 + 0.1 * torch.randn(head_dim)).requires_grad_() for _ in range(3))
    half = torch.randn(seq, 1, 1, head_dim // 2)
    freqs = torch.cat([half, half], -1)
    rope = fused.rope_cos_sin(freqs, 1.0, torch.float32)
    grads = (torch.randn(seq, batch, groups * qpg, head_dim),
             torch.randn(seq, batch, groups, head_dim), torch.randn(seq, batch, groups, head_dim))

    def stock():
        q, k, v = torch.split(mixed, [qpg * head_dim, head_dim, head_dim], dim=3)
        q = q.reshape(seq, batch, -1, head_dim)
        out = (_apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs), v)
        torch.autograd.grad(out, (mixed,), grads)

    def dnp():
        out = fused.qkv_norm(mixed, vectors, 1e-5, "RMSNorm", qpg, rope, rope)
        torch.autograd.grad(out, (mixed, *vectors), grads)

    return {"qkv stock": stock, "qkv dnp": dnp}


def _fold_cases(experts, rows=2816, width=256):
    weights = [torch.randn(rows // experts, width) for _ in range(experts)]
    layout = (1, 2, rows // experts // 2)  # a GLU's fc1: gate and up slots
    row, col = torch.rand(experts, 2, layout[2]) + 0.5, torch.rand(experts, 2, width) + 0.5
    out = torch.empty(experts, rows // experts, width)
    run = torch.no_grad()  # as the model folds: inside autograd Functions
    return {f"stack E={experts}": run(lambda: torch.stack(weights, out=out)),
            f"fold E={experts}": run(lambda: fold.fold(weights, row, col, layout)),
            f"refold E={experts}": run(lambda: fold.fold(weights, row, col, layout, out=out))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--calls", type=int, default=5, help="calls per kernel per round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", choices=["on", "off"], default="on",
                   help="the fused kernels through torch.compile (the trainer's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    compile.set_mode(args.compile)
    keep_freed_memory()  # as tools/bench_overhead.py: no page faults from glibc's trimming
    # the benchmark's model: seq 256 x micro-batch 4 tokens, ffn 704 (experts: top-2 of 4,
    # width 352), 8 heads of 32 in 4 groups
    cases = {**_glu_cases("glu", 1024, 704, 1), **_qkv_cases(256, 4, 4, 2, 32),
             **_glu_cases("experts", 2048, 352, 4), **_fold_cases(4), **_fold_cases(16)}
    for fn in cases.values():
        for _ in range(3):
            fn()
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / args.calls)
    print(f"threads={torch.get_num_threads()} rounds={args.rounds} compile={args.compile}")
    print("| kernel (forward + backward) | median ms | vs |  ratio |")
    print("|---|---|---|---|")
    against = {"glu dnp": "glu stock", "qkv dnp": "qkv stock", "experts dnp": "experts stock",
               "experts by row": "experts dnp", "experts blocks": "experts dnp",
               **{f"{k} E={e}": f"stack E={e}" for k in ("fold", "refold") for e in (4, 16)}}
    for name, t in times.items():
        ref = against.get(name)
        ratio = (f"{statistics.median(a / b for a, b in zip(t, times[ref])):.3f}"
                 if ref else "")
        print(f"| {name} | {statistics.median(t) * 1e3:.3f} | {ref or ''} | {ratio} |")


if __name__ == "__main__":
    main()
