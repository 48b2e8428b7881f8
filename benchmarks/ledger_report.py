"""The GPU cost ledger: what each scale-vector variant costs a GPU against megatron-core's stock
spec and our ``shared``, per layout (local, Transformer Engine) and model (dense, MoE with grouped
experts), measured on CPU with benchmarks/ledger.py's methods.

Every model runs in forked gloo ranks (scalevec_testing/distributed.py); TE models run TE's real
Python over the test-only CPU stand-in (scalevec_testing/te_stub.py), as the TE tests do. The
optimizer's learning rate is 0, so every step routes MoE tokens alike and per-step counts are the
same at any micro-batch count; steps at 1 and at ``--ledger-micro-batches`` micro-batches are solved
for the per-step and per-micro-batch parts (ledger.split). Peak memory reuses benchmarks/memory.py
(local layout; the TE layout has no CPU peak: its stand-in kernels are not TE's).
docs/benchmarks.md, "GPU cost ledger", defines every column.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
import statistics
import sys
import time

import torch

from benchmarks import memory, overhead
from benchmarks.ledger import Collectives, HostSyncs, Traffic, kept_bytes, split

VARIANTS = ["stock", "shared", "hg+dp", "hg+dnp", "unified"]
# (name, tensor parallel, sequence parallel, expert parallel): the layouts collectives are
# counted at, each on two gloo ranks
PARALLEL = [("TP2", 2, False, 1), ("TP2+SP", 2, True, 1), ("EP2", 1, False, 2)]
# the weights that carry scale vectors: attention QKV, MLP fc1, every expert's fc1
FOLDED = re.compile(r"(linear_qkv|linear_fc1)\.weight\d*$")


# ----------------------------------------------------------------- one model, in a rank
def _config(args, layout: str, moe: bool, stock: bool, sp: bool = False, ep: int = 1):
    """overhead.model_config's model at this layout; MoE: grouped experts (stock local:
    megatron-core's local spec has no CPU grouped GEMM, so its sequential experts)."""
    a = copy.copy(args)
    a.num_experts = args.num_experts if moe else 0
    cfg = overhead.model_config(a)
    kw = dict(transformer_impl="transformer_engine" if layout == "te" else "local",
              sequence_parallel=sp)
    if layout == "te" and args.fp8:  # TE's FP8 GEMMs (the stand-in's casts and GEMMs)
        kw.update(fp8="hybrid", fp8_recipe=args.fp8)
    if moe:
        kw.update(moe_grouped_gemm=not (stock and layout == "local"),
                  expert_model_parallel_size=ep)
    return dataclasses.replace(cfg, **kw)


def _build(name: str, cfg, layout: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from scalevec_testing import models as M
    from scalevec_testing import te_stub

    strategy, _ = overhead.parse_variant(name)
    if layout == "local":
        return M.build_gpt(cfg, strategy)
    with te_stub.cuda_claimed():
        if strategy is not None:
            return M.build_gpt(cfg, strategy)
        torch.manual_seed(7)  # as M.build_gpt seeds
        model_parallel_cuda_manual_seed(7)
        return GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=True),
                        vocab_size=M.VOCAB, max_sequence_length=M.SEQ,
                        position_embedding_type="rope")


class _Trainer:
    """A variant wrapped in megatron-core's DDP and optimizer (learning rate 0), trained one
    step of ``m`` micro-batches at a time."""

    def __init__(self, name, cfg, layout, args):
        from megatron.core import parallel_state

        from scalevec_testing import models as M
        from scalevec_testing import te_stub

        self.M, self.cfg = M, cfg
        self.model = _build(name, cfg, layout)
        if cfg.bf16:  # bf16 weights, fp32 main_grad and master weights, as Megatron-LM's --bf16
            from megatron.core.transformer.module import Float16Module

            self.model = Float16Module(cfg, self.model)
        if layout == "te":  # TE's linears accumulate wgrad into main_grad, as Megatron-LM's default
            M.te_fused_wgrad_accumulation(self.model)
        self.ddp = M.wrap_ddp(self.model, cfg)
        self.opt = M.make_optimizer(self.ddp, lr=0.0, clip_grad=args.clip_grad, bf16=cfg.bf16)
        if not args.cpu_fallbacks:
            overhead.multi_tensor_adam(self.opt)
        self.context = te_stub.cuda_claimed if layout == "te" else None
        self.dp = parallel_state.get_data_parallel_world_size()
        self.data = overhead.batches(_n_batches(args, self.dp))
        self.folded = sum(p.numel() for n, p in self.model.named_parameters()
                          if FOLDED.search(n))

    def step(self, m: int) -> None:
        self.M.train_steps(self.ddp, self.cfg, self.data[:m * self.dp], 1, self.opt,
                           forward_context=self.context)

    def forward(self, first: bool = True):
        if first:
            self.ddp.zero_grad_buffer()  # a step's first micro-batch (the fold counts them)
        b = self.data[0]
        return self.model(b["tokens"], b["position_ids"], None, labels=b["labels"])


def _n_batches(args, dp):
    a = copy.copy(args)
    a.micro_batches = args.ledger_micro_batches * dp
    return a


def _start(layout: str, args, tp: int = 1, ep: int = 1, threads=None) -> None:
    """In a forked rank: threads, TE's Python over the stand-in, parallel state, data sizes."""
    from scalevec_testing import init_model_parallel
    from scalevec_testing import models as M

    if threads:
        torch.set_num_threads(threads)
    if layout == "te":
        from scalevec_testing import OPT_IN, te_stub

        os.environ[OPT_IN] = "1"  # TE's real Python over the test-only stand-in, by design

        te_stub.activate()
    init_model_parallel(tp=tp, ep=ep)
    M.VOCAB, M.SEQ = args.vocab, args.seq_length


def _single(rank, world, layout, moe, args) -> dict:
    """World 1: kept bytes, traffic, host syncs, step time, folded parameters per variant."""
    from benchmarks.multi_tensor import multi_tensor_kernels

    _start(layout, args, threads=args.threads or 2)
    m, out = args.ledger_micro_batches, {}
    with multi_tensor_kernels():
        for name in args.variants:
            t = _Trainer(name, _config(args, layout, moe, name == "stock"), layout, args)
            for _ in range(args.warmup):  # first-call caches, optimizer state, compiling
                t.step(1)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                t.step(m)
                times.append(time.perf_counter() - t0)
            row = dict(folded=t.folded, ms=statistics.median(times) * 1e3)
            for k in (1, m):  # every aten op; then our fused bodies as one kernel each
                with Traffic() as tr:
                    t.step(k)
                with _fused_as_one_op() as row["fused_one_op"], Traffic() as fused:
                    t.step(k)
                row[f"traffic{k}"], row[f"fused{k}"] = tr.bytes, fused.bytes
                row[f"ops{k}"] = dict(tr.by_op)
            with t.context() if t.context else contextlib.nullcontext():
                # the step's first micro-batch also makes what the step keeps (the vectors'
                # values, once a step); the second, with the first in flight, what every
                # micro-batch in flight keeps (what pipeline depth multiplies)
                row["kept_first"] = kept_bytes(t.forward)
                first = t.forward()
                row["kept"] = kept_bytes(functools.partial(t.forward, first=False),
                                         exclude=[first])
                del first
                row["hooks"] = overhead.saved_activation_bytes(t.forward)
            for k in (1, 2):
                with HostSyncs() as hs:
                    t.step(k)
                row[f"syncs{k}"] = dict(hs.calls)
            out[name] = row
    return out


def _collectives(rank, world, layout, moe, args, tp, sp, ep) -> dict:
    """World 2 at one parallel layout: rank 0's collectives by name at 1 and 2 micro-batches."""
    _start(layout, args, tp=tp, ep=ep)
    out = {}
    for name in args.variants:
        try:
            t = _Trainer(name, _config(args, layout, moe, name == "stock", sp, ep), layout, args)
        except Exception as err:  # noqa: BLE001  a layout the spec refuses: a note, not a stop
            out[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
            continue
        t.step(1)
        for k in (1, 2):
            with Collectives() as c:
                t.step(k)
            out.setdefault(name, {})[k] = dict(c.calls)
    return out if rank == 0 else {}


@contextlib.contextmanager
def _fused_as_one_op():
    """Our fused kernel bodies (compile.py ``kernel``: compiled on a GPU, eager under a
    dispatch mode) each counted as one kernel by Traffic; a no-op if the layers have none."""
    import importlib

    try:
        compile = importlib.import_module("megatron_scalevec.compile")
    except ImportError:
        compile = None
    original = getattr(compile, "kernel", None)
    if original is None:
        yield False
        return

    def kernel(fn, *args, **kwargs):
        return Traffic.one_op(fn, fn.__name__) if Traffic.active else original(fn, *args,
                                                                              **kwargs)

    compile.kernel = kernel
    try:
        yield True
    finally:
        compile.kernel = original


# ----------------------------------------------------------------- the tables
def measure(args, layout: str, moe: bool) -> dict:
    """Every column of one table: {variant: row}, plus ``coll`` {parallel: per-variant
    counts or the error that layout raised}."""
    from scalevec_testing.distributed import RankError, run_on_ranks

    rows = run_on_ranks(_single, 1, layout, moe, args, timeout=args.timeout)[0]
    coll = {}
    for pname, tp, sp, ep in PARALLEL if not args.no_collectives else []:
        if ep > 1 and not moe:
            continue
        try:
            coll[pname] = run_on_ranks(_collectives, 2, layout, moe, args, tp, sp, ep,
                                       timeout=args.timeout)[0]
        except RankError as err:  # a layout megatron-core refuses (MoE at TP2 needs SP)
            coll[pname] = str(err).strip().splitlines()[-1][:120]
    peaks = {}
    if layout == "local" and not args.no_memory:
        names = {v: (v if v == "stock" or not moe else f"{v}/grouped") for v in args.variants}
        got = memory.peaks(list(names.values()), _overhead_argv(args, moe))
        peaks = {v: got[n] for v, n in names.items()}
    return dict(rows=rows, coll=coll, peaks=peaks)


def _overhead_argv(args, moe: bool) -> list:
    """benchmarks/memory.py's child arguments for this ledger's model."""
    argv = ["--num-layers", args.num_layers, "--hidden-size", args.hidden_size,
            "--num-attention-heads", args.num_attention_heads, "--num-query-groups",
            args.num_query_groups, "--ffn-hidden-size", args.ffn_hidden_size, "--seq-length",
            args.seq_length, "--vocab", args.vocab, "--micro-batch-size",
            args.micro_batch_size, "--micro-batches", args.ledger_micro_batches,
            "--clip-grad", args.clip_grad, "--device", "cpu"]
    if moe:
        argv += ["--num-experts", args.num_experts, "--topk", args.topk, "--grouped-gemm"]
    return [str(a) for a in argv] + (["--cpu-fallbacks"] if args.cpu_fallbacks else [])


def _syncs_per_mb(row) -> float:
    one, two = (sum(row[f"syncs{k}"].values()) for k in (1, 2))
    return split(one, two, 2)[1]


def _reference(counts) -> tuple:
    """(name, counts) of the variant collectives are compared with: stock, else ``shared``
    where the layout refused stock (the local spec's torch norm has no SP), else none."""
    for ref in ("stock", "shared"):
        if isinstance(counts.get(ref), dict):
            return ref, counts[ref]
    return None, None


def _coll_cell(counts, name, layers) -> str:
    """Collectives per layer a micro-batch / a step that ``name`` adds to stock (``vs
    shared``: stock was refused there)."""
    if isinstance(counts, str) or isinstance(counts.get(name), str):
        return "n/a"
    ref, base = _reference(counts)
    total = {k: sum(counts[name][k].values()) - (sum(base[k].values()) if base else 0)
             for k in (1, 2)}
    step, mb = split(total[1], total[2], 2)
    note = "" if ref == "stock" else " vs shared" if ref else " abs"
    return f"{mb / layers:+.3g} / {step / layers:+.3g}{note}"


def report(args, layout: str, moe: bool, res: dict) -> str:
    """One markdown table; a footnote per parallel layout names the collectives added."""
    rows, coll, peaks = res["rows"], res["coll"], res["peaks"]
    m, layers = args.ledger_micro_batches, args.num_layers
    refs = [r for r in ("stock", "shared") if r in rows]
    stock = rows.get("stock") or next(iter(rows.values()))
    folded = stock["folded"]
    base = "stock" if "stock" in rows else next(iter(rows))
    parts = {v: split(r["traffic1"], r[f"traffic{m}"], m) for v, r in rows.items()}
    fused = {v: split(r["fused1"], r[f"fused{m}"], m) for v, r in rows.items()}
    s_step, s_mb = parts[base]
    kind = f"MoE, {args.num_experts} experts top-{args.topk}, grouped" if moe else "dense"
    precision = f", FP8 {args.fp8}" if layout == "te" and args.fp8 else \
        (", bf16" if args.bf16 else ", fp32")
    lines = [f"### {layout} layout{precision}, {kind}: {layers} layers, hidden "
             f"{args.hidden_size}, seq "
             f"{args.seq_length}, micro-batch {args.micro_batch_size}; {folded:,} folded "
             f"parameters; stock traffic {s_mb / folded:.1f} B/folded param a micro-batch, "
             f"{s_step / folded:.1f} a step"]
    head = ["variant", "kept MiB"] + [f"kept/{r}" for r in refs] + [
        "kept KiB step", "hooks MiB", "+traffic B/fp mb", "+traffic B/fp step", "+fused B/fp mb",
        "+fused B/fp step"]
    head += [f"+coll/layer {p} mb / step" for p in coll] + ["syncs/mb", "step ms"]
    head += ["peak MiB"] + [f"peak/{r}" for r in refs] if peaks else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v, r in rows.items():
        step, mb = parts[v]
        cells = [v, f"{r['kept'] / 2**20:.2f}"]
        cells += [f"{r['kept'] / rows[x]['kept']:.3f}" for x in refs]
        cells += [f"{(r['kept_first'] - r['kept']) / 2**10:.0f}",
                  f"{r['hooks'] / 2**20:.2f}", f"{(mb - s_mb) / folded:+.1f}",
                  f"{(step - s_step) / folded:+.1f}",
                  f"{(fused[v][1] - fused[base][1]) / folded:+.1f}",
                  f"{(fused[v][0] - fused[base][0]) / folded:+.1f}"]
        cells += [_coll_cell(c, v, layers) for c in coll.values()]
        cells += [f"{_syncs_per_mb(r):.1f}", f"{r['ms']:.1f}"]
        if peaks:
            cells += [f"{peaks[v] / 2**20:.0f}"] + [f"{peaks[v] / peaks[x]:.3f}" for x in refs]
        lines.append("| " + " | ".join(cells) + " |")
    if not all(r["fused_one_op"] for r in rows.values()):
        lines.append("- no fused kernel bodies found (compile.py kernel): +fused = +traffic")
    lines += _footnotes(coll, rows, layers) + _top_ops(rows, base, m, folded)
    return "\n".join(lines)


def _top_ops(rows, base: str, m: int, folded: int, n: int = 4) -> list:
    """Per variant, the aten ops whose traffic a micro-batch differs most from ``base``'s
    (eager), in bytes per folded parameter: where its +traffic comes from."""
    out = []
    for v, r in rows.items():
        if v == base:
            continue
        names = set(r["ops1"]) | set(r[f"ops{m}"]) | set(rows[base]["ops1"])
        diff = {op: split(r["ops1"].get(op, 0) - rows[base]["ops1"].get(op, 0),
                          r[f"ops{m}"].get(op, 0) - rows[base][f"ops{m}"].get(op, 0), m)[1]
                for op in names | set(rows[base][f"ops{m}"])}
        top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:n]
        out.append(f"- traffic of {v} vs {base}, top ops a micro-batch (B/fp): " + ", ".join(
            f"{op} {b / folded:+.1f}" for op, b in top))
    return out


def _footnotes(coll, rows, layers) -> list:
    """Per parallel layout: stock's collectives per layer and micro-batch, and by name what
    each variant adds (per micro-batch / per step, whole model); refused layouts."""
    out = []
    for pname, counts in coll.items():
        if isinstance(counts, str):
            out.append(f"- {pname}: not run ({counts})")
            continue
        refused = {v: c for v, c in counts.items() if isinstance(c, str)}
        out += [f"- {pname} {v}: not built ({why})" for v, why in refused.items()]
        ref, stock = _reference(counts)
        if stock:
            names = sorted(set(stock[1]) | set(stock[2]))
            per = {n: split(stock[1].get(n, 0), stock[2].get(n, 0), 2) for n in names}
            out.append(f"- {pname} {ref}, per layer a micro-batch / a step: " + ", ".join(
                f"{n} {mb / layers:.2g} / {st / layers:.2g}" for n, (st, mb) in per.items()))
        for v in rows:
            if v == ref or not stock or v in refused:
                continue
            names = sorted(set(counts[v][1]) | set(counts[v][2]) | set(stock[1]))
            diff = {n: split(counts[v][1].get(n, 0) - stock[1].get(n, 0),
                             counts[v][2].get(n, 0) - stock[2].get(n, 0), 2) for n in names}
            added = [f"{n} {mb:+g} / {st:+g}" for n, (st, mb) in diff.items() if mb or st]
            if added:
                out.append(f"- {pname} {v} adds (model, a micro-batch / a step): "
                           + ", ".join(added))
    syncs = {v: r["syncs1"] for v, r in rows.items() if r["syncs1"]}
    for v, calls in syncs.items():
        out.append(f"- host syncs of {v} (one step, 1 micro-batch): "
                   + ", ".join(f"{k} {n}" for k, n in sorted(calls.items())))
    return out


def build_parser():
    p = overhead.build_parser()
    p.description = __doc__.split("\n")[0]
    p.set_defaults(variants=VARIANTS, num_layers=2, seq_length=64, micro_batch_size=2,
                   vocab=1024, num_experts=4, repeats=3, warmup=2, threads=2)
    p.add_argument("--ledger-micro-batches", type=int, default=4,
                   help="the second micro-batch count (the first is 1) that per-step and "
                        "per-micro-batch parts are solved from")
    p.add_argument("--layouts", nargs="+", default=["local", "te"], choices=["local", "te"])
    p.add_argument("--kinds", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    p.add_argument("--no-collectives", action="store_true",
                   help="skip the two-rank collective counts (TP2, TP2+SP, EP2)")
    p.add_argument("--fp8", choices=["delayed", "tensorwise"], default=None,
                   help="te layout: TE's FP8 recipe (the fold then runs where TE quantizes the "
                        "weight, once a step; compare with the same run without it)")
    p.add_argument("--json", help="append each table's raw measurements to this file")
    p.add_argument("--timeout", type=float, default=900, help="seconds per forked run")
    return p


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.device = "cpu"
    from scalevec_testing import te_stub

    for layout in args.layouts:
        if layout == "te" and not te_stub.available():
            print("te layout skipped: no Transformer Engine Python (.te_python)")
            continue
        for kind in args.kinds:
            res = measure(args, layout, kind == "moe")
            if args.json:  # the raw counts, to compare runs (a fold rewrite) without rerunning
                with open(args.json, "a") as f:
                    f.write(json.dumps(dict(layout=layout, kind=kind, **res)) + "\n")
            print(report(args, layout, kind == "moe", res), flush=True)
            print()
