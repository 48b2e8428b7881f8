"""``python -m megatron_scalevec.convert.write_arch SOURCE OUT.json``: the ModelArch of one of
our checkpoints (a trainer ``--save`` dir, one ``iter_N``, converter output) written to
``OUT.json``, the file the converter's ``--arch`` reads for a checkpoint without its own."""

from __future__ import annotations

import os
import sys

from megatron_scalevec.convert.arch import ARCH_FILE, ModelArch
from megatron_scalevec.convert.io import resolve_checkpoint


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 2 or any(a.startswith("-") for a in args):
        print("usage: python -m megatron_scalevec.convert.write_arch SOURCE OUT.json",
              file=sys.stderr)
        return 2
    src, out = args
    try:
        arch = ModelArch.load(os.path.join(resolve_checkpoint(src), ARCH_FILE))
        with open(out, "x") as f:  # an existing file is refused, never replaced
            f.write(arch.to_json() + "\n")
    except (OSError, ValueError) as e:
        print(f"write_arch: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} (the model of {src})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
