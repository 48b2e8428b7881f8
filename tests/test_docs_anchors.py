"""docs/architecture.md points at code by ``file:line`` (the paper's formulas, one place each):
every such anchor names what stands on that line, and the test reads the line, so an edit that
moves the code must move the anchor too."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANCHOR = re.compile(r"`(megatron_scalevec/[\w/]+\.py):(\d+)` \(`([^`]+)`\)")


def anchors(text: str) -> list:
    return ANCHOR.findall(text)


def test_every_code_anchor_names_its_line():
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    found = anchors(text)
    assert len(found) >= 10, found  # the formula table: N(x), HG, DP, fold, DNP, OR, ER, IWD
    with_line = re.findall(r"`megatron_scalevec/[\w/]+\.py:\d+`", text)
    assert len(with_line) == len(found), "a file:line anchor without the name it points at"
    wrong = []
    for path, line, name in found:
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        if int(line) > len(lines) or name not in lines[int(line) - 1]:
            wrong.append(f"{path}:{line} does not hold {name!r}")
    assert not wrong, wrong


def test_the_check_sees_a_moved_line():
    assert anchors("`megatron_scalevec/ops.py:1` (`normalize`)") == [
        ("megatron_scalevec/ops.py", "1", "normalize")]
    text = open(os.path.join(ROOT, "megatron_scalevec", "ops.py")).read().splitlines()
    assert "normalize" not in text[0]  # so an anchor at line 1 would be reported
