"""``--help`` that shows every option's default (the trainer's and the tools' parsers).

argparse's ``ArgumentDefaultsHelpFormatter`` skips options without a help text and prints
"(default: None)" / "(default: False)"; this shows the default wherever there is one worth
reading, and leaves help texts that already say what the default is alone.
"""

from __future__ import annotations

import argparse


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Append ``(default: X)`` to every option of ``parser`` whose default is not None/False
    and whose help does not already name a default. Returns the parser."""
    for action in parser._actions:  # argparse's documented-by-use list of options
        default = action.default
        if action.help == argparse.SUPPRESS or default in (None, False, argparse.SUPPRESS):
            continue
        if isinstance(default, bool) and not isinstance(action, argparse.BooleanOptionalAction):
            continue
        text = action.help or ""
        if "default" in text:
            continue
        action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"
    return parser
