"""README.md and docs/usage.md run as written: every fenced shell and Python block carries a
marker comment just before its fence, ``<!-- recipe: cpu -->`` (run here, as written, in the
order of the page) or ``<!-- recipe: skip KIND: reason -->`` (needs a GPU, Transformer Engine,
Megatron-LM, Megatron-Bridge, or installs packages); an unmarked block fails.

As a reader follows them: the README's blocks and then usage.md's, in order, in one fresh
directory (``pretrain_gpt.py`` and ``tools/`` linked in, so ``runs/`` lands there), with
``MEGATRON_SCALEVEC_TINY=1`` (the documented smaller defaults). Nothing is prepared: every
input a block reads (``corpus.jsonl``, ``spm.model``, ``arch.json``, checkpoints) is made by
an earlier block, and the two pages' outputs must not collide (a second run into a run's
directory, a second conversion into an output, is refused)."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ("README.md", "docs/usage.md")
SKIP_KINDS = ("gpu", "te", "megatron-lm", "bridge", "install")
MARKER = re.compile(rf"<!-- recipe: (cpu|skip (?:{'|'.join(SKIP_KINDS)}): \S.*) -->$")
FENCE = re.compile(r"^```(\w*)\s*$")


def blocks(doc: str) -> list:
    """(line, language, marker or None, body) of every fenced block of ``doc``."""
    with open(os.path.join(ROOT, doc)) as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        i += 1
        while not lines[i].startswith("```"):
            i += 1
        before = lines[start - 1].strip() if start else ""
        marker = MARKER.match(before)
        found.append((start + 1, lang, marker.group(1) if marker else before,
                      "\n".join(lines[start + 1:i]) + "\n"))
        i += 1
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_block_says_where_it_runs(doc):
    bad = [f"{doc}:{line} ({lang or 'no language'}): {marker!r}"
           for line, lang, marker, _ in blocks(doc)
           if lang not in ("bash", "python") or not MARKER.match(f"<!-- recipe: {marker} -->")]
    assert not bad, ("blocks without a language (bash/python) or a '<!-- recipe: cpu -->' / "
                     "'<!-- recipe: skip KIND: reason -->' marker line before the fence: "
                     + "; ".join(bad))


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, MEGATRON_SCALEVEC_TINY="1", OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("MEGATRON_SCALEVEC", None)
    return env


def run_block(lang: str, body: str, cwd: str, timeout: float = 600):
    cmd = ["bash", "-e", "-o", "pipefail", "-c", body] if lang == "bash" else \
        [sys.executable, "-c", body]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def reader_dir(tmp_path_factory):
    """The reader's one directory, and the pages whose blocks have run in it, in order."""
    path = tmp_path_factory.mktemp("reader")
    os.symlink(os.path.join(ROOT, "pretrain_gpt.py"), path / "pretrain_gpt.py")
    os.symlink(os.path.join(ROOT, "tools"), path / "tools")
    return path, []


@pytest.mark.parametrize("doc", DOCS)  # in this order: README.md, then docs/usage.md
def test_recipes_run_in_order_in_one_directory(doc, reader_dir):
    """One test per page (each within the per-test time budget), the same directory."""
    cwd, done = reader_dir
    assert done == list(DOCS[:DOCS.index(doc)]), f"{doc} runs after {DOCS[:DOCS.index(doc)]}"
    ran = 0
    for line, lang, marker, body in blocks(doc):
        if marker != "cpu":
            continue
        started = time.time()
        p = run_block(lang, body, str(cwd))
        print(f"{doc}:{line}: {time.time() - started:.1f} s")
        assert p.returncode == 0, (
            f"{doc}:{line}: the block exits {p.returncode}:\n"
            f"{textwrap.indent(body, '  ')}\nstdout:\n{p.stdout[-3000:]}\n"
            f"stderr:\n{p.stderr[-3000:]}")
        ran += 1
    assert ran >= 4, f"{doc}: only {ran} blocks marked 'recipe: cpu'"
    done.append(doc)
