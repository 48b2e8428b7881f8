#!/usr/bin/env python
"""Grouped-GEMM experts vs sequential experts on one device (CPU or CUDA): same weights,
then the loss, the logits and every gradient compared relative to each tensor's scale.

Usage: python tools/grouped_check.py [--device cuda] [--bf16] [--experts 16]
Prints one line per strategy and exits non-zero when a difference exceeds the tolerance
(fp32: 1e-4 relative; bf16: the grouped run's error against fp32 at most twice the sequential
run's, floored at 1e-2: ``compare``; a broken grouped path is off by far more).
"""

import argparse
import os
import sys

import torch


def _run(cfg, config_kw: dict, grouped: bool, device: str, dtype, state=None) -> tuple:
    """(logits, loss, gradients, state) of one model: its vectors perturbed, or ``state``."""
    from scalevec_testing import models as M

    batch = {k: v.to(device) for k, v in M.batches(1, 2)[0].items()}
    config = M.tiny_config(moe_grouped_gemm=grouped, params_dtype=dtype,
                           bf16=dtype == torch.bfloat16, **config_kw)
    model = M.build_gpt(config, cfg).to(device=device, dtype=dtype)
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")}
    want = "ScaleVecGroupedMLP" if grouped else "ScaleVecSequentialMLP"
    if kinds != {want}:
        raise SystemExit(f"expected {want} experts, built {kinds}")
    if state is None:
        M.perturb_vectors(model)
    else:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    logits = model(batch["tokens"], batch["position_ids"], None)
    loss = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
    loss.backward()
    return (logits.detach().float(), float(loss),
            {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None},
            {k: v.detach().float().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor)})


def compare(strategy: str, config_kw: dict, device: str, dtype) -> dict:
    """Grouped against sequential experts: relative differences of the logits, the loss and the
    worst gradient (each at its tensor's scale). In bf16 each is the grouped run's error against
    an fp32 sequential run from the same (bf16) weights, over the sequential bf16 run's own
    error (``ratio``): two GEMM orders round differently, and a scalar gradient summed over many
    terms (an OR magnitude) carries bf16's rounding however it is computed. The gradients: the
    grouped run's worst tensor over the sequential run's worst (per tensor the two runs' errors
    scatter around bf16's rounding, so a per-tensor ratio is noise)."""
    from megatron_scalevec.config import ScaleVecConfig
    from scalevec_testing import models as M

    cfg = ScaleVecConfig.from_string(strategy)
    (y0, l0, g0, state), (y1, l1, g1, _) = [_run(cfg, config_kw, grouped, device, dtype)
                                           for grouped in (False, True)]
    ref = None
    if dtype == torch.bfloat16:
        ref = _run(cfg, config_kw, False, device, torch.float32, state)[:3]

    def rel(a, b, scale=0.0):
        return float((a - b).abs().max()) / max(float(a.abs().max()), scale, 1e-30)

    siblings = M.magnitude_siblings()

    def grad_rel(n, a, b):  # OR magnitude / ER alpha: at the scale of their vector's gradient
        sib = next((n[:-len(m)] + v for m, v in siblings.items() if n.endswith(m)), n)
        return rel(a[n], b[n], float(a[sib].abs().max()) if sib in a else 0.0)

    if set(g0) != set(g1):
        raise SystemExit(f"{strategy}: gradient sets differ: {sorted(set(g0) ^ set(g1))[:5]}")
    if ref is None:
        grads = {n: grad_rel(n, g0, g1) for n in g0}
        worst = max(grads, key=grads.get)
        return dict(logits=rel(y0, y1), loss=abs(l0 - l1) / abs(l0), grad=grads[worst],
                    worst=worst)
    yr, lr, gr = ref
    floor = 1e-2  # bf16's own rounding: below it a ratio says nothing

    def ratio(err_grouped, err_sequential):
        return err_grouped / max(err_sequential, floor)

    grouped = {n: grad_rel(n, gr, g1) for n in g0}
    worst = max(grouped, key=grouped.get)
    return dict(logits=ratio(rel(yr, y1), rel(yr, y0)),
                loss=ratio(abs(lr - l1) / abs(lr), abs(lr - l0) / abs(lr)),
                grad=ratio(grouped[worst], max(grad_rel(n, gr, g0) for n in g0)), worst=worst)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--strategies", nargs="+", default=["shared", "hg+dp+er", "unified"])
    args = p.parse_args(argv)
    if args.device == "cpu":
        from megatron_scalevec.compat.cpu import enable_cpu_compat

        enable_cpu_compat()
    import torch.distributed as dist

    from scalevec_testing import init_model_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29623")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    init_model_parallel()
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    tol = 2.0 if args.bf16 else 1e-4
    config_kw = dict(num_moe_experts=args.experts, moe_router_topk=2, moe_ffn_hidden_size=32,
                     moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall",
                     use_cpu_initialization=True)
    failed = False
    for strategy in args.strategies:
        r = compare(strategy, config_kw, args.device, dtype)
        ok = max(r["logits"], r["loss"], r["grad"]) < tol
        failed |= not ok
        print(f"grouped vs sequential [{args.device} {dtype} E={args.experts}] {strategy}: "
              f"logits {r['logits']:.1e} loss {r['loss']:.1e} grad {r['grad']:.1e} "
              f"({r['worst']}) {'OK' if ok else 'FAIL'} (tol {tol:g})")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
