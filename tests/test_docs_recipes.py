"""README.md and docs/usage.md run as written: every fenced shell and Python block carries a
marker comment just before its fence, ``<!-- recipe: cpu -->`` (run here, as written, in the
order of the page) or ``<!-- recipe: skip KIND: reason -->`` (needs a GPU, Transformer Engine,
Megatron-LM, Megatron-Bridge, or installs packages); an unmarked block fails.

The blocks of one page run in order in one temporary directory (``pretrain_gpt.py`` and
``tools/`` linked in, so ``runs/`` lands there), with ``MEGATRON_SCALEVEC_TINY=1`` (the
documented smaller defaults). Inputs a reader brings are made here when a block names them and
no earlier block made them: ``corpus.jsonl`` (text), ``spm.model`` (the default run's
tokenizer), and for usage.md's Megatron-LM-style source ``ckpt/`` + ``arch.json`` (a
checkpoint of an earlier block without its ``scalevec_arch.json``)."""

import glob
import json
import os
import re
import shutil
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


def _corpus(path):
    """A few hundred documents of English text (the standard library's docstrings)."""
    import email
    import json as json_mod
    import textwrap as tw

    texts = []
    for mod in (json_mod, tw, email, re, shutil, subprocess, glob):
        for name in dir(mod):
            doc = getattr(getattr(mod, name), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                texts.append(doc)
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def _tokenizer(path):
    from megatron_scalevec.training.corpus import DEFAULT_CACHE_DIR

    found = sorted(glob.glob(os.path.join(os.path.expanduser(DEFAULT_CACHE_DIR), "tokenizer",
                                          "*.model")))
    assert found, "no tokenizer of the default run in the cache: an earlier block runs it"
    shutil.copy(found[0], path)


def _megatron_lm_style(cwd):
    """ckpt/ + arch.json: the latest checkpoint of usage.md's runs/b without our arch file
    (and without the manifest that lists it), as Megatron-LM writes its checkpoints."""
    src = os.path.join(cwd, "runs", "b")
    with open(os.path.join(src, "latest")) as f:
        src = os.path.join(src, f"iter_{int(f.read()):07d}")
    shutil.copytree(src, os.path.join(cwd, "ckpt"))
    os.replace(os.path.join(cwd, "ckpt", "scalevec_arch.json"), os.path.join(cwd, "arch.json"))
    os.remove(os.path.join(cwd, "ckpt", "scalevec_manifest.json"))


INPUTS = {"corpus.jsonl": _corpus, "spm.model": _tokenizer}


def _inputs(body: str, cwd: str) -> None:
    for name, make in INPUTS.items():
        if name in body and not os.path.exists(os.path.join(cwd, name)):
            make(os.path.join(cwd, name))
    if "--load ckpt/" in body and not os.path.exists(os.path.join(cwd, "ckpt")):
        _megatron_lm_style(cwd)


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


@pytest.mark.parametrize("doc", DOCS)
def test_recipes_run_as_written(doc, tmp_path):
    os.symlink(os.path.join(ROOT, "pretrain_gpt.py"), tmp_path / "pretrain_gpt.py")
    os.symlink(os.path.join(ROOT, "tools"), tmp_path / "tools")
    ran = 0
    for line, lang, marker, body in blocks(doc):
        if marker != "cpu":
            continue
        _inputs(body, str(tmp_path))
        started = time.time()
        p = run_block(lang, body, str(tmp_path))
        print(f"{doc}:{line}: {time.time() - started:.1f} s")
        assert p.returncode == 0, (
            f"{doc}:{line}: the block exits {p.returncode}:\n{textwrap.indent(body, '  ')}\n"
            f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
        ran += 1
    assert ran >= 4, f"{doc}: only {ran} blocks marked 'recipe: cpu'"
