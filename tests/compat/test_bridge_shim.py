"""The scoped Megatron-Bridge import shim and our CPU layer, in both import orders.

A fresh interpreter (no conftest) imports Bridge through the shim *before* the CPU layer is
enabled (the order where Bridge's ``safe_import`` placeholders, which raise on any attribute,
sit in ``sys.modules`` when the layer scans megatron modules), then enables it; the tests'
own process covers the other order (conftest enables the layer first). Either way megatron-core
must still see no Transformer Engine and nothing fake may be left in ``sys.modules``.
"""

import os
import subprocess
import sys

import pytest

from scalevec_testing import bridge_shim

bridge_shim.bridge_or_skip()

_BRIDGE_FIRST = """
import sys
from scalevec_testing.bridge_shim import import_bridge
import_bridge()
from megatron.bridge.utils.import_utils import is_unavailable
placeholders = [n for n, m in list(sys.modules.items()) if n.startswith("megatron.bridge") and m
                and any(is_unavailable(v) for v in vars(m).values())]
assert placeholders, "expected Bridge modules holding safe_import placeholders"
from megatron_scalevec.compat.cpu import enable_cpu_compat
assert enable_cpu_compat()
from megatron.core.extensions import transformer_engine as te_ext
assert not te_ext.HAVE_TE
from scalevec_testing.bridge_shim import left_in_sys_modules
assert not left_in_sys_modules(), left_in_sys_modules()
print("OK", len(placeholders))
"""


def test_bridge_imported_before_the_cpu_layer():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")),
         os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _BRIDGE_FIRST], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_cpu_layer_first_then_bridge_sees_no_te():
    """This process: conftest enabled the CPU layer before Bridge was imported."""
    from megatron.bridge.peft import lora_layers
    from megatron.core.extensions import transformer_engine as te_ext

    assert not te_ext.HAVE_TE
    assert not bridge_shim.left_in_sys_modules()
    # Bridge's TE names are inert stand-ins: nameable, subclassable, never usable
    assert type(lora_layers.te).__name__ == "_StandInModule"
    adapter = getattr(lora_layers, "TELinearAdapter", None)  # 0.3.1: class X(te.Linear)
    assert adapter is None or issubclass(adapter, lora_layers.te.Linear)
    with pytest.raises(bridge_shim.StandInUsed, match="needs the real TE"):
        lora_layers.te.Linear(4, 4)


def test_unknown_bridge_versions_are_refused(monkeypatch):
    monkeypatch.setattr(bridge_shim, "bridge_version", lambda: "9.9.9")
    with pytest.raises(RuntimeError, match="9.9.9: bridge_shim knows .*0.3.1"):
        bridge_shim.import_bridge()
