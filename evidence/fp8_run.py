"""The FP8 numerics study end to end: train checkpoints, hook real activations and gradients,
measure every placement (evidence/fp8.py), and a short fake-quantized training comparison.

Everything runs through the real trainer (``training.trainer.main``) in this process:
checkpoints are written by ``--save`` and read back by ``--load``; the model, its data and its
process group are used from inside ``Trainer.train``, replaced for the call (:func:`in_trainer`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from typing import Optional

import torch

from evidence import fp8
from evidence.runner import VECTORS_AT_BASE_LR, read_metrics

VARIANTS = ("shared", "hg", "hg+dp", "unified")


@contextlib.contextmanager
def _replaced(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def in_trainer(argv: list, fn):
    """Run ``fn(trainer)`` where ``Trainer.train`` would run (model built, checkpoint loaded,
    process group up); returns its result."""
    from megatron_scalevec.training import trainer as tr  # noqa: PLC0415

    box = {}

    def train(self):
        box["out"] = fn(self)
        return []

    with _replaced(tr.Trainer, "train", train):
        tr.main(list(argv) + ["--no-plot", "--quiet"])
    return box.get("out")


def train_checkpoint(variant: str, root: str, trainer_args: list, log=print) -> str:
    """``pretrain_gpt.py --scalevec VARIANT --save root/VARIANT ...`` unless already there."""
    from megatron_scalevec.training import trainer as tr  # noqa: PLC0415

    d = os.path.join(root, variant.replace("+", "_"))
    if os.path.exists(os.path.join(d, "latest")):
        log(f"[fp8] checkpoint {d} exists, reused")
        return d
    log(f"[fp8] training {variant} -> {d}")
    tr.main(["--scalevec", variant, *VECTORS_AT_BASE_LR, "--save", d, "--run-dir", d,
             "--no-plot", "--quiet", *trainer_args])
    return d


def checkpoint_argv(ckpt: str) -> tuple[str, list]:
    """(strategy, trainer flags that rebuild the model) from a trainer checkpoint's metadata."""
    from megatron.core import dist_checkpointing  # noqa: PLC0415

    from megatron_scalevec.training.checkpointing import iter_dir, read_latest  # noqa: PLC0415

    it = read_latest(ckpt)
    if it is None:
        raise FileNotFoundError(f"--load {ckpt}: no trainer checkpoint (no 'latest' file)")
    common = dist_checkpointing.load_common_state_dict(iter_dir(ckpt, it))
    meta = common.get("model_meta") or {}
    argv = ["--spec", meta.get("spec", "scalevec_moe")]
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "num_experts"):
        if meta.get(key):
            argv += [f"--{key.replace('_', '-')}", str(meta[key])]
    return common["scalevec"], argv


# --- hooking the fused projections ----------------------------------------------------------
def _fused_linears(model) -> dict:
    """name -> every fused branch projection (linear_qkv, linear_fc1, expert fc1)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "slots")
            and hasattr(m, "weight") and (n.endswith("linear_qkv") or n.endswith("linear_fc1"))}


def _pre_norm(modules: dict, name: str):
    layer = re.match(r"(.*decoder\.layers\.\d+)\.", name).group(1)
    return modules[layer + (".input_layernorm" if ".self_attention." in name
                            else ".pre_mlp_layernorm")]


def _label(name: str) -> tuple[int, str]:
    layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
    kind = "qkv" if name.endswith("linear_qkv") else "expert" if ".experts." in name else "fc1"
    return layer, kind


@torch.no_grad()
def fused_branches(lin, norm) -> tuple[fp8.FusedBranches, Optional[torch.Tensor]]:
    """(FusedBranches of ``lin``, the pre-norm's gamma when it lives in the norm)."""
    w = lin.weight.detach().float()
    s, inn = len(lin.slots), w.shape[1]
    norm_gamma = norm() if norm is not None and norm.enabled else None
    gout, gin = lin.fold_vectors()  # [S, r], [S, in], or None
    if gin is None:
        gin = (norm_gamma.float() if norm_gamma is not None else torch.ones(inn)).expand(s, inn)
    if gout is None:
        gout = torch.ones(s, lin.rows)
    fb = fp8.FusedBranches(w, list(lin.slots), lin.groups, lin.rows,
                           gin.float().clone(), gout.float().clone())
    return fb, norm_gamma


def capture(trainer, batches: int = 1) -> dict:
    """name -> (FusedBranches, N(x) [T, in], dY [T, out]) from real forward/backward passes
    of the loaded model on validation batches (N(x) and the output gradient are hooked)."""
    model = trainer.model[0]
    modules = dict(model.named_modules())
    lins = {n.replace("module.", "", 1): m for n, m in _fused_linears(model).items()}
    modules = {n.replace("module.", "", 1): m for n, m in modules.items()}
    xs: dict = {n: [] for n in lins}
    gs: dict = {n: [] for n in lins}
    handles = []

    def hook(name):
        def fwd(mod, inp, out):
            xs[name].append(inp[0].detach().float().reshape(-1, inp[0].shape[-1]))
            y = out[0] if isinstance(out, tuple) else out
            y.register_hook(lambda g: gs[name].append(g.detach().float().reshape(-1, g.shape[-1])))
        return fwd

    for n, m in lins.items():
        handles.append(m.register_forward_hook(hook(n)))
    it = trainer._iters(trainer.valid_ds, 0)
    try:
        for _ in range(batches):
            b = next(it)
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            mask = b["loss_mask"].float()
            ((out.float() * mask).sum() / mask.sum()).backward()
    finally:
        for h in handles:
            h.remove()
    found = {}
    for n, lin in lins.items():
        if not xs[n]:
            continue  # an expert that got no tokens
        fb, g = fused_branches(lin, _pre_norm(modules, n))
        x = torch.cat(xs[n])
        if g is not None:  # shared: the linear sees gamma * N(x)
            if bool((g.abs() < 1e-12).any()):
                raise ValueError(f"{n}: a pre-norm gamma entry is 0, N(x) cannot be recovered")
            x = x / g.float()
        found[n] = (fb, x, torch.cat(gs[n]))  # one call per batch: grads in batch order
    return found


def perturb(fb: fp8.FusedBranches, sigma: float, seed: int) -> fp8.FusedBranches:
    """Stress case: every distinct branch vector times exp(sigma * z), z ~ N(0, 1) per
    channel (one draw per branch, shared by its slots)."""
    if sigma == 0:
        return fb
    gen = torch.Generator().manual_seed(seed)
    factor = {b: torch.exp(sigma * torch.randn(fb.gin.shape[1], generator=gen))
              for b in fb.branches}
    if bool((fb.gin == fb.gin[0]).all()):  # one vector (shared): one draw for all branches
        factor = dict.fromkeys(fb.branches, factor[fb.branches[0]])
    gin = torch.stack([fb.gin[i] * factor[b] for i, b in enumerate(fb.slots)])
    return fp8.FusedBranches(fb.weight, fb.slots, fb.groups, fb.rows, gin, fb.gout)


def gamma_stats(found: dict) -> dict:
    """std, min, max over the entries of every distinct input vector."""
    vals = torch.cat([fb.branch_gamma().flatten() for fb, _, _ in found.values()])
    return dict(std=float(vals.std()), min=float(vals.min()), max=float(vals.max()))


def measure_model(found: dict, variant: str, recipes: list, sigmas=(0.0,), log=print) -> list:
    rows = []
    for sigma in sigmas:
        for i, (name, (fb, x, dy)) in enumerate(found.items()):
            if x.shape[0] == 0:
                continue  # an expert that got no tokens
            layer, kind = _label(name)
            for r in fp8.measure(perturb(fb, sigma, 1000 + i), x, dy, recipes):
                branch = ("e." + r["branch"]) if kind == "expert" else r["branch"]
                rows.append(dict(variant=variant, sigma=sigma, layer=layer, module=name,
                                 **{**r, "branch": branch}))
    log(f"[fp8] {variant}: {len(found)} projections measured")
    return rows


# --- FP8-emulated training -------------------------------------------------------------------
def install_fake_fp8(model, rec: fp8.Recipe, mean_kept: bool = False) -> int:
    """Route the GEMM of every decoder linear (not the output layer) through
    :func:`fp8.fake_quant_linear`. ``mean_kept``: a folded branch projection quantizes
    ``c * N(x)`` and ``W_eff / c`` (c = branch mean of gamma) instead of ``N(x)``, ``W_eff``.
    Returns how many linears were patched (instance attributes only; layer code unchanged)."""
    from megatron.core.tensor_parallel.layers import (  # noqa: PLC0415
        ColumnParallelLinear,
        RowParallelLinear,
    )

    from megatron_scalevec.layers.expert_vectors import vectors_of  # noqa: PLC0415

    count = 0
    for name, m in model.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)) or \
                name.endswith("output_layer"):
            continue
        if m.tp_group is not None and m.tp_group.size() > 1:
            raise NotImplementedError("the FP8 emulation runs at tensor-parallel size 1")
        common = None
        scale_in = getattr(vectors_of(m), "scale_in", ())
        if mean_kept and len(scale_in) > 0 and m.scalevec_mode == "weight":
            def common(scale_in=scale_in):
                gammas = torch.stack([vec() for vec in scale_in.values()])
                return fp8.split_common_gamma(gammas)[0]

        # A folded branch projection receives its stored W here and folds inside its own
        # _forward_impl (layers/linear.py), which this replaces: fold first.
        folds = getattr(m, "has_scale_vectors", False) and \
            getattr(m, "scalevec_mode", None) == "weight"

        def impl(input, weight, *args, bias=None, _m=m, _folds=folds, _common=common,
                 **kwargs):
            if _folds:
                weight = _m.effective_weight(weight)
            if _common is not None:
                c = _common()
                input, weight = input * c.to(input.dtype), weight / c.to(weight.dtype)
            y = fp8.fake_quant_linear(input, weight, rec)
            return y if bias is None else y + bias

        m._forward_impl = impl
        count += 1
    return count


def train_run(trainer_args: list, run_dir: str, rec: Optional[fp8.Recipe],
              mean_kept: bool = False) -> list:
    """Per-iteration training losses of one trainer run, FP8-emulated when ``rec`` is set."""
    from megatron_scalevec.training import trainer as tr  # noqa: PLC0415

    iters = int(trainer_args[trainer_args.index("--train-iters") + 1])
    done = [r["loss_last"] for r in read_metrics(run_dir) if "loss_last" in r]
    if len(done) == iters:  # finished before (one record per iteration): reuse
        return done
    if os.path.exists(run_dir):
        import shutil  # noqa: PLC0415

        shutil.rmtree(run_dir)
    build = tr.build_model

    def build_fp8(args, config, vocab_size):
        chunks = build(args, config, vocab_size)
        for c in chunks:
            install_fake_fp8(c, rec, mean_kept)
        return chunks

    with contextlib.ExitStack() as stack:
        if rec is not None:
            stack.enter_context(_replaced(tr, "build_model", build_fp8))
        return tr.main([*trainer_args, "--run-dir", run_dir, "--log-interval", "1", "--no-plot",
                        "--quiet", "--no-save"])


def loss_gap(fp8_losses: list, fp32_losses: list, window: int) -> tuple[float, float]:
    """(mean FP8 - fp32 loss over the first ``window`` iterations, over the last ones)."""
    d = [a - b for a, b in zip(fp8_losses, fp32_losses)]
    w = max(1, min(window, len(d) // 2))
    return sum(d[:w]) / w, sum(d[-w:]) / w


def finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)
