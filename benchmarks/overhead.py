"""Step time and memory of each scale-vector variant against megatron-core's stock local spec.

Every variant is built at the same size and seed and trained with the same megatron-core
machinery (DDP, optimizer, forward-backward schedule). Timing is interleaved: one step of
every variant per round, so drift of the machine hits all variants alike, and each ratio
compares medians over the rounds. Memory is reported as

* ``act``: bytes autograd saves for backward in one micro-batch (saved-tensor hooks, exact and
  deterministic on any device), where applying vectors to activations or to weights differs;
* ``state``: parameters + gradients + Adam moments;
* ``peak``: total peak memory of the variant, each in a fresh process (benchmarks/memory.py):
  peak resident memory on CPU with freed memory returned to the system, or
  ``torch.cuda.max_memory_allocated`` on a GPU; ``--no-memory`` skips it.

Ratios are printed against megatron-core's stock spec and against our ``shared`` in one table
(whichever of the two is among the variants). A time ratio is the median over rounds of the
ratio within each round (paired: a slow round slows both sides), and its ``±`` is half the
interquartile range of those per-round ratios.

A variant is ``stock``, a strategy, or ``strategy@opt[,opt]`` with ``weight`` / ``activation``
(ScaleVecConfig.apply_mode), ``compile`` / ``eager`` (the fused DNP kernels through
torch.compile, or not; default: what the trainer does, compiled, eager if compiling fails).
``--null`` times the
baseline twice (:func:`null_builds`): the run's noise floor, printed above the table.
``--host`` runs every variant again at the smallest width (:func:`host_args`), where the
arithmetic vanishes and what is left of a variant's excess is host work (Python, dispatch,
compiled-call wrappers, per-parameter optimizer loops), which a GPU overlaps with its kernels
once they are long enough: a second table (:func:`host_report`) prints that excess in ms and as
a share of the variant's excess at full width.

Every variant runs the same megatron-core optimizer (clipping at ``--clip-grad``) on
multi-tensor kernels, as GPUs do: torch's fused AdamW and torch's multi-tensor ops for the
gradient norm and clipping (benchmarks/multi_tensor.py); ``--cpu-fallbacks`` keeps
megatron-core's per-parameter CPU fallbacks. Each round starts one variant later than the
previous one, so no variant always runs right after the same one.
Every variant is built ``--instances`` times (default 2), every other set in reverse order,
and every model is timed in every round: on CPU a model's step time depends on where in the
sequence it was built, by more than the effects measured here. On CPU the process keeps
the heap memory it frees (benchmarks/heap.py, unless ``--system-malloc``), as torch's
CUDA caching allocator does; ``faults`` is the median count of minor page faults a step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time

import torch

from benchmarks import memory
from benchmarks.heap import keep_freed_memory, minor_faults
from benchmarks.multi_tensor import multi_tensor_adam, multi_tensor_kernels
from megatron_scalevec import ScaleVecConfig

__all__ = ["host_args", "host_report", "kept_bytes", "main", "multi_tensor_adam",
           "multi_tensor_kernels", "null_builds", "paired_diff", "paired_ratio", "parse_variant",
           "report", "run", "saved_activation_bytes"]

DEFAULT_VARIANTS = ["stock", "shared", "hg", "hg+dp", "hg+dp@activation", "hg+dnp",
                    "hg+dnp+or", "hg+dnp+er", "unified"]


def parse_variant(name: str):
    """(ScaleVecConfig or None for ``stock``, fused compile mode) of a variant name."""
    strategy, _, opts = name.partition("@")
    mode, compile_mode = "auto", "auto"
    for opt in filter(None, opts.split(",")):
        if opt in ("weight", "activation"):
            mode = opt
        elif opt in ("compile", "eager"):
            compile_mode = {"compile": "on", "eager": "off"}[opt]
        else:
            raise ValueError(f"variant {name!r}: unknown option {opt!r} (expected weight, "
                             f"activation, compile or eager)")
    if strategy == "stock":
        return None, compile_mode
    return ScaleVecConfig.from_string(strategy, apply_mode=mode), compile_mode


def storages(t: torch.Tensor) -> list:
    """``t``'s storage, or a wrapper subclass's (TE's ``Float8Tensor``) inner tensors'."""
    try:
        t.untyped_storage().data_ptr()  # raises for a wrapper subclass
    except RuntimeError:  # "invalid python storage": a wrapper subclass
        return [v.untyped_storage() for v in vars(t).values() if isinstance(v, torch.Tensor)]
    return [t.untyped_storage()]


def saved_activation_bytes(fn) -> int:
    """Bytes of tensors autograd saves while running ``fn`` (counted once per storage)."""
    seen, total = set(), [0]

    def pack(t):
        for s in storages(t):
            key = (s.data_ptr(), s.nbytes())
            if key not in seen:
                seen.add(key)
                total[0] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


def kept_bytes(fn) -> int:
    """Bytes still held, once ``fn`` has returned, by the storages autograd saved while it
    ran (counted once per storage): what a forward keeps for its backward. Unlike
    :func:`saved_activation_bytes` it sees a saved tensor whose storage was released after
    the forward (layers/fold.py's folded weights under TE)."""
    saved = {}

    def pack(t):
        for s in storages(t):
            saved.setdefault(s.data_ptr(), s)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    kept = sum(s.nbytes() for s in saved.values())
    del out
    return kept


def _state_bytes(model) -> int:
    # fp32 main grads + two Adam moments per parameter, plus the parameters themselves.
    return sum(p.numel() * (p.element_size() + 4 + 8) for p in model.parameters())


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def model_config(args):
    """The benchmark model's TransformerConfig (one place to add model or expert options)."""
    from scalevec_testing import models as M

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config_kw = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads,
                     num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
                     bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype,
                     use_cpu_initialization=args.device != "cuda")
    if args.num_experts:
        config_kw.update(num_moe_experts=args.num_experts, moe_router_topk=args.topk,
                         moe_ffn_hidden_size=args.ffn_hidden_size // args.topk,
                         moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
    return M.tiny_config(**config_kw)


def config_of(name: str, args):
    """The TransformerConfig of a variant's row (``/grouped``: our grouped experts)."""
    config = model_config(args)
    if name.removesuffix(NULL).endswith("/grouped"):
        config = copy.deepcopy(config)
        config.moe_grouped_gemm = True
    return config


def batches(args) -> list:
    from scalevec_testing import models as M

    M.VOCAB, M.SEQ = args.vocab, args.seq_length
    data = M.batches(args.micro_batches, args.micro_batch_size)
    if args.device == "cuda":
        data = [{k: v.cuda() for k, v in b.items()} for b in data]
    return data


def build_row(name: str, cfg, args, data) -> dict:
    """A variant built, wrapped in DDP with its optimizer, and its memory counted."""
    from scalevec_testing import models as M

    strategy, compile_mode = parse_variant(name.removesuffix(NULL).removesuffix("/grouped"))
    model = M.build_gpt(cfg, strategy)
    if args.device == "cuda":
        model = model.cuda()
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    n_params = sum(p.numel() for p in model.parameters())
    b = data[0]
    act = saved_activation_bytes(
        lambda m=model, b=b: m(b["tokens"], b["position_ids"], None, labels=b["labels"]))
    ddp = M.wrap_ddp(model, cfg)
    opt = M.make_optimizer(ddp, lr=1e-4, clip_grad=args.clip_grad, bf16=args.bf16)
    if not args.cpu_fallbacks:
        multi_tensor_adam(opt)
    return dict(name=name, config=cfg, model=model, ddp=ddp, opt=opt, params=n_params,
                act=act, state=_state_bytes(model), times=[], faults=[], peak=None,
                compile=compile_mode)


def run(args) -> list:
    """Build, train and time every variant; all of them under megatron-core's multi-tensor
    stand-ins (:func:`multi_tensor_kernels`) unless ``--cpu-fallbacks``."""
    with contextlib.nullcontext() if args.cpu_fallbacks else multi_tensor_kernels():
        return _run(args)


def _run(args) -> list:
    from megatron_scalevec import compile
    from scalevec_testing import models as M

    cuda = args.device == "cuda"
    data = batches(args)
    builds = [(name, config_of(name, args)) for name in args.variants]
    if args.grouped_gemm and args.num_experts:
        builds += [(f"{n}/grouped", config_of(f"{n}/grouped", args))
                   for n in args.variants if n != "stock"]
    builds += null_builds(builds, args.baseline) if args.null else []
    rows = [build_row(name, cfg, args, data) for name, cfg in
            _build_order(builds, args.instances)]
    saved_mode = compile.mode()
    for _ in range(args.warmup):
        for r in rows:
            compile.set_mode(r["compile"])
            M.train_steps(r["ddp"], r["config"], data, 1, r["opt"])
    for i in range(args.repeats):
        # Each round starts one variant later: none always runs right after the same one.
        for r in rows[i % len(rows):] + rows[:i % len(rows)]:
            compile.set_mode(r["compile"])
            _sync(cuda)
            f0, t0 = minor_faults(), time.perf_counter()
            M.train_steps(r["ddp"], r["config"], data, 1, r["opt"])
            _sync(cuda)
            r["times"].append(time.perf_counter() - t0)
            r["faults"].append(minor_faults() - f0)
    if cuda:
        for r in rows:
            _device_ledger(r, data)
    rows = _merge_instances(rows)
    compile.set_mode(saved_mode)
    return rows


def _device_ledger(r, data) -> None:
    """On CUDA, two columns of the GPU cost ledger (docs/benchmarks.md): bytes one micro-batch
    keeps for its backward (benchmarks/ledger.py) and synchronizing CUDA calls a micro-batch
    (from a step of 1 and one of ``len(data)`` micro-batches)."""
    from benchmarks.host_syncs import cuda_syncs
    from benchmarks.ledger import kept_bytes as kept
    from scalevec_testing import models as M

    b = data[0]
    r["ddp"].zero_grad_buffer()  # a step's first micro-batch, as the fold counts them
    r["kept"] = kept(lambda: r["ddp"](b["tokens"], b["position_ids"], None, labels=b["labels"]))
    one, m = (cuda_syncs(lambda k=k: M.train_steps(r["ddp"], r["config"], data[:k], 1, r["opt"]))
              for k in (1, len(data)))
    r["syncs_mb"] = (m - one) / max(len(data) - 1, 1)


NULL = "#null"


def null_builds(builds: list, baseline: str) -> list:
    """``--null``: the baseline once more, built and timed as a variant of its own (row
    ``BASELINE#null``). It computes exactly what the baseline does, so its ratio to the
    baseline is this run's noise floor: a ratio that differs from 1 by less than that is not
    resolved by the run."""
    base = [(name + NULL, cfg) for name, cfg in builds if name == baseline]
    if not base:
        raise ValueError(f"--null: the baseline {baseline!r} is not among the variants "
                         f"{[name for name, _ in builds]}")
    return base


def _build_order(builds: list, instances: int) -> list:
    """The builds in the order the models are built: every other instance in reverse,
    so each variant's mean build position is the same. The step time of a model depends on
    where it was built (on CPU the last-built of four ran 1.5-2% slower than the first:
    the same model first or last, 0.985x or 1.019x); mirrored instances cancel that."""
    return [b for k in range(instances) for b in (builds if k % 2 == 0 else builds[::-1])]


def _merge_instances(rows: list) -> list:
    """One row per variant, first-built order: ``runs`` holds each instance's step times
    (paired with the same instance of another variant), ``times`` all of them; memory and
    the fold from the first instance, the peak the largest."""
    merged: dict = {}
    for r in rows:
        m = merged.setdefault(r["name"], dict(r, runs=[], times=[], faults=[], peak=None))
        m["runs"].append(r["times"])
        m["times"] = m["times"] + r["times"]
        m["faults"] = m["faults"] + r["faults"]
        if r["peak"] is not None:
            m["peak"] = max(m["peak"] or 0, r["peak"])
    return list(merged.values())


def _half_iqr(values) -> float:
    q = sorted(values)
    return (q[int(0.75 * (len(q) - 1))] - q[int(0.25 * (len(q) - 1))]) / 2


def _pairs(runs, base_runs):
    """(t, b) over rounds and instances, each instance's rounds paired with the same
    instance of the base."""
    return ((t, b) for run, base in zip(runs, base_runs) for t, b in zip(run, base))


def paired_ratio(runs, base_runs):
    """(median, half interquartile range) over :func:`_pairs` of run[i] / base_run[i]."""
    q = [t / b for t, b in _pairs(runs, base_runs)]
    return statistics.median(q), _half_iqr(q)


def paired_diff(runs, base_runs) -> float:
    """Median over :func:`_pairs` of run[i] - base_run[i] (seconds)."""
    return statistics.median(t - b for t, b in _pairs(runs, base_runs))


def host_args(args):
    """``args`` at the smallest width the model allows (head dim 4, FFN twice the hidden
    size, 16 tokens of one sequence, vocabulary 256), everything else as given: a step that
    does next to no arithmetic, so what a variant adds there is host work."""
    small = copy.copy(args)
    small.hidden_size = 4 * args.num_attention_heads
    small.ffn_hidden_size = 2 * small.hidden_size * max(1, args.topk // 2)
    small.seq_length, small.micro_batch_size, small.vocab = 16, 1, 256
    return small


def host_report(rows, host_rows, base_name: str) -> str:
    """Each variant's excess over ``base_name`` at the smallest width (``host_rows``) in ms,
    and as a share of its excess at full width (``rows``, same variants)."""
    full = {r["name"]: r for r in rows}
    by = {r["name"]: r for r in host_rows}
    base = by[base_name] if base_name in by else host_rows[0]
    lines = [f"host work: every variant at hidden {base['config'].hidden_size}, "
             f"{base['config'].ffn_hidden_size} FFN, 16 tokens (--host)",
             "| variant | step ms | excess ms | full-width excess ms | host share |",
             "|---|---|---|---|---|"]
    for r in host_rows:
        ex = paired_diff(r["runs"], base["runs"]) * 1e3
        full_ex = paired_diff(full[r["name"]]["runs"], full[base["name"]]["runs"]) * 1e3
        share = f"{ex / full_ex:.2f}" if r is not base and full_ex > 0 else "n/a"
        lines.append(f"| {r['name']} | {statistics.median(r['times']) * 1e3:.1f} | {ex:.1f} | "
                     f"{full_ex:.1f} | {share} |")
    return "\n".join(lines)


def report(rows, base_name: str) -> str:
    """One markdown table: each variant against stock and shared (those present) and
    ``base_name``."""
    names = [r["name"] for r in rows]
    refs = [n for n in dict.fromkeys(["stock", "shared", base_name]) if n in names] or \
        [names[0]]
    by = {r["name"]: r for r in rows}
    med = {r["name"]: statistics.median(r["times"]) for r in rows}
    base = by[base_name] if base_name in by else by[refs[0]]
    lines = [f"baseline: {base['name']} median step {med[base['name']] * 1e3:.1f} ms"]
    null = by.get(base["name"] + NULL)
    if null is not None:
        floor, spread = paired_ratio(null["runs"], base["runs"])
        lines.append(f"noise floor: {null['name']} (the baseline built again) {floor:.3f}x "
                     f"(±{spread:.3f}) of {base['name']}")
    head = ["variant", "params", "+params", "step ms", "spread"]
    head += [f"time/{n}" for n in refs] + [f"± vs {base['name']}", "act MiB"]
    head += [f"act/{n}" for n in refs]
    head += ["state ratio", "faults", "peak MiB"] + [f"peak/{n}" for n in refs]
    device = "kept" in base  # CUDA: the ledger's kept bytes and synchronizing calls
    head += ["kept MiB", *(f"kept/{n}" for n in refs), "syncs/mb"] if device else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = med[r["name"]]
        spread = 2 * _half_iqr(r["times"]) / m
        extra = (r["params"] - base["params"]) / base["params"]
        cells = [r["name"], f"{r['params']:,}", f"{extra:.2e}", f"{m * 1e3:.1f}",
                 f"±{spread * 50:.1f}%"]
        cells += [f"{paired_ratio(r['runs'], by[n]['runs'])[0]:.3f}" for n in refs]
        cells += [f"±{paired_ratio(r['runs'], base['runs'])[1]:.3f}",
                  f"{r['act'] / 2**20:.1f}"]
        cells += [f"{r['act'] / by[n]['act']:.3f}" for n in refs]
        cells += [f"{r['state'] / base['state']:.4f}", f"{statistics.median(r['faults']):.0f}",
                  f"{r['peak'] / 2**20:.0f}" if r["peak"] else "n/a"]
        cells += [f"{r['peak'] / by[n]['peak']:.3f}" if r["peak"] and by[n]["peak"] else "n/a"
                  for n in refs]
        if device:
            cells += [f"{r['kept'] / 2**20:.1f}", *(f"{r['kept'] / max(by[n]['kept'], 1):.3f}"
                                                    for n in refs), f"{r['syncs_mb']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
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
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's own)")
    p.add_argument("--cpu-fallbacks", "--adam-loop", dest="cpu_fallbacks", action="store_true",
                   help="keep megatron-core's CPU fallbacks (torch AdamW's per-parameter loop, "
                        "the per-tensor gradient norm and clipping loops) instead of "
                        "multi-tensor kernels (fused AdamW, torch._foreach_*), as GPUs run")
    p.add_argument("--clip-grad", type=float, default=1.0,
                   help="megatron-core's clip_grad (default 1.0, as the trainer; 0: no "
                        "gradient norm, no clipping)")
    p.add_argument("--null", action="store_true",
                   help="also build and time the baseline a second time (row BASELINE#null): "
                        "its ratio to the baseline is the run's noise floor")
    p.add_argument("--host", action="store_true",
                   help="also run every variant at the smallest width and print each one's "
                        "excess there (host work) and its share of the full-width excess")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the total peak memory of each variant (a fresh process each)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--instances", type=int, default=2,
                   help="models built per variant, every other set in reverse build order "
                        "(a model's speed depends on where it was built); all timed in "
                        "every round")
    p.add_argument("--system-malloc", action="store_true",
                   help="CPU: leave glibc's malloc as it is (default: keep freed heap memory, "
                        "as a caching allocator does; benchmarks/heap.py)")
    return p


def setup(args, keep_heap: bool) -> str:
    """Threads, the CPU layer, a one-rank process group and megatron-core's parallel state;
    returns how the CPU heap is run (``kept``: benchmarks/heap.py)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    heap = "system"
    if args.device == "cpu":
        from megatron_scalevec.compat.cpu import enable_cpu_compat

        enable_cpu_compat()
        if keep_heap and not args.system_malloc and keep_freed_memory():
            heap = "kept"

    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from scalevec_testing import init_model_parallel

    if not dist.is_initialized():  # one process, an in-process store: no port to share
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    init_model_parallel()
    model_parallel_cuda_manual_seed(1)
    return heap


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    heap = setup(args, keep_heap=True)
    rows = run(args)
    if not args.no_memory:
        peaks = memory.peaks([r["name"] for r in rows], argv)
        for r in rows:
            r["peak"] = peaks[r["name"]]
    print(f"device={args.device} bf16={args.bf16} threads={torch.get_num_threads()} "
          f"layers={args.num_layers} hidden={args.hidden_size} ffn={args.ffn_hidden_size} "
          f"experts={args.num_experts} seq={args.seq_length} mbs={args.micro_batch_size} "
          f"micro_batches={args.micro_batches} repeats={args.repeats} "
          f"instances={args.instances} heap={heap}")
    print(report(rows, args.baseline))
    if args.host:  # a run of its own: its kernels compile afresh for its shapes
        torch._dynamo.reset()
        print(host_report(rows, run(host_args(args)), args.baseline))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
