"""tools/gpu_check.sh, the one prepared device run, on CPU: the whole script with its GPU flags
shrunk (``GPU_CHECK_DEVICE=cpu``) completes with every part passing; a failing part is recorded
and the rest still runs; the device run's timeouts fit its budget (about 300 s)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
PARTS = ["install", "dense", "fp8_gemm", "moe", "grouped"]


def _run(tmp_path, path_first: str) -> tuple:
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu", OUT=str(tmp_path / "out"),
               PATH=os.pathsep.join([path_first, os.environ.get("PATH", "")]))
    p = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=900,
                       cwd=ROOT)
    codes = {}
    for line in (tmp_path / "out" / "exit_codes.txt").read_text().splitlines():
        name, code, _ = line.split()
        codes[name] = int(code)
    return p, codes


def _python3_dir(tmp_path, fail_on: str = "") -> str:
    """A directory whose ``python3`` is this interpreter, failing (exit 3) for commands that
    name ``fail_on``."""
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "python3"
    check = f'case "$*" in *{fail_on}*) echo broken >&2; exit 3;; esac\n' if fail_on else ""
    exe.write_text(f"#!/usr/bin/env bash\n{check}exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return str(d)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="one CI leg: the device's Python (3.12)")
def test_gpu_check_completes_on_cpu_with_its_flags_shrunk(tmp_path):
    """Every part exits 0 (the stand-in GEMM equals _scaled_mm on CPU); the dense table has
    stock, shared, unified and the null row with their total peak memory; the FP8 GEMM table
    has fast accumulation off and on; without TE its part says so in one line."""
    p, codes = _run(tmp_path, _python3_dir(tmp_path))
    assert p.returncode == 0 and codes == dict.fromkeys(PARTS, 0), (codes, p.stdout[-3000:])
    dense = (tmp_path / "out" / "dense.txt").read_text()
    for row in ("| stock ", "| shared ", "| unified ", "| shared#null "):
        assert row in dense, dense[-2000:]
    gemm = (tmp_path / "out" / "fp8_gemm.txt").read_text()
    assert "| False |" in gemm and "| True |" in gemm, gemm
    assert (tmp_path / "out" / "te_skipped.txt").exists()


def test_a_failing_part_is_recorded_and_the_rest_still_runs(tmp_path):
    """With the benchmark command broken (python3 exits 3 for it), its two parts record exit
    3 and the other parts still run and pass; the script itself ends normally."""
    p, codes = _run(tmp_path, _python3_dir(tmp_path, fail_on="bench_overhead"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert codes == dict(install=0, dense=3, fp8_gemm=0, moe=3, grouped=0), codes


def test_the_device_run_fits_its_budget():
    """On the device: the install and the four parts' timeouts add to at most 300 s, so a
    machine's start and a rerun fit the 15 device minutes; no `set -e` stops the script."""
    text = open(SCRIPT).read()
    times = re.search(r'if \[ "\$DEVICE" = cuda \]; then.*?TIMES=\(([\d ]+)\)', text, re.S)
    install = int(re.search(r"part install (\d+)", text).group(1))
    assert install + sum(int(t) for t in times.group(1).split()) <= 300
    assert not re.search(r"^set -[a-z]*e", text, re.M)
