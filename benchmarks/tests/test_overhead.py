"""The benchmark's own machinery (benchmarks/): its optimizer and gradient-norm stand-ins
take the same steps as megatron-core's CPU fallbacks, and its pairing, rotation and null-row
methods do what their docs say. Tests of the benchmark, not of the strategy."""

import contextlib

import pytest
import torch

from scalevec_testing import models as M
from scalevec_testing.distributed import init_model_parallel, run_on_ranks


def _adam_steps(config, grads, fused):
    """Two AdamW steps (weight decay on, so Adam's L2 and AdamW's decoupled decay differ) of
    megatron-core's optimizer on a fresh unified model, with the same given gradients in every
    form (recomputed ones would differ by rounding, which Adam amplifies where |g| ~ eps):
    per-parameter loop (fused None), foreach (False) or fused (True)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from benchmarks.overhead import multi_tensor_adam

    ddp = M.wrap_ddp(M.build_gpt(config, "unified"), config)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0), [ddp])
    switched = 0 if fused is None else multi_tensor_adam(opt, fused=fused)
    groups = [g for o in getattr(opt, "chained_optimizers", [opt])
              for g in o.optimizer.param_groups]
    for step in range(2):
        for p, g in zip(ddp.parameters(), grads):  # step 2: other values, same scale
            p.main_grad.copy_(g if step == 0 else g.flatten().roll(1).view_as(g))
        opt.step()
    flags = [(bool(g.get("foreach")), bool(g.get("fused"))) for g in groups]
    return switched, flags, {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _adam_forms(rank, world):
    """Two Adam steps of unified: loop, multi-tensor foreach and fused (multi_tensor_adam).
    Returns each form's largest difference to the loop, relative to each tensor's scale."""
    init_model_parallel()
    config = M.tiny_config()
    ddp = M.wrap_ddp(M.build_gpt(config, "unified"), config)
    M.train_steps(ddp, config, M.batches(2, 2), 1)  # gradients only
    grads = [p.main_grad.clone() for p in ddp.parameters()]
    runs = {form: _adam_steps(config, grads, form) for form in (None, False, True)}
    (_, loop_flags, loop) = runs[None]
    assert not any(f or u for f, u in loop_flags)
    out = {}
    for fused, want in ((False, (True, False)), (True, (False, True))):
        switched, flags, multi = runs[fused]
        assert switched >= 1 and all(f == want for f in flags), (fused, flags)
        out[fused] = max(float((multi[n] - loop[n]).abs().max() /
                               loop[n].abs().max().clamp_min(1e-12)) for n in loop)
    return out


def test_benchmark_multi_tensor_adam_is_the_same_update():
    """The benchmark's fused AdamW (and its foreach fallback) takes the same two steps, weight
    decay included, as megatron-core's CPU fallback loop (it only removes the per-parameter
    Python overhead)."""
    diffs = run_on_ranks(_adam_forms, 1)[0]
    assert diffs[True] < 1e-6 and diffs[False] < 1e-6, diffs


CLIP = 1e-3  # far below the tiny model's gradient norm: every step clips


def _clip_forms(rank, world):
    """Two SGD steps of unified clipped at CLIP, under megatron-core's local gradient-norm and
    scale fallbacks and under the benchmark's stand-ins (multi_tensor_kernels): for each,
    (bindings replaced, grad norms, clipped gradients of the last step, parameters)."""

    from benchmarks.overhead import multi_tensor_kernels

    init_model_parallel()
    config = M.tiny_config()
    out = []
    for stand_ins in (False, True):
        ddp = M.wrap_ddp(M.build_gpt(config, "unified"), config)
        opt = M.make_optimizer(ddp, lr=1.0, optimizer="sgd", clip_grad=CLIP)
        norms = []
        with multi_tensor_kernels() if stand_ins else contextlib.nullcontext(0) as replaced:
            M.train_steps(ddp, config, M.batches(2, 2), 2, opt, grad_norms=norms)
        named = list(ddp.module.named_parameters())
        out.append((replaced, norms, {n: p.grad.detach().clone() for n, p in named},
                    {n: p.detach().clone() for n, p in named}))
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm  # restored on exit
    return out


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_benchmark_multi_tensor_kernels_same_norm_and_clipping():
    """The benchmark's multi-tensor stand-ins for megatron-core's CPU fallbacks give the same
    gradient norm (relative 1e-6), the same clipped gradients and the same SGD steps."""
    (_, ref_norms, ref_grads, ref_params), (replaced, norms, grads, params) = \
        run_on_ranks(_clip_forms, 1)[0]
    assert replaced >= 2  # clip_grads' l2 norm and scale
    assert min(ref_norms) > 10 * CLIP  # clipping bites in both steps
    for got, want in zip(norms, ref_norms):
        assert abs(got - want) <= 1e-6 * want, (got, want)
    bad = [f"{n}: grad {_rel(grads[n], ref_grads[n]):.2e}, param {_rel(params[n], p):.2e}"
           for n, p in ref_params.items()
           if _rel(grads[n], ref_grads[n]) > 1e-5 or _rel(params[n], p) > 1e-6]
    assert not bad, "\n".join(bad)


def test_benchmark_stand_ins_match_megatron_local_fallbacks():
    """Called as megatron-core calls them (through its applier): the L2 norm over tensors of
    mixed shapes, and the scale both in place and into other tensors of another dtype
    (the fp16 main-param copy) equal megatron-core's local fallbacks."""
    from megatron.core.utils import (
        local_multi_tensor_applier,
        local_multi_tensor_l2_norm,
        local_multi_tensor_scale,
    )

    from benchmarks.multi_tensor import _foreach_l2_norm, _foreach_scale

    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(shape, generator=gen) for shape in ((7,), (3, 5), (2, 3, 4), (1,))]
    flag = torch.zeros(1, dtype=torch.int)
    want, _ = local_multi_tensor_applier(local_multi_tensor_l2_norm, flag, [ts], False)
    got, per = local_multi_tensor_applier(_foreach_l2_norm, flag, [ts], True)
    assert got.shape == want.shape == (1,) and got.dtype == torch.float32
    assert got.device == ts[0].device
    assert abs(float(got) - float(want)) <= 1e-6 * float(want)
    assert torch.allclose(per, torch.stack([t.norm() for t in ts]), rtol=1e-6)
    for dtype in (torch.float32, torch.bfloat16):
        outs = [[torch.empty_like(t, dtype=dtype) for t in ts] for _ in range(2)]
        local_multi_tensor_applier(local_multi_tensor_scale, flag, [ts, outs[0]], 0.3)
        local_multi_tensor_applier(_foreach_scale, flag, [ts, outs[1]], 0.3)
        assert all(torch.equal(a, b) for a, b in zip(*outs)), dtype
    inplace = [[t.clone() for t in ts] for _ in range(2)]
    local_multi_tensor_applier(local_multi_tensor_scale, flag, [inplace[0], inplace[0]], 0.3)
    local_multi_tensor_applier(_foreach_scale, flag, [inplace[1], inplace[1]], 0.3)
    assert all(torch.equal(a, b) for a, b in zip(*inplace))


def _bench_order(rank, world):
    init_model_parallel()
    from benchmarks import overhead as bench
    from scalevec_testing import models as M

    args = bench.build_parser().parse_args(
        ["--variants", "stock", "shared@eager", "unified@eager", "--num-layers", "1",
         "--hidden-size", "32",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "64",
         "--seq-length", "16", "--vocab", "64", "--micro-batch-size", "1", "--warmup", "0",
         "--repeats", "3", "--instances", "2"])
    built, order = [], []
    real_build, real_wrap, real_train = M.build_gpt, M.wrap_ddp, M.train_steps
    M.build_gpt = lambda cfg, s, *a, **k: built.append(s and s.hg) or real_build(cfg, s, *a, **k)
    ddps = []
    M.wrap_ddp = lambda *a, **k: ddps.append(real_wrap(*a, **k)) or ddps[-1]
    M.train_steps = lambda ddp, *a, **k: order.append(ddp) or real_train(ddp, *a, **k)
    try:
        rows = bench.run(args)
    finally:
        M.build_gpt, M.wrap_ddp, M.train_steps = real_build, real_wrap, real_train
    ids = [ddps.index(d) for d in order]
    faults = [len(r["faults"]) for r in rows]
    head = bench.report(rows, "shared@eager").splitlines()[1]
    return built, ids, [(r["name"], [len(t) for t in r["runs"]], len(r["times"])) for r in rows], \
        faults, head


def test_benchmark_rounds_rotate_over_mirrored_instances():
    """Every variant is built twice, the second set in reverse order (a model's speed depends
    on where it was built); each round starts one model later, so no model always follows the
    same one; each variant's row pools its two instances."""
    built, ids, rows, faults, head = run_on_ranks(_bench_order, 1)[0]
    assert built == [None, False, True, True, False, None], built  # stock, shared, unified
    assert ids == [0, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 0, 2, 3, 4, 5, 0, 1], ids
    assert rows == [("stock", [3, 3], 6), ("shared@eager", [3, 3], 6),
                    ("unified@eager", [3, 3], 6)], rows
    assert faults == [6, 6, 6] and "| faults |" in head, (faults, head)  # one count a step


def test_paired_ratio_pairs_each_instance_with_its_own_base():
    from benchmarks.overhead import paired_ratio  # noqa: PLC0415

    # instance 1 is 3x slower for both; per-round ratios 1.1 1.2 1.0 | 1.1 1.0 1.3 (median of
    # the medians' ratio: 1.05; instance 0 against the base's instance 1: 1.7)
    med, spread = paired_ratio([[1.1, 1.2, 1.0], [3.3, 3.0, 3.9]], [[1.0] * 3, [3.0] * 3])
    assert med == pytest.approx(1.1) and spread == pytest.approx(0.05)


def _tiny_args(*extra):
    """The benchmark's arguments for shared and unified (eager) on a one-layer model."""
    from benchmarks import overhead as bench

    return bench.build_parser().parse_args(
        ["--variants", "shared@eager", "unified@eager", "--baseline", "shared@eager",
         "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab", "64", "--micro-batch-size", "1", "--warmup", "0", "--instances", "1",
         *extra])


def _bench_null(rank, world):
    init_model_parallel()
    from benchmarks import overhead as bench

    rows = bench.run(_tiny_args("--null", "--repeats", "2"))
    base, null = ([p.detach() for p in r["model"].parameters()] for r in (rows[0], rows[-1]))
    same = len(base) == len(null) and all(a.equal(b) for a, b in zip(base, null))
    return [r["name"] for r in rows], same, bench.report(rows, "shared@eager").splitlines()[1]


def test_benchmark_null_row_is_the_baseline_again():
    """--null builds the baseline a second time (its own row, the same model: the same
    parameters after the same steps) and prints its ratio to the baseline: the noise floor."""
    names, same, line = run_on_ranks(_bench_null, 1)[0]
    assert names == ["shared@eager", "unified@eager", "shared@eager#null"], names
    assert same  # the last row (the null one) trained exactly as the baseline
    assert line.startswith("noise floor: shared@eager#null (the baseline built again)"), line
    from benchmarks.overhead import null_builds  # noqa: PLC0415

    with pytest.raises(ValueError, match="--null: the baseline 'stock' is not among"):
        null_builds([("shared", None)], "stock")


def test_host_args_shrink_only_the_width():
    """--host reruns the same variants, instances and model shape at the smallest width."""
    from benchmarks import overhead as bench  # noqa: PLC0415

    args = bench.build_parser().parse_args(
        ["--variants", "shared", "unified", "--baseline", "shared", "--num-experts", "4",
         "--instances", "3", "--micro-batches", "4"])
    small = bench.host_args(args)
    assert (small.hidden_size, small.ffn_hidden_size, small.seq_length,
            small.micro_batch_size, small.vocab) == (32, 64, 16, 1, 256)
    assert (small.variants, small.instances, small.num_experts, small.micro_batches,
            small.num_layers) == (["shared", "unified"], 3, 4, 4, 4)
    assert args.hidden_size == 256  # the full-width arguments are left as they were


def test_host_report_prints_paired_excess_and_share():
    """The host table: each variant's paired excess over the baseline at the smallest width,
    its excess at full width, and the ratio of the two."""
    from types import SimpleNamespace

    from benchmarks.overhead import host_report  # noqa: PLC0415

    cfg = SimpleNamespace(hidden_size=32, ffn_hidden_size=64)

    def row(name, runs):
        return dict(name=name, runs=runs, times=[t for r in runs for t in r], config=cfg)

    full = [row("shared", [[1.0, 2.0, 1.0]]), row("unified", [[1.1, 2.1, 1.1]])]
    host = [row("shared", [[0.010, 0.020, 0.010]]), row("unified", [[0.014, 0.024, 0.014]])]
    lines = host_report(full, host, "shared").splitlines()
    assert lines[0].startswith("host work: every variant at hidden 32, 64 FFN"), lines[0]
    assert lines[3] == "| shared | 10.0 | 0.0 | 0.0 | n/a |", lines[3]
    assert lines[4] == "| unified | 14.0 | 4.0 | 100.0 | 0.04 |", lines[4]


def _device_columns(rank, world):
    init_model_parallel()
    from benchmarks import host_syncs
    from benchmarks import overhead as bench
    from benchmarks.ledger import kept_bytes

    args = bench.build_parser().parse_args(
        ["--variants", "shared@eager", "unified@eager", "--baseline", "shared@eager",
         "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "16",
         "--vocab", "64", "--micro-batch-size", "1", "--micro-batches", "3", "--warmup", "0",
         "--repeats", "1", "--instances", "1"])
    rows, data = bench.run(args), bench.batches(args)
    calls = []

    def syncs(fn):  # CUDA's sync debug mode stands in: 5 a step and 2 a micro-batch
        fn()
        calls.append(1)
        return 5 + 2 * (len(calls) % 2 == 0 and len(data) or 1)

    real, host_syncs.cuda_syncs = host_syncs.cuda_syncs, syncs
    try:
        for r in rows:
            bench._device_ledger(r, data)
    finally:
        host_syncs.cuda_syncs = real
    b = data[0]
    direct = []
    for r in rows:
        r["ddp"].zero_grad_buffer()
        direct.append(kept_bytes(lambda r=r: r["ddp"](b["tokens"], b["position_ids"], None,
                                                      labels=b["labels"])))
    table = bench.report(rows, "shared@eager").splitlines()
    return [r["kept"] for r in rows], direct, [r["syncs_mb"] for r in rows], table


def test_device_columns_kept_bytes_and_syncs_per_micro_batch():
    """On CUDA the overhead table also prints two GPU-ledger columns: what one micro-batch
    keeps for its backward and synchronizing calls a micro-batch (from steps of 1 and of 3
    micro-batches); here with CPU stand-ins for CUDA's sync debug mode."""
    kept, direct, per_mb, table = run_on_ranks(_device_columns, 1)[0]
    assert kept == direct and all(k > 0 for k in kept), (kept, direct)
    assert per_mb == [2.0, 2.0], per_mb
    assert "| kept MiB | kept/shared@eager | syncs/mb |" in table[1], table[1]


def _bench_bf16(rank, world):
    init_model_parallel()
    from benchmarks import overhead as bench

    rows = bench.run(_tiny_args("--bf16", "--repeats", "1"))
    out = {}
    for r in rows:
        opt = getattr(r["opt"], "chained_optimizers", [r["opt"]])[0]
        masters = [p for g in opt.optimizer.param_groups for p in g["params"]]
        params = list(r["model"].parameters())
        out[r["name"]] = ({p.dtype for p in params}, {p.dtype for p in masters}, len(r["times"]))
    return out


def test_benchmark_bf16_trains_bf16_weights_with_fp32_master_weights():
    """--bf16 (what tools/gpu_check.sh runs on a GPU): bf16 weights in megatron-core's
    mixed-precision optimizer with fp32 master weights, as Megatron-LM's --bf16; a step runs."""
    out = run_on_ranks(_bench_bf16, 1)[0]
    for name, (params, masters, steps) in out.items():
        assert params == {torch.bfloat16} and masters == {torch.float32} and steps == 1, \
            (name, params, masters, steps)
