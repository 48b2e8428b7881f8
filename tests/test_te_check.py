"""tools/te_check.py (gpu_check.sh part 5) on CPU: its FP8 measurement runs only where CUDA and
Transformer Engine are, so what can go wrong without a GPU is checked here. The training loop
re-arms TE's per-step FP8 weight cache (``set_is_first_microbatch``) once per step before the
first forward and accumulates gradients over the micro-batches; the FP8 recipes are megatron-core's
names; the report compares each loss with the same variant's bf16 loss; no CUDA: one line.
"""

import copy
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import torch

from scalevec_testing import run_on_ranks
from scalevec_testing.markers import needs_te

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("te_check", os.path.join(ROOT, "tools",
                                                                        "te_check.py"))
te_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(te_check)


class _Recorder(torch.nn.Module):
    """GPTModel's call shape (tokens, positions, mask, labels= -> per-token loss), recording the
    order of ``set_is_first_microbatch`` and forwards."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1, dtype=torch.float64)
        self.events = []

    def set_is_first_microbatch(self):
        self.events.append("first")

    def forward(self, inputs, positions, attention_mask, labels=None):
        self.events.append("forward")
        return (self.lin(inputs).squeeze(-1) - labels) ** 2


def _micro_batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(2, 4, generator=g, dtype=torch.float64), None,
             torch.randn(2, generator=g, dtype=torch.float64)) for _ in range(n)]


def test_first_microbatch_flag_once_per_step_before_its_first_forward():
    model = _Recorder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    syncs = []
    times, _ = te_check.train(model, opt, _micro_batches(4), steps=3, warmup=1,
                              sync=lambda: syncs.append(1))
    assert model.events == (["first"] + ["forward"] * 4) * 4, model.events
    assert len(times) == 3 and len(syncs) == 2 * 4


def test_gradients_accumulate_over_micro_batches():
    """N backwards of loss / N, one optimizer step: the same update as one backward of the mean
    loss (SGD, two steps), and the reported loss is that mean. fp32 like the tool's loss: equal
    up to rounding; a missing accumulation or average is off by far more."""
    torch.manual_seed(0)
    model, mbs = _Recorder(), _micro_batches(3)
    ref = copy.deepcopy(model)
    _, loss = te_check.train(model, torch.optim.SGD(model.parameters(), lr=0.1), mbs, steps=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref_loss = sum(ref(x, p, None, labels=y).float().mean() for x, p, y in mbs) / len(mbs)
        ref_loss.backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert abs(loss - float(ref_loss)) < 1e-6


def test_fp8_recipes_are_megatron_core_names_and_delayed_as_launched():
    from megatron.core.enums import Fp8Recipe

    recipes = {r for r in te_check.PRECISIONS.values() if r}
    assert recipes == {"delayed", "tensorwise"} <= {r.value for r in Fp8Recipe}
    args = SimpleNamespace(num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                           ffn_hidden_size=16, num_experts=0)
    cfg = te_check._config(args, "delayed")
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo) == (
        "hybrid", "delayed", 1024, "max")  # examples/models.sh: FP8=1
    cfg = te_check._config(args, "tensorwise")
    assert (cfg.fp8_recipe, cfg.fp8_amax_history_len) == ("tensorwise", 1)


def test_report_loss_vs_bf16_of_the_same_variant():
    row = dict(ms=10.0, peak=1.0)
    rows = [dict(row, variant="shared", precision="bf16", loss=2.0),
            dict(row, variant="unified", precision="bf16", loss=4.0),
            dict(row, variant="shared", precision="fp8-delayed", loss=2.2),
            dict(row, variant="unified", precision="fp8-delayed", loss=3.0)]
    lines = te_check.report(rows).splitlines()
    assert lines[0].endswith("| loss vs bf16 |")
    assert [ln.rsplit("|", 2)[1].strip() for ln in lines[2:]] == [
        "+0.000%", "+0.000%", "+10.000%", "-25.000%"]


def test_te_check_tool_refuses_without_cuda_in_one_line():
    """No CUDA (or no TE): exit 2 with one line, so gpu_check.sh's part 4 says why."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "te_check.py"), "--steps",
                        "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, (p.returncode, p.stderr)
    assert p.stderr.startswith("te_check: needs a CUDA device"), p.stderr


def _built_as_users_run_it(rank, world):
    """te_check's build and train on CPU, through TE's Python over the test stand-in."""
    from scalevec_testing import init_model_parallel, te_stub

    te_stub.activate()
    init_model_parallel()
    from megatron.core.distributed import DistributedDataParallel
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    args = te_check.build_parser().parse_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "16",
         "--micro-batch-size", "2", "--micro-batches", "2", "--vocab", "128"])
    def buffers():  # TE 2.11: on the class; 2.17: on its quantization_state
        state = getattr(FP8GlobalStateManager, "quantization_state", FP8GlobalStateManager)
        return state.global_amax_buffer

    out = {}
    for variant in ("stock", "unified"):
        buffers()["backward_stale"] = []  # an earlier row's (TE's key format, nothing in it)
        with te_stub.cuda_claimed():
            ddp, opt, finalize = te_check.build(args, variant, "fp8-delayed", device="cpu")
        te = [m for m in ddp.modules() if type(m).__module__.startswith(
            ("transformer_engine", "megatron.core.extensions", "megatron_scalevec.layers.te"))
            and hasattr(m, "fuse_wgrad_accumulation")]
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 128, (2, 17), generator=g)
        mbs = [(tokens[:, :-1], torch.arange(16).expand(2, 16), tokens[:, 1:])] * 2
        _, loss = te_check.train(ddp, opt, mbs, steps=2, finalize=finalize,
                                 forward_context=te_stub.cuda_claimed)
        out[variant] = dict(
            ddp=isinstance(ddp, DistributedDataParallel), fused=all(
                m.fuse_wgrad_accumulation for m in te) and len(te) >= 4,
            main_grad=all(hasattr(p, "main_grad") for p in ddp.parameters() if p.requires_grad),
            optimizer=type(opt).__module__.startswith("megatron.core.optimizer"),
            fresh="backward_stale" not in buffers(),
            loss=loss, grads=sum(float(p.main_grad.abs().sum()) for p in ddp.parameters()
                                 if p.requires_grad))
    return out


@needs_te
def test_te_check_builds_the_model_as_users_run_it():
    """Each row: megatron-core's DDP (every trainable parameter with its main_grad), TE's
    linears accumulating their weight gradient into it, megatron-core's optimizer, and a fresh
    TE FP8 state (an earlier row's amax buffer is gone); two FP8 steps give a finite loss and
    gradients in main_grad (CPU, TE's Python over the stand-in of its kernels)."""
    for variant, r in run_on_ranks(_built_as_users_run_it, 1)[0].items():
        assert r["ddp"] and r["fused"] and r["main_grad"] and r["optimizer"], (variant, r)
        assert r["fresh"] and 0 < r["loss"] < 10 and r["grads"] > 0, (variant, r)
