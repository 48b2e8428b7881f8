#!/usr/bin/env python
"""Grouped-GEMM experts vs sequential experts on one device (CPU or CUDA): same weights,
then the loss, the logits and every gradient compared relative to each tensor's scale.

Usage: python tools/grouped_check.py [--device cuda] [--bf16] [--experts 16]
Prints one line per strategy and exits non-zero when a difference exceeds the tolerance
(fp32: 1e-4 relative; bf16: 5e-2, two GEMM orders rounding differently).
"""

import argparse
import os
import sys

import torch


def compare(strategy: str, config_kw: dict, device: str, dtype) -> dict:
    from megatron_scalevec.config import ScaleVecConfig
    from scalevec_testing import models as M

    cfg = ScaleVecConfig.from_string(strategy)
    batch = {k: v.to(device) for k, v in M.batches(1, 2)[0].items()}
    results = []
    for grouped in (False, True):
        config = M.tiny_config(moe_grouped_gemm=grouped, params_dtype=dtype, **config_kw)
        model = M.build_gpt(config, cfg).to(device=device, dtype=dtype)
        kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")}
        want = "ScaleVecGroupedMLP" if grouped else "ScaleVecSequentialMLP"
        if kinds != {want}:
            raise SystemExit(f"expected {want} experts, built {kinds}")
        M.perturb_vectors(model)
        logits = model(batch["tokens"], batch["position_ids"], None)
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))
        loss.backward()
        results.append((logits.detach().float(), float(loss),
                        {n: p.grad.float() for n, p in model.named_parameters()
                         if p.grad is not None}))
    (y0, l0, g0), (y1, l1, g1) = results

    def rel(a, b, scale=0.0):
        return float((a - b).abs().max()) / max(float(a.abs().max()), scale, 1e-30)

    def grad_rel(n):  # OR magnitude / ER alpha: judged at the scale of their vector's gradient
        sib = n.replace(".magnitude", ".direction").replace(".alpha", ".logit")
        return rel(g0[n], g1[n], float(g0[sib].abs().max()) if sib in g0 else 0.0)

    if set(g0) != set(g1):
        raise SystemExit(f"{strategy}: gradient sets differ: {sorted(set(g0) ^ set(g1))[:5]}")
    grads = {n: grad_rel(n) for n in g0}
    worst = max(grads, key=grads.get)
    return dict(logits=rel(y0, y1), loss=abs(l0 - l1) / abs(l0), grad=grads[worst], worst=worst)


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
    tol = 5e-2 if args.bf16 else 1e-4
    config_kw = dict(num_moe_experts=args.experts, moe_router_topk=2, moe_ffn_hidden_size=32,
                     moe_aux_loss_coeff=1e-2, moe_token_dispatcher_type="alltoall",
                     use_cpu_initialization=True, bf16=args.bf16)
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
