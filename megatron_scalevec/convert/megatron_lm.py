"""What a Megatron-LM save directory holds, read without running code.

Megatron-LM (``pretrain_gpt.py --save DIR``) writes ``DIR/latest_checkpointed_iteration.txt``
(an iteration number, or ``release``) and one folder per save, ``DIR/iter_0000100/`` (or
``DIR/release/``). In its default ``torch_dist`` format that folder is a dist checkpoint
(``metadata.json``, ``*.distcp``) whose common state (``common.pt`` up to megatron-core 0.18,
a ``common_state`` object inside the ``.distcp`` files from 0.19; megatron-core's
``load_common_state_dict`` reads either) holds ``args``, the run's parsed arguments (an
``argparse.Namespace`` of plain values, megatron-core enums and torch dtypes, which
megatron-core allow-lists for ``weights_only`` loading). Those args say everything a
converter needs: :func:`arch_from_args` builds the :class:`ModelArch` (so ``--arch`` is not
needed) and refuses, naming the flag, what the converter's models cannot express; the
strategy our ``--spec`` records there (``args.scalevec``, megatron_lm_strategy.py) says which
of ours it is. The legacy ``torch`` format (``mp_rank_*/model_optim_rng.pt``) is refused with
what to run instead.
"""

from __future__ import annotations

import os
from typing import Optional

from megatron_scalevec.convert.arch import STOCK, ModelArch

TRACKER = "latest_checkpointed_iteration.txt"
ARGS_KEY = "scalevec"  # the attribute our --spec module sets on Megatron-LM's args
SPEC_MODULE = "megatron_scalevec.megatron_lm_spec"


def resolve_save_dir(path: str) -> str:
    """A Megatron-LM ``--save`` directory -> the iteration folder its tracker names; else
    ``path``."""
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        return path
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        found = os.path.join(path, "release")
    elif text.isdigit():
        found = os.path.join(path, f"iter_{int(text):07d}")
    else:
        raise ValueError(f"{tracker}: corrupt tracker {text!r} (an iteration or 'release')")
    if not os.path.isdir(found):
        raise FileNotFoundError(f"{tracker} names {os.path.basename(found)} but {found} is "
                                f"missing")
    return found


def is_megatron_lm_checkpoint(path: str) -> bool:
    """An iteration folder Megatron-LM wrote in ``torch_dist``: a dist checkpoint whose common
    state holds its ``args``."""
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        return False
    try:
        read_args(path)
    except ValueError:
        return False
    return True


def is_legacy_checkpoint(path: str) -> bool:
    """An iteration folder in Megatron-LM's legacy ``torch`` format (``mp_rank_*``)."""
    return os.path.isdir(path) and any(n.startswith("mp_rank_") for n in os.listdir(path))


def legacy_refusal(path: str) -> str:
    return (f"{path} is in Megatron-LM's legacy 'torch' format (mp_rank_*/"
            f"model_optim_rng.pt), which this converter does not read: re-save it as "
            f"torch_dist with Megatron-LM (pretrain_gpt.py --load {os.path.dirname(path)} "
            f"--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR, the same model "
            f"flags) and convert NEW_DIR")


def read_args(path: str) -> dict:
    """``vars(args)`` of the iteration folder ``path`` (weights-only: no code runs)."""
    from megatron.core import dist_checkpointing  # noqa: PLC0415
    from megatron.core.safe_globals import SAFE_GLOBALS  # noqa: PLC0415 (megatron-core's list)

    from megatron_scalevec.convert.safe_load import allowed_globals, no_code_on_load  # noqa: PLC0415

    try:
        with no_code_on_load(), allowed_globals(list(SAFE_GLOBALS)):
            common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:  # noqa: BLE001 -- truncated, refused, or no common state: one line
        raise ValueError(f"{path}: no readable Megatron-LM common state "
                         f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
                         ) from None
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        raise ValueError(f"{path}: its common state holds no 'args' (not written by "
                         f"Megatron-LM's training loop)")
    return dict(vars(args))


def recorded_strategy(args: dict):
    """The ScaleVecConfig our ``--spec`` recorded in ``args``; ``"stock"`` for a run without
    ``--spec``; None for a run of ours that predates the record."""
    from megatron_scalevec.config import ScaleVecConfig  # noqa: PLC0415

    if args.get(ARGS_KEY):
        return ScaleVecConfig.from_dict(args[ARGS_KEY])
    spec = args.get("spec")
    if not spec:
        return STOCK
    if spec[0] == SPEC_MODULE:
        return None
    raise ValueError(f"the run used --spec {' '.join(spec)}, which is neither stock "
                     f"megatron-core nor {SPEC_MODULE}")


# Megatron-LM flags whose models the converter cannot build (ModelArch: rotary, no linear
# biases, one activation of ACTIVATIONS): (args key, predicate, the flag to name)
_REFUSED = (
    ("add_bias_linear", lambda v: v, "linear biases (Megatron-LM's default; the converter "
                                     "handles --disable-bias-linear models)"),
    ("add_qkv_bias", lambda v: v, "--add-qkv-bias"),
    ("position_embedding_type", lambda v: v != "rope",
     "--position-embedding-type other than rope"),
    ("rotary_percent", lambda v: v is not None and v != 1.0, "--rotary-percent below 1"),
    ("layernorm_zero_centered_gamma", lambda v: v, "--apply-layernorm-1p"),
    ("qk_l2_norm", lambda v: v, "--qk-l2-norm"),
    ("multi_latent_attention", lambda v: v, "--multi-latent-attention"),
    ("squared_relu", lambda v: v, "--squared-relu"),
    ("use_rope_scaling", lambda v: v, "--use-rope-scaling"),
    ("mtp_num_layers", lambda v: v, "--mtp-num-layers"),
)


def arch_from_args(args: dict) -> ModelArch:
    """The ModelArch of a Megatron-LM run's args; one ValueError naming what cannot be."""
    bad = [flag for key, refused, flag in _REFUSED if refused(args.get(key))]
    if bad:
        raise ValueError(f"the checkpoint's model uses {'; '.join(bad)}, which the converter "
                         f"cannot build")
    strategy = recorded_strategy(args)
    moe = {}
    if args.get("num_experts"):
        freq = args.get("moe_layer_freq", 1)
        moe = dict(num_moe_experts=args["num_experts"], moe_router_topk=args["moe_router_topk"],
                   moe_ffn_hidden_size=args.get("moe_ffn_hidden_size"),
                   moe_shared_expert_intermediate_size=args.get(
                       "moe_shared_expert_intermediate_size"),
                   moe_router_pre_softmax=bool(args.get("moe_router_pre_softmax")),
                   moe_layer_freq=list(freq) if isinstance(freq, (list, tuple)) else freq)
    if strategy is None:
        raise ValueError("the checkpoint was written with our --spec before runs recorded "
                         "their strategy: pass --arch arch.json (fields: convert/arch.py)")
    ours = {} if strategy == STOCK else dict(
        scalevec=strategy.to_string(), expert_vectors=strategy.expert_vectors,
        layernorm_bias=strategy.layernorm_bias)
    return ModelArch(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        ffn_hidden_size=args["ffn_hidden_size"], vocab_size=args["padded_vocab_size"],
        num_query_groups=args["num_query_groups"] if args.get("group_query_attention")
        else None,
        kv_channels=args.get("kv_channels"),
        max_sequence_length=args["max_position_embeddings"],
        normalization=args["normalization"], layernorm_epsilon=args["layernorm_epsilon"],
        qk_layernorm=bool(args.get("qk_layernorm")), gated_linear_unit=bool(args["swiglu"]),
        activation="silu" if args["swiglu"] else "gelu",
        rotary_base=float(args.get("rotary_base", 10000)),
        tie_embeddings=not args.get("untie_embeddings_and_output_weights", False),
        **moe, **ours)


def strategy_name(strategy) -> str:
    """A recorded strategy (or ``"stock"``) in words, options included."""
    return "stock megatron-core (no --spec)" if strategy == STOCK else strategy.describe()


def strategy_mismatch(recorded, current) -> Optional[str]:
    """None when a checkpoint's recorded strategy equals the run's; else ``"<checkpoint's> in
    the checkpoint, <run's> in this run"``."""
    if recorded == current:
        return None
    return f"{strategy_name(recorded)} in the checkpoint, {strategy_name(current)} in this run"
