"""Comparing the Transformer Engine path with the local spec, inside a forked gloo rank; shared by
test_te_spec.py, test_te_refusals.py, test_te_grouped.py and test_host_syncs.py in tests/layers/
(a test file never imports another, tests/test_import_cycles.py checks it, so what several need
lives here).

:func:`start_te` readies a rank for TE's Python (te_stub) and model parallelism;
:func:`te_model` builds the tiny GPT with TE's layers (:func:`te_moe`: its MoE settings);
:func:`compare_with_local` runs one forward-backward of a local model and of a TE model holding
the same weights and reports the loss difference and each gradient's relative difference, by the
local model's parameter names (:func:`te_name_to_local`).
"""

import contextlib
import re

from scalevec_testing import init_model_parallel, te_stub
from scalevec_testing import models as M


def start_te(tp=1, **kw):
    """Activate the TE stand-in (te_stub) and initialize model parallelism in this rank."""
    te_stub.activate()
    init_model_parallel(tp=tp, **kw)


def te_moe(experts, grouped=False, **kw) -> dict:
    """The tiny config's overrides for ``experts`` routed experts (top-2, on the first of two
    layers, no aux loss; ``grouped``: TE grouped experts) with ``kw``; none when ``experts`` is
    0."""
    if not experts:
        return kw
    return dict(num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=24,
                moe_layer_freq=[1, 0], moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped, **kw)


def te_model(strategy, **kw):
    """The tiny GPT (M.tiny_config with ``kw``) on TE's layers with ``strategy``, built as on a
    CUDA device (te_stub.cuda_claimed)."""
    with te_stub.cuda_claimed():
        return M.build_gpt(M.tiny_config(transformer_impl="transformer_engine", **kw), strategy)


def te_name_to_local(name: str) -> str:
    """A TE model's parameter name -> the local (sequential experts) model's."""
    for te_part, local_part in M.TE_FUSED_NORMS.items():
        name = name.replace(te_part, local_part)
    name = re.sub(r"experts\.expert_norms\.(\d+)\.", r"experts.local_experts.\1.", name)
    name = re.sub(r"experts\.linear_fc(\d)\.(weight|bias)(\d+)$",
                  r"experts.local_experts.\3.linear_fc\1.\2", name)
    return re.sub(r"experts\.linear_fc1\.scale_vectors\.(\d+)\.",
                  r"experts.local_experts.\1.linear_fc1.", name)


def compare_with_local(local, model, batch) -> dict:
    """One forward-backward of the ``local`` model and of the TE ``model`` (TE's own autograd,
    te_ops' kernels) on ``batch``: the loss difference, the gradients only one has, and each
    gradient's relative difference (M.relative_differences), by the local names."""
    out = []
    for m in (local, model):
        with te_stub.cuda_claimed() if m is model else contextlib.nullcontext():
            loss = m(batch["tokens"], batch["position_ids"], None,
                     labels=batch["labels"]).float().mean()
            loss.backward()
        out.append((float(loss), {n: p.grad for n, p in m.named_parameters()
                                  if p.grad is not None}))
    (l0, g0), (l1, g1) = out
    g1 = {te_name_to_local(n): g for n, g in g1.items()}
    return dict(dloss=abs(l0 - l1), loss=l0, only_one=sorted(set(g0) ^ set(g1)),
                rel=M.relative_differences({n: g for n, g in g0.items() if n in g1}, g1),
                names=sorted(g1))
