"""CPU mode only where a user asks for it: the library, imported and run on CPU in a fresh
process without the CPU layer, leaves torch.cuda and torch.distributed as torch made them.

A subprocess with a clean environment: the pytest process has the layer on (conftest.py) and
the test stand-ins opted in (MEGATRON_SCALEVEC_STANDINS), both of which patch CUDA names."""

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_off_run.py")


def _run_clean() -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "PYTHONPATH": ROOT,  # this tree, not an editable install of another
           "MEGATRON_SCALEVEC_FUSED_COMPILE": "off"}  # compiling costs more than the test
    if "TMPDIR" in os.environ:
        env["TMPDIR"] = os.environ["TMPDIR"]
    done = subprocess.run([sys.executable, SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_library_on_cpu_leaves_torch_untouched():
    if torch.cuda.is_available():  # the layer is a no-op there; nothing to show
        return
    r = _run_clean()
    assert r["changed"] == [], r["changed"]  # torch.cuda.*, dist.all_gather, torch.compile
    assert r["modes"] == [] and not r["cpu_layer_enabled"], r
    assert r["compiled_call_plain"], "compile.py's compiled call enters a hook the layer owns"
    assert r["finite"] and r["losses"][1] < r["losses"][0], r["losses"]
    assert r["linears_local"] is None, r  # env.facts() found our local linears
