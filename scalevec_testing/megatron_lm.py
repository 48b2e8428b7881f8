"""Test-only: Megatron-LM's own ``pretrain_gpt.py`` on CPU (gloo), from a user's checkout.

Megatron-LM's repository-root scripts are not on the package index, so the tests read a checkout
from ``MEGATRON_LM_ROOT`` (``.ci/run`` points it at ``../shared/megatron-lm/<tag>``; where it is
unset the suite skips, unless ``MEGATRON_SCALEVEC_REQUIRE_MEGATRON_LM=1`` makes that a failure).
The checkout goes on ``sys.path`` after site-packages, as a user's would: ``megatron`` is a
namespace package, so ``megatron.core`` (and on 0.19 ``megatron.training``) still come from the
installed wheel and only what the wheel lacks comes from the checkout.

:func:`run` launches ``nproc`` ranks (``python -m scalevec_testing.megatron_lm``), each of which
installs the CPU shim below and runs the real script with ``runpy`` as ``__main__``. Written for
Megatron-LM core_v0.16.1 and core_v0.19.0 (with the 0.19.2 wheel's ``megatron/training``); what
the shim changes, and why (each only what a CPU cannot answer, never the model or the loop):

==  =====================================  ============================================
#   what Megatron-LM does                  what the shim does
==  =====================================  ============================================
1   CUDA devices, streams, RNG             megatron_scalevec.compat.cpu (the project's
                                           CPU layer, as for every CPU test)
2   ``initialize_megatron`` asserts CUDA   passes ``allow_no_cuda=True``
3   ``make -C megatron/core/datasets``     a no-op ``compile_helpers``: the wheels ship
    (the wheels ship no Makefile)          the compiled helpers
4   legacy ``fused_kernels.load`` (0.16)   a no-op (nothing fused runs on CPU)
5   ``batch_invariant_kernels`` imports    a stand-in module that raises when used
    triton (0.19, at import)               (only where triton is absent)
6   ``megatron.rl.parallel_utils``          a stand-in that raises when used (the
    (0.16, imported by training.py; not    RL inference path only)
    in the reference checkout)
7   compute capability for grouped GEMM    sm_90 (``get_device_capability``,
    and FSDP checks                        ``get_device_properties``)
8   gloo's two worker threads              one (scalevec_testing.distributed)
9   ``--transformer-impl                   TE's real Python over te_stub's kernels;
    transformer_engine``                   ``cuda_claimed`` around building the model
                                           and each forward-backward schedule (not the
                                           optimizer: torch's asks a CUDA build's
                                           driver once CUDA is claimed)
==  =====================================  ============================================

Each rank writes a JSON record (the parameter names and shapes of every model chunk, the loss
of every iteration, each parameter's optimizer group LRs at the end, the exit code) to
``<out>/rank<r>.json``; :func:`run` returns them with the
ranks' combined output.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import runpy
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Optional

ENV_ROOT = "MEGATRON_LM_ROOT"
ENV_REQUIRE = "MEGATRON_SCALEVEC_REQUIRE_MEGATRON_LM"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Megatron-LM on CPU: no fused kernels, CPU initialization, gloo (MEGATRON_LM_NOTES.md).
CPU_FLAGS = ("--no-gradient-accumulation-fusion --no-persist-layer-norm "
             "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-gelu-fusion "
             "--no-bias-dropout-fusion --no-rope-fusion --use-cpu-initialization "
             "--distributed-backend gloo").split()
SPEC = ["--spec", "megatron_scalevec.megatron_lm_spec"]
# a tiny model on Megatron-LM's mock data; its defaults otherwise (LayerNorm with biases, GELU,
# linear biases, absolute positions unless a case says rope)
TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
        "--train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
        "--log-interval 1 --eval-iters 0 --eval-interval 1000 --seed 1234").split()
LOCAL = ["--transformer-impl", "local"]
TE = ["--transformer-impl", "transformer_engine"]  # TE's Python over te_stub's kernels
MOE = "--num-experts 4 --moe-router-topk 2 --disable-bias-linear".split()


@dataclass(frozen=True)
class Case:
    """One flag set of Megatron-LM's, run stock (no ``--spec``) and with ours."""

    flags: tuple
    nproc: int = 1
    spec: str = "scalevec_dense"

    @property
    def te(self) -> bool:
        return "transformer_engine" in self.flags

    def argv(self, strategy: Optional[str]) -> list:
        return [*TINY, *self.flags, *([] if strategy is None else [*SPEC, self.spec])]

    def env(self, strategy: Optional[str]) -> dict:
        env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron-LM asks it of TP > 1
        if strategy is not None:
            env["MEGATRON_SCALEVEC"] = strategy
        return env


def _case(flags: str, nproc: int = 1, spec: str = "scalevec_dense", base=LOCAL) -> Case:
    return Case(tuple(base) + tuple(flags.split()), nproc, spec)


CASES = {
    # Megatron-LM's defaults: LayerNorm with biases, GELU, biased linears, learned positions
    "layernorm_defaults": _case(""),
    "rmsnorm_swiglu_rope": _case("--normalization RMSNorm --swiglu --disable-bias-linear "
                                 "--position-embedding-type rope"),
    "qk_layernorm": _case("--qk-layernorm --position-embedding-type rope"),
    # stock's local norm refuses sequence parallelism without Apex: the TE layout
    "tp2_sp": _case("--tensor-model-parallel-size 2 --sequence-parallel", 2, base=TE),
    "pp2_vpp_moe": _case(" ".join(MOE) + " --pipeline-model-parallel-size 2 "
                         "--num-layers-per-virtual-pipeline-stage 1 --moe-layer-freq [1,0,0,0]",
                         2, "scalevec_moe"),
    "pp2_uneven_moe": _case(" ".join(MOE) + " --pipeline-model-parallel-size 2 "
                            "--decoder-first-pipeline-num-layers 1 --moe-layer-freq [0,1,0,1]",
                            2, "scalevec_moe"),
    "pp2_embedding_split_moe": _case(" ".join(MOE) + " --pipeline-model-parallel-size 2 "
                                     "--account-for-embedding-in-pipeline-split --num-layers 5 "
                                     "--moe-layer-freq [0,1,1,0,1]", 2, "scalevec_moe"),
    # local grouped GEMM needs the CUDA-only grouped_gemm package: TE's grouped experts
    "ep2_grouped": _case(" ".join(MOE) + " --expert-model-parallel-size 2 --moe-grouped-gemm "
                         "--moe-token-dispatcher-type alltoall", 2, "scalevec_moe", base=TE),
    "dp2_distopt_overlap": _case("--use-distributed-optimizer --overlap-grad-reduce "
                                 "--overlap-param-gather", 2),
}


def strategy_string(text: str) -> str:
    """The canonical name of a strategy (``unified`` -> ``hg+dnp+or+iwd``)."""
    from megatron_scalevec.config import ScaleVecConfig

    return ScaleVecConfig.from_string(text).to_string()


def layer_kinds(params: list) -> list:
    """Per model chunk, ``{local layer: 'moe' | 'dense'}`` from parameter names."""
    kinds = []
    for chunk in params:
        layers = {}
        for name, _ in chunk:
            parts = name.split(".")
            if "layers" in parts and parts[parts.index("layers") + 1].isdigit():
                i = int(parts[parts.index("layers") + 1])
                moe = ".mlp.router." in name or ".mlp.experts." in name
                layers[i] = "moe" if moe or layers.get(i) == "moe" else "dense"
        kinds.append(layers)
    return kinds


def checkout() -> Optional[str]:
    """The Megatron-LM checkout the tests run, or None."""
    root = os.environ.get(ENV_ROOT, "").strip()
    return root or None


def missing() -> Optional[str]:
    """Why the Megatron-LM tests cannot run here, or None."""
    root = checkout()
    if root is None:
        return f"{ENV_ROOT} is not set (a Megatron-LM checkout; .ci/run sets it)"
    if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
        return f"{ENV_ROOT}={root} has no pretrain_gpt.py"
    return None


def required() -> bool:
    """CI requires the Megatron-LM tests (``MEGATRON_SCALEVEC_REQUIRE_MEGATRON_LM=1``)."""
    return os.environ.get(ENV_REQUIRE) == "1"


@dataclass
class Result:
    """What the ranks of one run reported."""

    returncode: int
    output: str
    ranks: list = field(default_factory=list)

    def losses(self) -> dict:
        """``{iteration: lm loss}`` of the last pipeline stage (the rank that logs it)."""
        for rec in reversed(self.ranks):
            if rec.get("loss"):
                return {int(k): v for k, v in rec["loss"].items()}
        return {}

    def params(self, rank: int) -> list:
        """``[(name, shape), ...]`` of every model chunk of ``rank``, in chunk order."""
        return [(f"chunk{i}.{n}", tuple(s)) for i, chunk in enumerate(self.ranks[rank]["params"])
                for n, s in chunk]

    def check(self) -> Result:
        if self.returncode != 0:
            raise AssertionError(f"Megatron-LM exited {self.returncode}:\n{self.output[-6000:]}")
        return self


def run(args: list, out_dir: str, nproc: int = 1, env: Optional[dict] = None,
        timeout: float = 300, rank_env: Optional[dict] = None) -> Result:
    """Run ``pretrain_gpt.py args`` (plus :data:`CPU_FLAGS`) on ``nproc`` CPU ranks;
    ``rank_env``: ``{rank: variables}`` set on that rank only."""
    if missing():
        raise RuntimeError(f"{ENV_REQUIRE}={os.environ.get(ENV_REQUIRE, '')!r}: {missing()}")
    os.makedirs(out_dir, exist_ok=True)
    from scalevec_testing.distributed import free_port  # torch: the launcher's side only

    port = free_port()
    base = {**os.environ, **(env or {})}
    base.setdefault("MEGATRON_SCALEVEC_FUSED_COMPILE", "off")
    base["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, base.get("PYTHONPATH")) if p)
    procs = []
    for rank in range(nproc):
        env_r = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                     **(rank_env or {}).get(rank, {}))
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")  # noqa: SIM115
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "scalevec_testing.megatron_lm", out_dir, *args, *CPU_FLAGS],
            env=env_r, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc, _ in procs:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        codes = [124]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    output = "".join(f"--- rank {r} ---\n" + open(os.path.join(out_dir, f"rank{r}.log")).read()
                     for r in range(nproc))
    ranks = []
    for r in range(nproc):
        path = os.path.join(out_dir, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path) else {})
    return Result(next((c for c in codes if c), 0), output, ranks)


# --------------------------------------------------------------------------- in the rank
def _stand_in(name: str, **attrs) -> None:
    module = types.ModuleType(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"{name} is stood in for on CPU (scalevec_testing.megatron_lm)")

    for key in attrs.get("functions", ()):
        setattr(module, key, unavailable)
    for key, value in attrs.get("values", {}).items():
        setattr(module, key, value)
    sys.modules[name] = module


def _install_shim(te: bool) -> contextlib.AbstractContextManager:
    """Patches 1-9 of the module docstring; returns the context a model build / step runs in."""
    import importlib.util

    import torch

    from megatron_scalevec.compat.cpu import enable_cpu_compat
    from scalevec_testing.distributed import one_gloo_worker_thread

    enable_cpu_compat()  # 1
    one_gloo_worker_thread()  # 8
    claim = contextlib.nullcontext
    if te:  # 9: before megatron.training imports megatron-core's TE modules
        from scalevec_testing import te_stub

        te_stub.activate()
        claim = te_stub.cuda_claimed
    sm90 = types.SimpleNamespace(name="CPU", major=9, minor=0, multi_processor_count=1,
                                 total_memory=0)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # 7
    torch.cuda.get_device_properties = lambda *a, **k: sm90
    if importlib.util.find_spec("triton") is None:  # 5
        _stand_in("megatron.core.transformer.custom_layers.batch_invariant_kernels",
                  functions=("enable_batch_invariant_mode", "disable_batch_invariant_mode"),
                  values={"is_batch_invariant_mode_enabled": lambda: False})
    try:  # 6
        importlib.import_module("megatron.rl.parallel_utils")
    except ImportError:
        _stand_in("megatron.rl")
        _stand_in("megatron.rl.parallel_utils", functions=("build_inference_pg_collection",))
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None  # 3
    try:
        import megatron.legacy.fused_kernels as fused_kernels

        fused_kernels.load = lambda args: None  # 4
    except ImportError:
        pass
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):  # 2
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = training.initialize_megatron = initialize_megatron
    return claim


def _claimed(fn, claim):
    @functools.wraps(fn)
    def run_claimed(*args, **kwargs):
        with claim():
            return fn(*args, **kwargs)

    return run_claimed


def _record(training, record: dict, claim) -> None:
    """Wrap the loop's functions to record parameters and losses (and claim CUDA for TE)."""
    setup = training.setup_model_and_optimizer

    @functools.wraps(setup)
    def setup_model_and_optimizer(*args, **kwargs):
        with claim():
            result = setup(*args, **kwargs)
        record["params"] = [[(n, list(p.shape)) for n, p in chunk.named_parameters()]
                            for chunk in result[0]]
        record["_optimizer"] = (result[0], result[1])
        return result

    log = training.training_log

    @functools.wraps(log)
    def training_log(loss_dict, total_loss_dict, lr, iteration, *args, **kwargs):
        if loss_dict:
            record["loss"][iteration] = {k: float(v) for k, v in loss_dict.items()}
        return log(loss_dict, total_loss_dict, lr, iteration, *args, **kwargs)

    schedule = training.get_forward_backward_func

    @functools.wraps(schedule)
    def get_forward_backward_func(*args, **kwargs):  # TE's forward and backward, not the
        return _claimed(schedule(*args, **kwargs), claim)  # optimizer (torch's asks CUDA)

    training.setup_model_and_optimizer = setup_model_and_optimizer
    training.training_log = training_log
    training.get_forward_backward_func = get_forward_backward_func


def optimizer_groups(model, optimizer) -> dict:
    """``{chunk<i>.<name>: [max_lr, min_lr, lr_mult, lr]}`` of the parameters the optimizer
    steps directly (all of them without the distributed optimizer), at the end of the run."""
    if optimizer is None:
        return {}
    names = {id(p): f"chunk{i}.{n}" for i, chunk in enumerate(model)
             for n, p in chunk.named_parameters()}
    return {names[id(p)]: [g.get("max_lr"), g.get("min_lr"), g.get("lr_mult"), g.get("lr")]
            for g in optimizer.param_groups for p in g["params"] if id(p) in names}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out_dir, args = argv[0], argv[1:]
    root = checkout()
    sys.path.append(root)  # after site-packages, as a user's checkout
    te = "transformer_engine" in args[args.index("--transformer-impl") + 1:][:1] \
        if "--transformer-impl" in args else False
    claim = _install_shim(te)
    import megatron.training.training as training

    record = {"loss": {}, "params": None, "exit": None}
    _record(training, record, claim)
    script = os.path.join(root, "pretrain_gpt.py")
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        record["exit"] = code
        record["groups"] = optimizer_groups(*record.pop("_optimizer", (None, None)))
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
