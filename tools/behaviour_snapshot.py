"""A snapshot of what a refactor must not change, to compare two revisions of the package.

For every strategy on tiny dense and MoE models (local, local grouped and TE experts, TP1 and
TP2 + SP, EP2): parameter names and shapes, state_dict keys, sharded checkpoint keys (global
shape, offset, replica id), the losses and every gradient of one forward-backward under
megatron-core's DDP with the micro-batch calculator (the fold's once-per-step map) and of
three SGD steps, the weights after them, the IWD rule of each parameter, the scale-invariant
magnitudes, the monitor's statistics, the MoE parameter count, and the converter (warm start
from stock, fold to stock). Run it with each revision on ``PYTHONPATH`` and compare::

    cd <old tree> && python <this file> save old.pt
    cd <new tree> && python <this file> save new.pt

(the tree to snapshot is the working directory, first on ``sys.path``; a third argument keeps
only the cases whose name contains it, e.g. ``save x.pt moe_ep2``)
    python tools/behaviour_snapshot.py compare old.pt new.pt

``compare`` prints every difference: keys that differ, and tensors whose maximum absolute
difference is not zero (with the largest).
"""

from __future__ import annotations

import contextlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DENSE = ["shared", "none", "hg", "hg+dp", "hg+dnp", "shared+or", "shared+er", "hg+or", "hg+er",
         "unified", "hg+dp+er", "hg+dp+or", "hg+dnp+er+iwd", "hg+dp+iwd"]
# (name, strategy, tiny_config overrides, ScaleVecConfig overrides, TP, SP)
CASES = [(f"dense:{s}", s, {}, {}, 1, False) for s in DENSE]
CASES += [(f"dense_tp2sp:{s}", s, {}, {}, 2, True) for s in DENSE]
CASES += [(f"qk:{s}", s, dict(qk_layernorm=True), {}, 1, False)
          for s in ("shared", "hg+dp+or", "unified", "none")]
CASES += [(f"qk_tp2sp:{s}", s, dict(qk_layernorm=True), {}, 2, True)
          for s in ("shared", "hg+er")]
CASES += [(f"ln:{s}", s, dict(normalization="LayerNorm"), {}, 1, False)
          for s in ("shared", "hg+or", "unified")]
CASES += [(f"ln_tp2sp:{s}", s, dict(normalization="LayerNorm"), {}, 2, True)
          for s in ("shared", "hg+dp")]
CASES += [(f"gate:{s}", s, dict(attention_output_gate=True), {}, 1, False)
          for s in ("hg+dp", "unified")]
_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[1, 0],
            moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")
for s in ("shared", "hg+dp+er", "unified", "hg+dnp+or+iwd"):
    CASES.append((f"moe:{s}", s, dict(_MOE), {}, 1, False))
    CASES.append((f"moe_grouped:{s}", s, dict(_MOE, moe_grouped_gemm=True), {}, 1, False))
    CASES.append((f"moe_sharedvec:{s}", s, dict(_MOE), dict(expert_vectors="shared"), 1, False))
    CASES.append((f"moe_sharedexp:{s}", s, dict(_MOE, moe_shared_expert_intermediate_size=16),
                  {}, 1, False))
for s in ("hg+dp+or", "unified"):
    CASES.append((f"moe_tp2sp:{s}", s, dict(_MOE), {}, 2, True))
    CASES.append((f"moe_grouped_tp2sp_sharedvec:{s}", s, dict(_MOE, moe_grouped_gemm=True),
                  dict(expert_vectors="shared"), 2, True))
    CASES.append((f"moe_ep2:{s}", s, dict(_MOE), {}, "ep2", False))
TE = [(f"te:{s}", s, dict(transformer_impl="transformer_engine"), {}, 1, False)
      for s in ("shared", "hg+or", "hg+dp", "unified")]
TE += [(f"te_moe:{s}", s, dict(_MOE, transformer_impl="transformer_engine"), {}, 1, False)
       for s in ("unified", "hg+dp")]
TE += [(f"te_grouped:{s}", s, dict(_MOE, transformer_impl="transformer_engine",
                                    moe_grouped_gemm=True), ev, 1, False)
       for s in ("unified", "hg+dp+er") for ev in ({}, dict(expert_vectors="shared"))]
TE += [("te_tp2sp:unified", "unified", dict(transformer_impl="transformer_engine"), {}, 2, True)]


def _sharded_keys(model) -> dict:
    out = {}
    for k, v in model.sharded_state_dict().items():
        if hasattr(v, "global_shape"):
            out[k] = (v.key, tuple(v.global_shape), tuple(v.global_offset), tuple(v.replica_id))
        else:
            out[k] = (getattr(v, "key", None),)
    return out


def _case(rank, world, strategy, config_kw, scalevec_kw, tp, sp):
    import torch

    from megatron_scalevec.config import ScaleVecConfig
    from scalevec_testing import init_model_parallel
    from scalevec_testing import models as M

    te = config_kw.get("transformer_impl") == "transformer_engine"
    if te:
        from scalevec_testing import te_stub

        te_stub.activate()
    ep = 2 if tp == "ep2" else 1
    init_model_parallel(tp=1 if tp == "ep2" else tp, ep=ep)
    cfg_kw = dict(config_kw, sequence_parallel=sp)
    if ep > 1:
        cfg_kw["expert_model_parallel_size"] = ep
    config = M.tiny_config(**cfg_kw)
    scalevec = ScaleVecConfig.from_string(strategy, **scalevec_kw)
    claimed = te_stub.cuda_claimed if te else contextlib.nullcontext
    with claimed():
        model = M.build_gpt(config, scalevec)
    out = {"params": {n: tuple(p.shape) for n, p in model.named_parameters()},
           "state_dict": sorted(model.state_dict()),
           "sharded": _sharded_keys(model)}
    M.perturb_vectors(model)
    with torch.no_grad():  # the same weights whatever the code: a seeded perturbation by name
        for name, p in model.named_parameters():
            if not hasattr(p, "scalevec_part"):
                g = torch.Generator().manual_seed(M._seed_of(name) + 1)
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    out["rules"] = _rules(model, scalevec)
    out["invariant"] = _invariant(model)
    out["stats"] = _stats(model)
    ddp = M.wrap_ddp(model, config)
    data = M.batches(4, 2)
    with claimed():
        out["loss1"] = M.train_steps(ddp, config, data, 1)
    out["grads"] = {n: (p.main_grad if getattr(p, "main_grad", None) is not None
                        else p.grad).detach().clone()
                    for n, p in model.named_parameters() if p.requires_grad}
    opt = M.make_optimizer(ddp, optimizer="sgd", lr=0.1)
    with claimed():
        out["losses"] = M.train_steps(ddp, config, data, 3, opt)
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _rules(model, scalevec) -> dict:
    from megatron_scalevec.optim import classify, decay_rules

    rules = decay_rules(scalevec, 0.1)
    return {n: classify(rules, p, n).name for n, p in model.named_parameters()
            if p.requires_grad}


def _invariant(model) -> list:
    from megatron_scalevec.invariance import invariant_magnitudes

    return invariant_magnitudes(model)


def _stats(model) -> dict:
    from megatron_scalevec.training.monitor import scale_vector_stats

    return scale_vector_stats([model])


def _convert(rank, world, strategy, moe):
    import torch

    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.convert.arch import ModelArch
    from megatron_scalevec.convert.build import build_model
    from megatron_scalevec.convert.fold import fold_to_stock
    from megatron_scalevec.convert.warmstart import warm_start

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
              ffn_hidden_size=64, vocab_size=64, max_sequence_length=32)
    if moe:
        kw.update(num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
                  moe_shared_expert_intermediate_size=16)
    arch = ModelArch(**kw)
    stock = build_model(arch.replace(scalevec="stock"))
    with torch.no_grad():
        for name, p in stock.named_parameters():
            g = torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name)))
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.3 * torch.rand(p.shape, generator=g))
    sd = {k: v.detach().clone() for k, v in stock.state_dict().items()
          if not k.endswith("_extra_state")}
    model, report = warm_start(sd, arch, strategy, allow_function_change=True)
    out = {"report": report,
           "warm": {k: v.detach().clone() for k, v in model.state_dict().items()
                    if not k.endswith("_extra_state")}}
    if not ScaleVecConfig.from_string(strategy).dnp:  # DNP has no stock equivalent
        folded, stock_arch = fold_to_stock(model, arch.replace(scalevec=strategy))
        out["fold"] = folded
    return out


def _moe_count() -> dict:
    from megatron_scalevec.config import ScaleVecConfig
    from megatron_scalevec.layers.moe import moe_new_parameters

    out = {}
    for s in DENSE:
        for ev in ("per_expert", "shared"):
            cfg = ScaleVecConfig.from_string(s, expert_vectors=ev)
            out[(s, ev)] = moe_new_parameters(
                cfg, num_layers=4, hidden=64, heads=4, query_groups=2, head_dim=16, ffn=128,
                num_experts=8, moe_ffn=32, shared_ffn=48, moe_layers=[1, 0, 1, 1])
    return out


def save(path: str, only: str = "") -> None:
    import torch

    import megatron_scalevec
    from scalevec_testing import run_on_ranks

    print(f"snapshot of {os.path.dirname(os.path.dirname(megatron_scalevec.__file__))}",
          flush=True)
    snap = {"moe_count": _moe_count()}
    for name, strategy, config_kw, scalevec_kw, tp, sp in CASES + TE:
        if only not in name:
            continue
        world = 1 if tp == 1 else 2
        try:
            snap[name] = run_on_ranks(_case, world, strategy, config_kw, scalevec_kw, tp, sp,
                                      timeout=300)
        except Exception as e:  # noqa: BLE001 -- a case that fails is part of the snapshot
            snap[name] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}"
        print(name, "ok" if not isinstance(snap[name], str) else snap[name], flush=True)
    for s in ("shared", "hg", "hg+dp+or", "hg+er", "unified", "none", "shared+or"):
        for moe in (False, True):
            key = f"convert:{s}:{'moe' if moe else 'dense'}"
            if only not in key:
                continue
            try:
                snap[key] = run_on_ranks(_convert, 1, s, moe, timeout=300)[0]
            except Exception as e:  # noqa: BLE001
                snap[key] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[-1:]}"
            print(key, "ok" if not isinstance(snap[key], str) else snap[key], flush=True)
    torch.save(snap, path)


def _diff(a, b, where: str, out: list) -> None:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            out.append((where, f"shape {tuple(a.shape)} vs {tuple(b.shape)}", float("inf")))
        else:
            d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            if d:
                out.append((where, f"max|diff| {d:.3e} (scale {float(a.abs().max()):.3e})", d))
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append((where, f"keys differ: {sorted(map(str, set(a) ^ set(b)))[:6]}",
                        float("inf")))
        for k in a:
            if k in b:
                _diff(a[k], b[k], f"{where}/{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) \
            and any(isinstance(x, (dict, torch.Tensor, list, tuple)) for x in a):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float):
        if a != b:
            out.append((where, f"{a!r} vs {b!r}", abs(a - b)))
    elif a != b:
        out.append((where, f"{str(a)[:200]} vs {str(b)[:200]}", float("inf")))


def compare(old: str, new: str) -> int:
    import torch

    a, b = torch.load(old, weights_only=False), torch.load(new, weights_only=False)
    out: list = []
    _diff(a, b, "", out)
    for where, what, _ in sorted(out, key=lambda t: -t[2]):
        print(f"{where}: {what}")
    cases = [k for k in a if not isinstance(a[k], str)]
    print(f"{len(a)} entries ({len(cases)} ran), {len(out)} differences"
          + (f", largest {max(d for *_, d in out):.3e}" if out else ""))
    return 0 if not out else 1


def main(argv) -> int:
    if len(argv) in (2, 3) and argv[0] == "save":
        sys.path.insert(0, os.getcwd())
        from megatron_scalevec.compat.cpu import enable_cpu_compat  # noqa: PLC0415

        os.environ.setdefault("MEGATRON_SCALEVEC_FUSED_COMPILE", "off")
        os.environ.setdefault("MEGATRON_SCALEVEC_STANDINS", "1")
        from scalevec_testing.te_stub import hide_unusable_te  # noqa: PLC0415

        hide_unusable_te()
        enable_cpu_compat()
        save(*argv[1:])
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(argv[1], argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
