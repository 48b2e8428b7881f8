"""Step time and memory of each scale-vector variant against megatron-core's stock local spec.

Every variant is built at the same size and seed and trained with the same megatron-core
machinery (DDP, optimizer, forward-backward schedule). Timing is interleaved: one step of
every variant per round, so drift of the machine hits all variants alike, and each ratio
compares medians over the rounds. Memory is reported as

* ``act``: bytes autograd saves for backward in one micro-batch (saved-tensor hooks, exact and
  deterministic on any device), where applying vectors to activations or to weights differs;
* ``state``: parameters + gradients + Adam moments;
* ``peak``: on a GPU, ``torch.cuda.max_memory_allocated`` of a step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_scalevec import ScaleVecConfig

DEFAULT_VARIANTS = ["stock", "shared", "hg", "hg+dp", "hg+dp@activation", "hg+dnp",
                    "hg+dnp+or", "hg+dnp+er", "unified"]


def parse_variant(name: str):
    """``stock`` (megatron-core local spec), a strategy, or ``strategy@mode``."""
    if name == "stock":
        return None
    strategy, _, mode = name.partition("@")
    return ScaleVecConfig.from_string(strategy, apply_mode=mode or "auto")


def saved_activation_bytes(fn) -> int:
    """Bytes of tensors autograd saves while running ``fn`` (counted once per storage)."""
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def _state_bytes(model) -> int:
    # fp32 main grads + two Adam moments per parameter, plus the parameters themselves.
    return sum(p.numel() * (p.element_size() + 4 + 8) for p in model.parameters())


def run(args) -> list:
    from megatron.core import parallel_state

    from megatron_scalevec.testing import models as M

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    M.VOCAB, M.SEQ = args.vocab, args.seq_length
    config_kw = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads,
                     num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
                     bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype,
                     use_cpu_initialization=not cuda)
    if args.num_experts:
        config_kw.update(num_moe_experts=args.num_experts, moe_router_topk=args.topk,
                         moe_ffn_hidden_size=args.ffn_hidden_size // args.topk,
                         moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
    config = M.tiny_config(**config_kw)
    data = M.batches(args.micro_batches, args.micro_batch_size)
    if cuda:
        data = [{k: v.cuda() for k, v in b.items()} for b in data]
    import copy

    grouped = copy.deepcopy(config)  # --grouped-gemm: our grouped experts (stock has none)
    grouped.moe_grouped_gemm = True
    builds = [(name, config) for name in args.variants]
    if args.grouped_gemm and args.num_experts:
        builds += [(f"{n}/grouped", grouped) for n in args.variants if n != "stock"]
    rows = []
    for name, cfg in builds:
        model = M.build_gpt(cfg, parse_variant(name.removesuffix("/grouped")))
        if cuda:
            model = model.cuda()
        if args.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        n_params = sum(p.numel() for p in model.parameters())
        b = data[0]
        act = saved_activation_bytes(
            lambda m=model, b=b: m(b["tokens"], b["position_ids"], None, labels=b["labels"]))
        ddp = M.wrap_ddp(model, config)
        opt = M.make_optimizer(ddp, lr=1e-4)
        rows.append(dict(name=name, config=cfg, model=model, ddp=ddp, opt=opt, params=n_params,
                         act=act, state=_state_bytes(model), times=[], peak=None))
    for _ in range(args.warmup):
        for r in rows:
            M.train_steps(r["ddp"], r["config"], data, 1, r["opt"])
    for _ in range(args.repeats):
        for r in rows:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            M.train_steps(r["ddp"], r["config"], data, 1, r["opt"])
            if cuda:
                torch.cuda.synchronize()
                r["peak"] = torch.cuda.max_memory_allocated()
            r["times"].append(time.perf_counter() - t0)
    del parallel_state
    return rows


def report(rows, base_name: str) -> str:
    base = next((r for r in rows if r["name"] == base_name), rows[0])
    t0 = statistics.median(base["times"])
    lines = [f"baseline: {base['name']} median step {t0 * 1e3:.1f} ms",
             "| variant | params | +params | step ms (median) | spread | time ratio | "
             "act MiB | act ratio | state ratio | peak ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        med = statistics.median(r["times"])
        q = sorted(r["times"])
        spread = (q[int(0.75 * (len(q) - 1))] - q[int(0.25 * (len(q) - 1))]) / med
        peak = (f"{r['peak'] / base['peak']:.3f}" if r["peak"] and base["peak"] else "n/a")
        extra = (r["params"] - base["params"]) / base["params"]
        lines.append(
            f"| {r['name']} | {r['params']:,} | {extra:.2e}"
            f" | {med * 1e3:.1f} | ±{spread * 50:.1f}% | {med / t0:.3f} | "
            f"{r['act'] / 2**20:.1f} | {r['act'] / base['act']:.3f} | "
            f"{r['state'] / base['state']:.4f} | {peak} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--baseline", default="stock")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=4)
    p.add_argument("--ffn-hidden-size", type=int, default=704)
    p.add_argument("--num-experts", type=int, default=0)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--grouped-gemm", action="store_true",
                   help="MoE: also run every variant but stock with grouped-GEMM experts "
                        "(rows 'VARIANT/grouped'; the others use sequential experts)")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.device == "cpu":
        from megatron_scalevec.compat.cpu import enable_cpu_compat

        enable_cpu_compat()
    import os

    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_scalevec.testing import init_model_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0,
                                world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    init_model_parallel()
    model_parallel_cuda_manual_seed(1)
    rows = run(args)
    print(f"device={args.device} bf16={args.bf16} threads={torch.get_num_threads()} "
          f"layers={args.num_layers} hidden={args.hidden_size} ffn={args.ffn_hidden_size} "
          f"experts={args.num_experts} seq={args.seq_length} mbs={args.micro_batch_size} "
          f"repeats={args.repeats}")
    print(report(rows, args.baseline))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
