"""Convert checkpoints between megatron-core, scale-vector variants and Hugging Face.

Examples::

    # stock / shared megatron-core dist checkpoint -> unified (warm start, function-preserving
    # except DNP's new norms, which need --allow-function-change)
    python tools/convert_checkpoint.py --load ckpt/ --arch arch.json --to hg+dp+or --save out/
    python tools/convert_checkpoint.py --load ckpt/ --to unified --allow-function-change \
        --save out/ --format dist
    # any variant without DNP on V/gate/up -> stock megatron-core (exact fold)
    python tools/convert_checkpoint.py --load trained/ --to stock --save stock/ --format dist
    # -> Hugging Face (LlamaForCausalLM, or Qwen3ForCausalLM with QK norms)
    python tools/convert_checkpoint.py --load trained/ --to hf --save hf_out/ --dtype bf16
    # Hugging Face Llama/Qwen3 -> any variant
    python tools/convert_checkpoint.py --load hf_in/ --to hg+dp+or --save ours/

``--load`` takes our full format, a dist checkpoint saved at any TP/PP (its
``scalevec_arch.json`` or ``--arch``), the trainer's ``--save`` directory (its latest
``iter_N``) or one ``iter_N`` of it, or a Hugging Face directory. ``--to hf`` writes a stock
architecture where one fits, else (DNP) our own modeling file for ``trust_remote_code``, and
ships the tokenizer; the reported difference is measured on the export loaded back. Outputs
are written to a temporary directory and renamed at the end; a failed conversion leaves
nothing behind.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from megatron_scalevec.cli_help import show_defaults


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", required=True, help="source checkpoint directory")
    ap.add_argument("--save", required=True, help="output directory (must not exist)")
    ap.add_argument("--to", required=True,
                    help="'stock' (fold), 'hf' (Hugging Face) or a strategy, e.g. unified, "
                         "hg+dp+or, shared, none")
    ap.add_argument("--arch", help="ModelArch JSON for checkpoints without scalevec_arch.json")
    ap.add_argument("--format", default="full", choices=["full", "dist"],
                    help="output format for our checkpoints (dist = dist_checkpointing)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="tensor dtype of a Hugging Face export")
    ap.add_argument("--allow-function-change", action="store_true",
                    help="allow a target with DNP (new normalizations change the outputs)")
    ap.add_argument("--tokenizer-model",
                    help="SentencePiece model to ship with the output (default: the source's "
                         "tokenizer.model, which the trainer stores in its checkpoints)")
    ap.add_argument("--no-verify-checkpoint", action="store_true",
                    help="check only the sizes in the source's checksum manifest, not the "
                         "SHA-256 of every file (very large checkpoints)")
    ap.add_argument("--overwrite", action="store_true")
    args = show_defaults(ap).parse_args(argv)

    with warnings.catch_warnings():
        # megatron-core's "Transformer Engine / Apex not installed" at import (the converter
        # runs its local layers on CPU and never uses either) and the CUDA-graph scope
        # deprecation every TransformerConfig raises about its own default (0.16.1).
        warnings.filterwarnings("ignore", message=_MISSING_BACKEND)
        warnings.filterwarnings("ignore", message="full scope is deprecated",
                                category=UserWarning)
        # torch's deprecations inside megatron-core's dist-checkpoint load (load_state_dict,
        # ShardedTensor): library internals, not the user's to act on
        warnings.filterwarnings("ignore", category=FutureWarning)
        # ...and torch >= 2.12's notes from the same load (argument order, single process)
        warnings.filterwarnings("ignore", category=UserWarning,
                                module=r"torch\.distributed\.checkpoint\.")
        try:
            report = _run(args)
        except ImportError as e:
            print(f"convert_checkpoint: missing dependency: {e}", file=sys.stderr)
            return 2
        except (ValueError, FileExistsError, FileNotFoundError) as e:
            print(f"convert_checkpoint: refused: {e}", file=sys.stderr)  # nothing was written
            return 2
    sys.stderr.flush()  # a progress bar's last state never shares the report's line
    print(json.dumps(report, indent=2))
    return 0


_MISSING_BACKEND = r".*(Transformer Engine|Apex).* not installed"


def _run(args) -> dict:
    from megatron_scalevec.compat.cpu import enable_cpu_compat

    enable_cpu_compat()
    import torch

    from megatron_scalevec.convert.api import convert
    from megatron_scalevec.convert.arch import ModelArch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    arch = ModelArch.load(args.arch) if args.arch else None
    return convert(args.load, args.save, args.to, arch=arch, fmt=args.format,
                   allow_function_change=args.allow_function_change,
                   overwrite=args.overwrite, dtype=dtype, tokenizer=args.tokenizer_model,
                   verify=not args.no_verify_checkpoint)
