#!/usr/bin/env python
"""The Transformer Engine path on a CUDA machine with TE installed (tools/gpu_check.sh, part 5).

Each variant (``stock``: megatron-core's own TE spec; or a strategy through our TE spec) trains N
optimizer steps on fixed random tokens, built as users run it: megatron-core's DDP (fp32
``main_grad``), TE's fused weight-gradient accumulation into it, megatron-core's optimizer (Adam,
bf16 with fp32 master weights, gradient clipping) and its micro-batch calculator (so the fold maps
its gradient once a step), ``--micro-batches`` micro-batches a step with the loss averaged and
``set_is_first_microbatch()`` before each step's first (TE quantizes the FP8 weights once a step,
as megatron-core's schedule has it). Precisions: ``bf16``, ``fp8-delayed`` (megatron-core's
``fp8_recipe='delayed'`` with amax history 1024 and ``max``, what examples/models.sh launches with
FP8=1) and ``fp8-current`` (``'tensorwise'``, current scaling); block scaling, MXFP8 and custom
recipes are refused with the scale vectors (config.UNSUPPORTED). Every variant starts from a
fresh TE FP8 state (``FP8GlobalStateManager.reset()``: no amax buffer of an earlier model is
updated). Reported per row: median step time and total peak ``torch.cuda.max_memory_allocated``,
each also as a ratio to ``shared`` in the same precision, the mean micro-batch loss of the last
step and its relative difference to the same variant's bf16 loss (an FP8 row that diverges shows
there). One process, TP=PP=1.

Usage: python tools/te_check.py [--variants stock shared unified] [--steps 20] [--micro-batches 4]
       [--precisions bf16 fp8-delayed fp8-current] [--num-experts 0] [--grouped-gemm]
       [--expert-vectors per_expert|shared]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

# precision -> megatron-core's fp8_recipe (megatron.core.enums.Fp8Recipe)
PRECISIONS = {"bf16": None, "fp8-delayed": "delayed", "fp8-current": "tensorwise"}
# delayed scaling as examples/models.sh launches it (--fp8-amax-history-len 1024
# --fp8-amax-compute-algo max); megatron-core's defaults (1, most_recent) are not what users run
DELAYED = dict(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")


def _fail(msg: str) -> None:
    print(f"te_check: {msg}", file=sys.stderr)
    sys.exit(2)


def _available(te_pytorch, name: str) -> tuple[bool, str]:
    """TE's own availability probe (``is_fp8_available`` ...); (ok, reason)."""
    probe = getattr(te_pytorch, name, None)
    if probe is None:
        return False, f"this TE has no {name}"
    got = probe(return_reason=True) if "return_reason" in probe.__code__.co_varnames else probe()
    return (bool(got[0]), str(got[1])) if isinstance(got, tuple) else (bool(got), "")


def _config(args, fp8_recipe):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
              num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
              ffn_hidden_size=args.ffn_hidden_size, normalization="RMSNorm",
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
              pipeline_dtype=torch.bfloat16, transformer_impl="transformer_engine",
              gradient_accumulation_fusion=False)
    if args.num_experts:
        kw.update(num_moe_experts=args.num_experts, moe_router_topk=args.topk,
                  moe_ffn_hidden_size=args.ffn_hidden_size // args.topk,
                  moe_grouped_gemm=args.grouped_gemm, moe_token_dispatcher_type="alltoall",
                  moe_aux_loss_coeff=0.0)
    if fp8_recipe:
        kw.update(fp8="hybrid", fp8_recipe=fp8_recipe)
        if fp8_recipe == "delayed":
            kw.update(DELAYED)
    return TransformerConfig(**kw)


def _model(config, variant, args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.specs import get_scalevec_block_spec

    spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=True)
            if variant == "stock" else get_scalevec_block_spec(
                config, ScaleVecConfig.from_string(variant, expert_vectors=args.expert_vectors)))
    return GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq_length,
                    position_embedding_type="rope")


def train(model, opt, micro_batches, steps, warmup=0, sync=None, finalize=None,
          forward_context=contextlib.nullcontext) -> tuple[list[float], float]:
    """``warmup + steps`` optimizer steps, each over every micro-batch in ``micro_batches``
    (``(inputs, positions, labels)``), gradients accumulated from the mean loss. Returns the
    step times after warmup and the last step's mean loss.

    Device-agnostic so a CPU test can check the FP8-relevant order: megatron-core DDP's
    ``zero_grad_buffer()`` (where the model has it) and ``set_is_first_microbatch()`` once per
    step, before its first forward; ``finalize(model)`` (megatron-core's
    ``finalize_model_grads``) before the optimizer step. ``sync`` (``torch.cuda.synchronize``
    on a GPU) runs around each timed step so the time covers the kernels, not their launch.
    ``forward_context``: around each micro-batch's forward and backward (a CPU test's
    ``te_stub.cuda_claimed``).
    """
    n = len(micro_batches)
    times, loss = [], None
    for step in range(warmup + steps):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        opt.zero_grad()
        model.set_is_first_microbatch()  # TE re-quantizes its FP8 weights on the next forward
        loss = 0.0
        for inputs, positions, labels in micro_batches:
            with forward_context():
                mb_loss = model(inputs, positions, None, labels=labels).float().mean() / n
                mb_loss.backward()
            loss = loss + mb_loss.detach()
        if finalize is not None:
            finalize(model)
        opt.step()
        if sync is not None:
            sync()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    return times, float(loss)


def fuse_wgrad_accumulation(model) -> int:
    """TE's linears (ours folded or megatron-core's) accumulate their weight gradient into
    ``main_grad``, as ``gradient_accumulation_fusion`` configures them (set here on the modules:
    the config flag would also ask APEX's kernel of megatron-core's own output layer); returns
    how many."""
    n = 0
    for m in model.modules():
        if hasattr(m, "fuse_wgrad_accumulation") and type(m).__module__.startswith(
                ("transformer_engine", "megatron.core.extensions", "megatron_scalevec.layers")):
            m.fuse_wgrad_accumulation = True
            if hasattr(m, "_fused_accumulation"):  # our folded TE linears (layers/te.py)
                m._fused_accumulation = True
            n += 1
    return n


def build(args, variant, precision, device="cuda") -> tuple:
    """(DDP model, megatron-core optimizer, finalize) for one row, from a fresh TE FP8 state
    and megatron-core's micro-batch calculator at ``--micro-batches``."""
    import torch
    from megatron.core import num_microbatches_calculator as calc
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.reset()  # no amax buffer of an earlier row's model survives
    calc.unset_num_microbatches_calculator()
    calc.init_num_microbatches_calculator(0, None, args.micro_batches * args.micro_batch_size,
                                          args.micro_batch_size, 1)
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    config = _config(args, PRECISIONS[precision])
    model = _model(config, variant, args).to(device)
    fuse_wgrad_accumulation(model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, weight_decay=0.1, bf16=True, clip_grad=1.0), [ddp])
    return ddp, opt, lambda m: finalize_model_grads([m])


def run_one(args, variant, precision) -> dict:
    import torch

    ddp, opt, finalize = build(args, variant, precision)
    g = torch.Generator(device="cuda").manual_seed(3)
    positions = torch.arange(args.seq_length, device="cuda").expand(args.micro_batch_size, -1)
    micro_batches = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, args.vocab, (args.micro_batch_size, args.seq_length + 1),
                               device="cuda", generator=g)
        micro_batches.append((tokens[:, :-1].contiguous(), positions, tokens[:, 1:].contiguous()))
    torch.cuda.reset_peak_memory_stats()
    times, loss = train(ddp, opt, micro_batches, args.steps, args.warmup,
                        sync=torch.cuda.synchronize, finalize=finalize)
    return dict(variant=variant, precision=precision, ms=1e3 * statistics.median(times),
                peak=torch.cuda.max_memory_allocated() / 2**30, loss=loss)


def report(rows) -> str:
    """Markdown table; ratios against ``shared`` in the same precision, the loss against the same
    variant in bf16 (relative difference: an FP8 row that diverges stands out)."""
    shared = {r["precision"]: r for r in rows if r["variant"] == "shared"}
    bf16 = {r["variant"]: r for r in rows if r["precision"] == "bf16"}
    out = ["| variant | precision | step ms | time vs shared | peak GiB | peak vs shared "
           "| loss after N | loss vs bf16 |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, b = shared.get(r["precision"]), bf16.get(r["variant"])
        rel = (f"{r['ms'] / s['ms']:.3f}", f"{r['peak'] / s['peak']:.3f}") if s else ("n/a",) * 2
        vs_bf16 = f"{(r['loss'] - b['loss']) / b['loss']:+.3%}" if b else "n/a"
        out.append(f"| {r['variant']} | {r['precision']} | {r['ms']:.1f} | {rel[0]} | "
                   f"{r['peak']:.2f} | {rel[1]} | {r['loss']:.4f} | {vs_bf16} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["stock", "shared", "unified"])
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    p.add_argument("--steps", type=int, default=20, help="optimizer steps timed")
    p.add_argument("--micro-batches", type=int, default=4,
                   help="micro-batches per optimizer step, gradients accumulated")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=5632)
    p.add_argument("--num-experts", type=int, default=0)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--grouped-gemm", action="store_true", help="TE grouped experts (TEGroupedMLP)")
    p.add_argument("--expert-vectors", choices=["per_expert", "shared"], default="per_expert",
                   help="one set of expert vectors per expert, or one per MoE layer")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.steps < 1 or args.micro_batches < 1:
        _fail("--steps and --micro-batches must be at least 1")
    import torch

    if not torch.cuda.is_available():
        _fail("needs a CUDA device (Transformer Engine's kernels); none is visible")
    try:
        import transformer_engine.pytorch as te_pytorch
    except Exception as err:  # TE's import raises RuntimeError without its libraries
        _fail(f"needs Transformer Engine with its extension ({type(err).__name__}: "
              f"{str(err).splitlines()[0] if str(err) else ''})")
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    probes = {"fp8-delayed": "is_fp8_available", "fp8-current": "is_fp8_available"}
    rows = []
    for precision in args.precisions:
        if precision in probes:
            ok, why = _available(te_pytorch, probes[precision])
            if not ok:
                print(f"skipped {precision}: {why or 'not supported here'}", flush=True)
                continue
        for variant in args.variants:
            rows.append(run_one(args, variant, precision))
            print(rows[-1], flush=True)
    print(report(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
