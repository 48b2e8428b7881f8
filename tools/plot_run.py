"""Plot loss curves of one or several runs, and gamma evolution, to PNG.

    python tools/plot_run.py runs/a runs/b --out loss.png --gamma-out gamma.png
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_scalevec.cli_help import show_defaults  # noqa: E402
from megatron_scalevec.training.plotting import plot_runs  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run dirs (with metrics.jsonl) or .jsonl files")
    p.add_argument("--out", default="loss.png")
    p.add_argument("--gamma-out", default=None, help="also plot conservation / beta")
    a = show_defaults(p).parse_args(argv)
    plot_runs(a.runs, a.out, a.gamma_out)
    print(f"wrote {a.out}" + (f" and {a.gamma_out}" if a.gamma_out else ""))


if __name__ == "__main__":
    main()
