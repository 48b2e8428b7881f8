"""Trainer flags (Megatron-LM names where one exists) and their validation.

Validation runs before anything is initialized or written, so a bad flag costs no output.
With no flags at all the defaults are the embedded default run: a small MoE model with the
unified strategy, trained on CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from types import SimpleNamespace

from megatron_scalevec.cli_help import show_defaults
from megatron_scalevec.config import unsupported_feature

SPECS = ("scalevec_moe", "scalevec_dense", "baseline")
# Architecture flags a warm start or resume takes from the checkpoint when not given.
ARCH_DEFAULTS = {"norm_epsilon": 1e-5, "rotary_base": 10000.0, "moe_router_pre_softmax": False}
_ARCH_FIELDS = {"norm_epsilon": "layernorm_epsilon", "rotary_base": "rotary_base",
                "moe_router_pre_softmax": "moe_router_pre_softmax"}
DECAY_STYLES = ("cosine", "linear", "constant", "WSD")
# MEGATRON_SCALEVEC_TINY=1: smaller defaults (flags given still win), so the documented commands
# run as written in seconds; the tests of README.md and docs/usage.md set it.
TINY_ENV = "MEGATRON_SCALEVEC_TINY"
TINY_DEFAULTS = dict(num_layers=2, hidden_size=64, seq_length=32, micro_batch_size=2,
                     train_iters=4, log_interval=2, eval_interval=2, eval_iters=1)


class ArgumentError(ValueError):
    """A bad flag or a flag combination that cannot work (message names the flag)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of sys.exit so main(argv) is testable
        raise ArgumentError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Pre-train a GPT model with scale vectors "
                "(megatron-core). No flags: the embedded default run.")
    g = p.add_argument_group("strategy")
    g.add_argument("--spec", default="scalevec_moe", help=f"one of {', '.join(SPECS)}")
    g.add_argument("--scalevec", default=None,
                   help="strategy string (e.g. hg+dnp+or+iwd); default: unified for scalevec_*")
    g.add_argument("--scale-vector-weight-decay", type=float, default=None,
                   help="decay of Input-Norm vectors (default: --weight-decay)")
    g.add_argument("--decay-direction", action="store_true",
                   help="under OR/ER also decay the direction/logit part")
    g.add_argument("--expert-vectors", default=None, choices=("per_expert", "shared"),
                   help="MoE (default per_expert): every expert its own vectors (SPEC) or "
                        "one set per layer shared by the routed experts (fewer parameters)")
    g.add_argument("--layernorm-bias", default="stock", choices=("stock", "none"),
                   help="--normalization LayerNorm: keep megatron-core's LayerNorm biases, "
                        "added before the branch vectors (stock), or none")
    g.add_argument("--vector-lr-mult", type=float, default=None,
                   help="the scale vectors' peak and floor LR over --lr / --min-lr (default 30; "
                        "1 under --scalevec shared, stock megatron-core; docs/RESULTS.md)")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--normalization", default="RMSNorm", choices=("RMSNorm", "LayerNorm"))
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--norm-epsilon", type=float, default=None,
                   help="epsilon of every RMSNorm/LayerNorm (default: the warm-start or resumed "
                        f"checkpoint's, else {ARCH_DEFAULTS['norm_epsilon']})")
    g.add_argument("--rotary-base", type=float, default=None,
                   help="RoPE base theta (default: the warm-start or resumed checkpoint's, else "
                        f"{ARCH_DEFAULTS['rotary_base']:g})")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="only for --mock-data (a real tokenizer sets it)")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=int, default=1)
    g.add_argument("--moe-token-dispatcher-type", default="alltoall",
                   choices=("allgather", "alltoall"))
    g.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    g.add_argument("--moe-router-pre-softmax", default=None, action="store_true",
                   help="softmax over all experts before top-k, no renormalization (Qwen3-MoE's "
                        "norm_topk_prob=False; default: the warm-start or resumed checkpoint's, "
                        "else off)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="grouped-GEMM experts (torch grouped_mm, or TE's GroupedLinear under "
                        "--transformer-impl transformer_engine) instead of sequential ones")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the "
                        "next forward (needs --use-distributed-optimizer, --overlap-grad-reduce)")
    g.add_argument("--align-param-gather", action="store_true",
                   help="with --overlap-param-gather: the schedule dispatches all gathers at "
                        "once (Megatron-LM's flag)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per DDP bucket (default: megatron-core's)")
    g.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"))
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fused-compile", default=None, choices=("auto", "on", "off"),
                   help="torch.compile of the fused DNP kernels (default: "
                        "$MEGATRON_SCALEVEC_FUSED_COMPILE, else auto = compiled, eager if "
                        "compiling fails)")
    g.add_argument("--transformer-impl", default=None, choices=("local", "transformer_engine"),
                   help="linear/attention implementation (default: transformer_engine when "
                        "Transformer Engine is installed, else local); FP8 needs TE")
    # FP8: Megatron-LM's flags, names, choices and defaults (core_v0.16.1 to 0.19.x)
    g.add_argument("--fp8-format", default=None, choices=("e4m3", "hybrid"),
                   help="FP8 GEMMs through Transformer Engine (needs --transformer-impl "
                        "transformer_engine and a Hopper-or-newer GPU)")
    g.add_argument("--fp8-recipe", default="delayed",
                   choices=("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
                   help="FP8 scaling recipe; delayed and tensorwise run with the scale vectors, "
                        "the others are refused (untested)")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed scaling's margin")
    g.add_argument("--fp8-amax-history-len", type=int, default=1,
                   help="delayed scaling: steps of amax history per tensor")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=("most_recent", "max"),
                   help="delayed scaling: the amax from the history")

    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd", "muon"))
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=None, help="default: --lr / 10")
    g.add_argument("--lr-decay-style", default="cosine", choices=DECAY_STYLES)
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-style", default="linear",
                   choices=("linear", "cosine", "exponential", "minus_sqrt"))
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=150)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after this iteration, as if killed, and save a checkpoint (in "
                        "--save, else the run dir; none with --no-save)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--check-for-nan-in-loss-and-grad", default=True,
                   action=argparse.BooleanOptionalAction,
                   help="stop with an error (exit 3) at the first NaN/Inf loss or gradient, "
                        "before the optimizer step and before any checkpoint is written")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective waiting this long on a dead rank or node ends the run")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--split", default="98,2,0")
    g.add_argument("--data-cache-path", default=None,
                   help="megatron-core's index cache (default: beside the data, as "
                        "Megatron-LM) and the embedded default's files (default: "
                        "~/.cache/megatron_scalevec)")
    g.add_argument("--mock-data", action="store_true",
                   help="megatron-core's MockGPTDataset (no corpus, no tokenizer)")

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--tensorboard-dir", default=None,
                   help="also log the scalars to TensorBoard (pip install "
                        "'megatron_scalevec[tensorboard]')")
    g.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl and the loss plot go (default: --save, else "
                        "--load, else runs/<spec>-<strategy>-l<layers>-h<hidden>[-e<experts>]"
                        "[-tp<n>][-pp<n>][-ep<n>][-dp<n>]-s<seed>, layout parts only when > 1)")
    g.add_argument("--no-plot", action="store_true", help="do not write loss.png at the end")
    g.add_argument("--save", default=None,
                   help="checkpoint directory (default: the run dir; the last iteration is "
                        "always saved)")
    g.add_argument("--no-save", action="store_true",
                   help="write no checkpoint (a throwaway run)")
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None,
                   help="also save every this many iterations")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, the LR/WD schedule of this run's flags replaces the "
                        "checkpoint's (Megatron-LM's meaning)")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, keep the checkpoint's LR/WD schedule and ignore this run's "
                        "schedule flags (Megatron-LM's meaning); with neither flag a resume that "
                        "changes the schedule is refused")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="start from these weights (converter output or a trainer checkpoint) "
                        "when --load holds no checkpoint; iteration and optimizer start fresh")
    g.add_argument("--finetune", action="store_true",
                   help="load only the weights from --load; iteration and optimizer reset")
    g.add_argument("--no-verify-checkpoint", action="store_true",
                   help="on --load, skip the SHA-256 check of every checkpoint file against "
                        "its manifest (for very large checkpoints; sizes are still checked)")
    g.add_argument("--overwrite", action="store_true",
                   help="reuse a run dir / --save dir that holds another run")
    g.add_argument("--quiet", action="store_true", help="log to the JSONL file only")
    if os.environ.get(TINY_ENV, "") not in ("", "0"):
        p.set_defaults(**TINY_DEFAULTS)
    return show_defaults(p)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ArgumentError(msg)


def parse_args(argv=None, world_size: int = 1) -> argparse.Namespace:
    """Parse and validate; fills derived sizes. Raises ArgumentError; writes nothing."""
    _refuse_megatron_lm_env()
    a = build_parser().parse_args(argv)
    _need(a.spec in SPECS, f"--spec {a.spec!r} is unknown; choose one of {', '.join(SPECS)}")
    from megatron_scalevec.config import ScaleVecConfig  # noqa: PLC0415

    if a.spec == "baseline":
        _need(a.scalevec in (None, "shared", "baseline"),
              f"--spec baseline is megatron-core's own layer spec (strategy 'shared'); for "
              f"--scalevec {a.scalevec!r} use --spec scalevec_dense or scalevec_moe")
        _need(a.vector_lr_mult in (None, 1.0),
              "--vector-lr-mult: --spec baseline is megatron-core's own layer spec, whose norms "
              "are not marked as scale vectors; use --spec scalevec_dense --scalevec shared "
              "(the same model)")
        a.scalevec = "shared"
    a.scalevec = a.scalevec or "unified"
    if a.spec == "scalevec_moe" and a.num_experts is None:
        a.num_experts = 4
    _need(a.expert_vectors is None or bool(a.num_experts),
          f"--expert-vectors {a.expert_vectors} applies to MoE experts; this model is dense "
          f"(use --spec scalevec_moe / --num-experts, or drop the flag)")
    a.expert_vectors = a.expert_vectors or "per_expert"
    try:
        a.scalevec_config = ScaleVecConfig.from_string(
            a.scalevec, scale_vector_weight_decay=a.scale_vector_weight_decay,
            decay_direction=a.decay_direction, expert_vectors=a.expert_vectors,
            layernorm_bias=a.layernorm_bias, vector_lr_mult=a.vector_lr_mult)
    except ValueError as e:
        flag = "--vector-lr-mult" if "vector_lr_mult" in str(e) else "--scalevec"
        raise ArgumentError(f"{flag}: {e}") from None
    if a.spec == "scalevec_dense":
        _need(not a.num_experts, "--spec scalevec_dense is dense: drop --num-experts or use "
                                 "--spec scalevec_moe")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "log_interval", "eval_iters"):
        _need(getattr(a, name) > 0, f"--{name.replace('_', '-')} must be > 0")
    a.num_query_groups = a.num_query_groups or a.num_attention_heads
    a.ffn_hidden_size = a.ffn_hidden_size or 4 * a.hidden_size
    a.moe_ffn_hidden_size = a.moe_ffn_hidden_size or a.ffn_hidden_size
    a.max_position_embeddings = a.max_position_embeddings or a.seq_length
    _need(a.seq_length <= a.max_position_embeddings,
          f"--seq-length {a.seq_length} > --max-position-embeddings "
          f"{a.max_position_embeddings}: the model has no positions beyond that")
    _need(a.lr > 0, f"--lr {a.lr} must be > 0")
    a.min_lr = a.lr / 10 if a.min_lr is None else a.min_lr
    _need(0 <= a.min_lr <= a.lr, f"--min-lr {a.min_lr} must be between 0 and --lr {a.lr}")
    _need(a.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be > 0")
    _need(a.hidden_size % a.num_attention_heads == 0,
          f"--hidden-size {a.hidden_size} is not divisible by --num-attention-heads "
          f"{a.num_attention_heads}")
    _need(a.num_attention_heads % a.num_query_groups == 0,
          f"--num-attention-heads {a.num_attention_heads} is not divisible by "
          f"--num-query-groups {a.num_query_groups}")
    tp, pp, ep = (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                  a.expert_model_parallel_size)
    etp = a.expert_tensor_parallel_size or tp
    a.expert_tensor_parallel_size = etp
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--expert-model-parallel-size", ep)):
        _need(v >= 1, f"{flag} must be >= 1")
    _need(world_size % (tp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
          f"--pipeline-model-parallel-size {pp}")
    dp = world_size // (tp * pp)
    _need(world_size % (etp * ep * pp) == 0,
          f"world size {world_size} is not divisible by expert-tensor {etp} x expert {ep} x "
          f"pipeline {pp} parallel sizes")
    for flag, v in (("--num-attention-heads", a.num_attention_heads),
                    ("--num-query-groups", a.num_query_groups),
                    ("--ffn-hidden-size", a.ffn_hidden_size)):
        _need(v % tp == 0, f"{flag} {v} is not divisible by --tensor-model-parallel-size {tp}")
    vpp = a.virtual_pipeline_model_parallel_size or 1
    _need(a.num_layers % (pp * vpp) == 0,
          f"--num-layers {a.num_layers} is not divisible by pipeline x virtual pipeline "
          f"size {pp * vpp}")
    if a.num_experts:
        _need(a.num_experts % ep == 0, f"--num-experts {a.num_experts} is not divisible by "
                                       f"--expert-model-parallel-size {ep}")
        _need(a.moe_router_topk <= a.num_experts,
              f"--moe-router-topk {a.moe_router_topk} > --num-experts {a.num_experts}")
        _need(tp == 1 or a.sequence_parallel,
              "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel")
    else:
        _need(ep == 1, "--expert-model-parallel-size > 1 needs --num-experts")
    if a.sequence_parallel and tp == 1:
        a.sequence_parallel = False
    a.global_batch_size = a.global_batch_size or a.micro_batch_size * dp
    _need(a.global_batch_size % (a.micro_batch_size * dp) == 0,
          f"--global-batch-size {a.global_batch_size} is not divisible by --micro-batch-size "
          f"{a.micro_batch_size} x data-parallel size {dp}")
    a.data_parallel_size = dp
    a.num_microbatches = a.global_batch_size // (a.micro_batch_size * dp)
    if pp > 1 and a.virtual_pipeline_model_parallel_size:
        _need(a.num_microbatches % pp == 0, "the interleaved pipeline schedule needs the "
                                            "number of micro-batches divisible by --pipeline-"
                                            "model-parallel-size")
    if a.overlap_param_gather:  # Megatron-LM's own rules for the flag
        _need(a.use_distributed_optimizer,
              "--overlap-param-gather needs --use-distributed-optimizer")
        _need(a.overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce")
    _need(not a.align_param_gather or a.overlap_param_gather,
          "--align-param-gather applies with --overlap-param-gather")
    _need(a.ddp_bucket_size is None or a.ddp_bucket_size > 0, "--ddp-bucket-size must be > 0")
    if a.optimizer == "muon":
        _need(importlib.util.find_spec("emerging_optimizers") is not None,
              "--optimizer muon needs the emerging-optimizers package (Python >= 3.12)")
        _need(not a.use_distributed_optimizer,
              "--optimizer muon does not work with --use-distributed-optimizer in "
              "megatron-core 0.16.1")
    a.lr_warmup_iters = a.lr_warmup_iters if a.lr_warmup_iters is not None else \
        min(max(1, a.train_iters // 10), a.train_iters - 1)
    a.lr_decay_iters = a.lr_decay_iters or a.train_iters
    if a.lr_decay_style == "WSD":
        a.lr_wsd_decay_iters = a.lr_wsd_decay_iters or max(1, a.lr_decay_iters // 5)
    _need(a.lr_warmup_iters < a.lr_decay_iters or a.lr_decay_style == "constant",
          f"--lr-warmup-iters {a.lr_warmup_iters} must be < --lr-decay-iters {a.lr_decay_iters}")
    if a.load is not None:  # with --pretrained-checkpoint, --load may be a new run's folder
        _need(os.path.isdir(a.load) or a.pretrained_checkpoint is not None,
              f"--load {a.load!r}: no such directory")
    if a.pretrained_checkpoint is not None:
        _need(os.path.isdir(a.pretrained_checkpoint),
              f"--pretrained-checkpoint {a.pretrained_checkpoint!r}: no such directory")
    _need(not a.finetune or a.load is not None, "--finetune loads the weights of --load: "
                                                "pass --load (or use --pretrained-checkpoint)")
    _need(not (a.override_opt_param_scheduler and a.use_checkpoint_opt_param_scheduler),
          "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude "
          "each other")
    _arch_from_checkpoint(a)
    if a.no_save:
        _need(a.save is None and a.save_interval is None,
              "--no-save writes no checkpoint: drop --save / --save-interval, or --no-save")
    if a.save_interval is not None:
        _need(a.save_interval > 0, "--save-interval must be > 0")
    if a.save is not None:
        _need(not os.path.exists(a.save) or os.path.isdir(a.save),
              f"--save {a.save!r} is an existing file, not a directory")
    if a.data_path and a.mock_data:
        raise ArgumentError("--data-path and --mock-data exclude each other")

    _need(a.tensorboard_dir is None or importlib.util.find_spec("tensorboard") is not None,
          "--tensorboard-dir needs the tensorboard package: pip install "
          "'megatron_scalevec[tensorboard]' (or drop it: metrics.jsonl has the same scalars)")
    _need(not a.moe_grouped_gemm or bool(a.num_experts),
          "--moe-grouped-gemm applies to MoE experts; this model is dense (no --num-experts)")
    _need(a.fp8_amax_history_len >= 1, "--fp8-amax-history-len must be at least 1")
    why = unsupported_feature(SimpleNamespace(fp8=a.fp8_format, fp8_recipe=a.fp8_recipe))
    _need(why is None, why or "")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    if a.transformer_impl is None:
        a.transformer_impl = "transformer_engine" if have_te else "local"
    _need(a.transformer_impl == "local" or have_te,
          "--transformer-impl transformer_engine needs Transformer Engine installed "
          "(pip install 'megatron_scalevec[te]'); use --transformer-impl local")
    _need(a.fp8_format is None or a.transformer_impl == "transformer_engine",
          "--fp8-format needs --transformer-impl transformer_engine (FP8 comes from TE's GEMMs)")
    _need(not (a.moe_grouped_gemm and a.spec == "baseline" and a.transformer_impl == "local"),
          "--moe-grouped-gemm with --spec baseline needs --transformer-impl transformer_engine "
          "(megatron-core's local spec has no grouped experts without the grouped_gemm package)")
    resumed = a.load if a.load is not None and not a.finetune else None  # a run continued
    a.run_dir = a.run_dir or a.save or resumed or os.path.join("runs", default_run_name(a))
    if not a.no_save:  # a run keeps its model: by default in its run dir
        a.save = a.save or a.run_dir
    _refuse_other_run(a)
    return a


# Megatron-LM's strategy variables (megatron_lm.py) -> the flag of ours that does the same.
_ENV_FLAGS = {"MEGATRON_SCALEVEC": "--scalevec", "MEGATRON_SCALEVEC_VECTOR_WD":
              "--scale-vector-weight-decay", "MEGATRON_SCALEVEC_EXPERT_VECTORS":
              "--expert-vectors", "MEGATRON_SCALEVEC_DECAY_DIRECTION": "--decay-direction",
              "MEGATRON_SCALEVEC_LAYERNORM_BIAS": "--layernorm-bias"}


def _refuse_megatron_lm_env() -> None:
    """The variables that set the strategy inside Megatron-LM do nothing here: refuse them
    rather than train another strategy than the one the user set."""
    from megatron_scalevec.megatron_lm import STRATEGY_ENV_VARS  # noqa: PLC0415

    found = [(n, os.environ[n].strip()) for n in STRATEGY_ENV_VARS
             if os.environ.get(n, "").strip()]
    if not found:
        return
    def flag(name, value):
        if name not in _ENV_FLAGS:
            return f"ScaleVecConfig in Python for {name} (this trainer has no flag for it)"
        if _ENV_FLAGS[name] == "--decay-direction":  # a switch: no value
            return _ENV_FLAGS[name]
        return f"{_ENV_FLAGS[name]} {value}"

    use = ", ".join(flag(n, v) for n, v in found)
    names = " and ".join(f"{n}={v}" for n, v in found)
    raise ArgumentError(f"{names}: set for Megatron-LM's --spec megatron_scalevec.megatron_lm_spec"
                        f", not read by this trainer: pass {use} instead and unset "
                        f"{' '.join(n for n, _ in found)}")


def source_arch_file(a):
    """The ``scalevec_arch.json`` of the checkpoint this run starts from: the latest of
    ``--load`` (resume, --finetune), else ``--pretrained-checkpoint``; None if there is none."""
    from megatron_scalevec.convert.arch import ARCH_FILE  # noqa: PLC0415

    for root in (a.load, a.pretrained_checkpoint):
        if root is None or not os.path.isdir(root):
            continue
        pointer = os.path.join(root, "latest")
        path = root
        if os.path.isfile(pointer):
            text = open(pointer).read().strip()
            path = os.path.join(root, f"iter_{int(text):07d}") if text.isdigit() else root
        if os.path.isfile(os.path.join(path, ARCH_FILE)):
            return os.path.join(path, ARCH_FILE)
        if root == a.load and os.path.isfile(pointer):
            return None  # resuming a checkpoint without one: the flags' defaults
    return None


def _arch_from_checkpoint(a) -> None:
    """Architecture flags not given (``--norm-epsilon``, ``--rotary-base``,
    ``--moe-router-pre-softmax``) come from the checkpoint this run starts from, so a converted
    Hugging Face model (e.g. Llama's rms_norm_eps 1e-6) trains without restating them."""
    import json  # noqa: PLC0415

    found = source_arch_file(a)
    saved = {}
    if found is not None:
        try:
            with open(found) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise ArgumentError(f"{found}: unreadable ({e})") from None
    for flag, field in _ARCH_FIELDS.items():
        if getattr(a, flag) is None:
            value = saved.get(field, ARCH_DEFAULTS[flag])
            setattr(a, flag, type(ARCH_DEFAULTS[flag])(value))


def default_run_name(a) -> str:
    """A run-dir name from the configuration: spec, strategy, sizes, seed."""
    moe = f"-e{a.num_experts}" if a.num_experts else ""
    layout = "".join(f"-{k}{v}" for k, v in (
        ("tp", a.tensor_model_parallel_size), ("pp", a.pipeline_model_parallel_size),
        ("ep", a.expert_model_parallel_size), ("dp", a.data_parallel_size)) if v > 1)
    return (f"{a.spec}-{a.scalevec.replace('+', '_')}-l{a.num_layers}-h{a.hidden_size}{moe}"
            f"{layout}-s{a.seed}")


def _refuse_other_run(a) -> None:
    """A run dir or --save dir that holds another run is never silently overwritten."""
    if a.overwrite or a.load is not None:
        return
    if os.path.exists(os.path.join(a.run_dir, "metrics.jsonl")):
        resume = (f"--load {a.run_dir} to resume it (with the flags it was trained with), "
                  if os.path.exists(os.path.join(a.run_dir, "latest")) else "")
        raise ArgumentError(f"run dir {a.run_dir!r} holds another run (metrics.jsonl): pass "
                            f"{resume}--overwrite to replace it, or another --run-dir")
    if a.save is not None and os.path.exists(os.path.join(a.save, "latest")):
        raise ArgumentError(f"--save {a.save!r} holds another run's checkpoints: pass --load "
                            f"{a.save} to resume, --overwrite to replace them, or another "
                            f"--save")
