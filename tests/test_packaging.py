"""Packaging: ranges in setup.py, exact versions in constraints/cpu.txt, and an install into an
environment that already satisfies the ranges (an NGC container, a cluster's venv) replaces
neither torch nor megatron-core. Offline: pip runs with --no-index against what is installed,
so CI's two legs check the two ends (megatron-core 0.16.1 on 3.11, 0.19.2 on 3.12).
Also the environment report ``python -m megatron_scalevec.env``."""

import ast
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_scalevec import env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("torch", "megatron-core")


def install_requires() -> list:
    """The literal ``install_requires`` of setup.py (read, not executed)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no install_requires")


def pins(python: str) -> dict:
    """name -> pinned version in constraints/cpu.txt for a Python version ('3.11')."""
    out = {}
    for line in open(os.path.join(ROOT, "constraints", "cpu.txt")):
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            if r.marker is None or r.marker.evaluate({"python_version": python}):
                (spec,) = r.specifier
                assert spec.operator == "==", line
                out[r.name] = Version(spec.version)
    return out


def ranges() -> dict:
    return {r.name: r.specifier for r in map(Requirement, install_requires())}


def test_ranges_not_pins_and_ci_runs_their_ends():
    spec = ranges()
    for name in CORE:
        ops = {s.operator for s in spec[name]}
        assert "==" not in ops and "===" not in ops, f"{name} pinned: {spec[name]}"
        assert ops & {">=", ">"} and ops & {"<", "<="}, f"{name} needs both bounds"
    for name in ("sentencepiece",):
        assert "==" not in {s.operator for s in spec[name]}
    low, high = pins("3.11"), pins("3.12")
    for p in (low, high):  # every exact version CI installs lies in the stated range
        for name, version in p.items():
            if name in spec:
                assert spec[name].contains(version, prereleases=True), (name, version)
    # megatron-core: leg 1 (3.11) at the lower bound, leg 2 (3.12) on the last release line
    # below the upper bound
    (lower,) = [s for s in spec["megatron-core"] if s.operator == ">="]
    (upper,) = [s for s in spec["megatron-core"] if s.operator == "<"]
    assert low["megatron-core"] == Version(lower.version)
    top = Version(upper.version).release
    assert high["megatron-core"].release[:2] == (top[0], top[1] - 1)
    # torch: CI runs the lower bound's release (the range is NGC's pre-releases of it and up)
    (lower,) = [s for s in spec["torch"] if s.operator == ">="]
    assert low["torch"] == high["torch"] == Version(Version(lower.version).base_version)
    # env.py states the same ranges
    assert {k: str(spec[k]) for k in CORE} == {
        k: str(type(spec[k])(v)) for k, v in env.SUPPORTED.items()}


def _dry_run(tmp_path, requirements: list, python: str = sys.executable):
    """What ``pip install`` would install into ``python``'s environment (offline, no pip
    configuration: only what is installed there counts)."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "--python", python, "install", "--dry-run",
           "--no-index", "--quiet", "--disable-pip-version-check", "--report", str(report),
           *requirements]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**clean, "PIP_CONFIG_FILE": os.devnull})
    if p.returncode:
        return None, p.stderr
    return {i["metadata"]["name"].lower(): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}, p.stderr


def test_install_into_a_satisfying_environment_changes_nothing(tmp_path):
    """What setup.py requires, resolved by pip against this environment (which holds an
    in-range torch and megatron-core, as a GPU container would): nothing to install or
    replace. The exact pins this replaced (torch==2.13.0, megatron-core==0.16.1) would fail
    here against an NGC torch such as 2.13.0a0+<git>."""
    installed = {n: importlib.metadata.version(n) for n in CORE}
    reqs = [r for r in install_requires()
            if Requirement(r).marker is None or Requirement(r).marker.evaluate()]
    changes, err = _dry_run(tmp_path, reqs)
    assert changes == {}, f"pip would install {changes} over {installed}: {err[-2000:]}"
    # the harness notices a requirement this environment does not meet
    changes, _ = _dry_run(tmp_path, [f"megatron-core!={installed['megatron-core']}"])
    assert changes is None or "megatron-core" in changes


def _fake_environment(tmp_path, versions: dict) -> str:
    """A venv whose site-packages hold metadata-only stand-ins of ``versions`` (what pip
    reads to decide whether something installed satisfies a requirement)."""
    venv = tmp_path / "ngc"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    for name, version in versions.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                       f"Version: {version}\n")
        (info / "RECORD").write_text("")
        (info / "INSTALLER").write_text("test\n")
    return str(venv / "bin" / "python")


def test_install_into_an_ngc_like_environment_changes_nothing(tmp_path):
    """An NGC-style environment: torch 2.13.0a0+<git>.nv (a pre-release build) and a
    megatron-core inside the range but at neither CI end. setup.py's requirements leave both
    as they are; the exact pins they replaced (torch==2.13.0, megatron-core==0.16.1) would not."""
    python = _fake_environment(tmp_path, {
        "torch": "2.13.0a0+79aa17489c.nv26.11", "megatron-core": "0.18.2", "numpy": "2.1.0",
        "sentencepiece": "0.2.3", "psutil": "6.0.0"})
    reqs = [r for r in install_requires()
            if Requirement(r).marker is None or Requirement(r).marker.evaluate()]
    changes, err = _dry_run(tmp_path, reqs, python)
    assert changes == {}, err[-2000:]
    for pin in ("torch==2.13.0", "megatron-core==0.16.1"):
        changes, err = _dry_run(tmp_path, [pin], python)  # offline: no candidate to install
        assert changes is None and "No matching distribution" in err, (pin, changes)


def test_ngc_prerelease_torch_is_in_range():
    """An NGC container's torch (a pre-release with a local tag) satisfies the range, so pip
    keeps it; the next minor release does not."""
    spec = ranges()["torch"]
    ngc = Version(f"{pins('3.11')['torch'].base_version}a0+79aa17489c.nv26.11")
    assert spec.contains(ngc, prereleases=True)
    assert not spec.contains(Version("9.0.0"), prereleases=True)


def test_env_report_here():
    """``python -m megatron_scalevec.env`` names what is installed and our paths, exit 0."""
    p = subprocess.run([sys.executable, "-m", "megatron_scalevec.env"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    mcore = importlib.metadata.version("megatron-core")
    import torch

    assert f"megatron-core {mcore} (in the supported range" in out
    assert f"torch {torch.__version__} (in the supported range" in out
    assert "--transformer-impl local: our local linears" in out
    grouped = "local grouped_mm" if env.facts()["grouped_local"] else "refused"
    assert f"experts with --moe-grouped-gemm: {grouped}" in out
    if importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine: not installed" in out
        assert "--transformer-impl transformer_engine: unavailable" in out
    assert "not installed. Falling back" not in p.stderr  # megatron's warnings folded
    assert subprocess.run([sys.executable, "-m", "megatron_scalevec.env", "--bogus"],
                          capture_output=True, cwd=ROOT).returncode == 2


def _facts(**kw):
    base = dict(python="3.12.1", torch="2.13.0a0+abc.nv26.11", torch_cuda="13.0",
                cuda_available=True, devices=["NVIDIA H200"] * 8, megatron_core="0.19.2",
                te="2.12.0", apex=False, megatron_lm=True,
                megatron_lm_checked=["0.16", "0.17", "0.18", "0.19"], linears_local=None,
                linears_transformer_engine=None, grouped_local=True,
                grouped_transformer_engine=True)
    return {**base, **kw}


@pytest.mark.parametrize("case", ["gpu", "no_te_old_torch", "outside"])
def test_env_describe(case):
    if case == "gpu":
        f = _facts()
        text = "\n".join(env.describe(f))
        assert "CUDA build 13.0; 8 device(s): NVIDIA H200" in text
        assert "torch 2.13.0a0+abc.nv26.11 (in the supported range" in text
        assert "Transformer Engine: 2.12.0" in text
        assert "--transformer-impl transformer_engine: TE linears" in text
        assert "experts with --moe-grouped-gemm: TE grouped" in text
        assert env.ok(f)
    elif case == "no_te_old_torch":
        f = _facts(te=None, linears_transformer_engine="ImportError: needs TE",
                   grouped_local=False, grouped_transformer_engine=False)
        text = "\n".join(env.describe(f))
        assert "transformer_engine: unavailable (ImportError: needs TE)" in text
        assert text.count("experts with --moe-grouped-gemm: refused") == 2
        assert "experts without --moe-grouped-gemm: sequential" in text
    else:
        f = _facts(megatron_core="0.20.0", torch="2.12.0")
        text = "\n".join(env.describe(f))
        assert "megatron-core 0.20.0 (OUTSIDE" in text and "torch 2.12.0 (OUTSIDE" in text
        assert "installs nothing" in text and not env.ok(f)


def test_the_wheel_holds_the_product_only(tmp_path):
    """The built wheel ships ``megatron_scalevec`` and nothing test-only: no scalevec_testing
    (TE / Bridge stand-ins, tiny models, gloo ranks), no tests, benchmarks or tools; the CPU
    mode (compat/cpu.py) is part of the product and is in it."""
    import shutil
    import zipfile

    # built from a copy: setuptools writes build/ and the egg-info into the tree it builds, and
    # CI's two legs run this test at the same time (the copy leaves out the dot-directories
    # (.git, the venvs, .te_python) and what a build or a run leaves behind)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=lambda d, names: [
        n for n in names if n.startswith(".") and d == ROOT or n in ("build", "dist", "runs")
        or n.endswith(".egg-info") or n == "__pycache__"])
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path), str(src)], check=True,
                   env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=str(tmp_path),
                   capture_output=True)
    (wheel,) = tmp_path.glob("megatron_scalevec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"megatron_scalevec"}, tops
    assert "megatron_scalevec/compat/cpu.py" in names and "megatron_scalevec/layers/te.py" in names
    assert not [n for n in names if "te_stub" in n or "bridge_shim" in n or "/testing/" in n]
