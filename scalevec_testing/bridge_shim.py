"""Import Megatron-Bridge on a machine without Transformer Engine (tests only).

Bridge imports ``transformer_engine`` unguarded at the top of a few modules (LoRA layers, a
TE-only layer spec) that ``import megatron.bridge`` reaches through ``AutoBridge``; 0.3.1's
Mamba provider reaches a megatron-core 0.16 module that imports ``triton`` unguarded, and
0.6.2's bundled Bailing model a transformers module gone from transformers 5.24. A global
fake ``transformer_engine`` in ``sys.modules`` would break megatron-core, which then believes
TE is installed (``HAVE_TE``) and reads its package metadata. So :func:`import_bridge` answers
those imports with inert stand-ins *only for the importing modules listed per Bridge version*
(:data:`TE_IMPORTERS`), through ``builtins.__import__`` while Bridge is being imported, and
puts nothing in ``sys.modules``: megatron-core and every other module still see no TE (and
no triton where none is installed). The stand-ins' classes can be named and subclassed (0.3.1
defines ``TELinearAdapter(te.Linear)``) but raise when instantiated or called, so a TE code
path used by mistake fails loudly.

The list is version-specific (read from Bridge's source); a Bridge version not listed is
refused, naming the versions that are.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.metadata
import sys
import types

__all__ = ["TE_IMPORTERS", "bridge_version", "import_bridge", "te_stand_ins"]

# Bridge version -> {module importing unguarded at top level: the package (or module) it lacks}.
# megatron-core's Mamba inference kernels import triton unguarded; Bridge reaches them through
# its Mamba provider (megatron-core 0.16.1's ssm/mamba_mixer.py -> .../triton/tensor_ops.py).
TE_IMPORTERS = {
    "0.3.1": {
        "megatron.bridge.peft.lora_layers": "transformer_engine",  # import ...pytorch as te
        "megatron.bridge.peft.lora": "transformer_engine",  # import ...pytorch as te
        "megatron.bridge.models.gpt_full_te_layer_autocast_spec": "transformer_engine",
        "megatron.core.inference.contexts.attention_context.triton.tensor_ops": "triton",
    },
    # beside megatron-core 0.19.2 and transformers 5.24 (Bridge 0.6 pins transformers <= 5.12.1,
    # whose attention-mask helpers its bundled Bailing model still imports)
    "0.6.2": {
        "megatron.bridge.peft.lora_layers": "transformer_engine",
        "megatron.bridge.models.gpt_full_te_layer_autocast_spec": "transformer_engine",
        "megatron.bridge.models.bailing.modeling_bailing_moe_v2":
            "transformers.modeling_attn_mask_utils",
    },
}


class StandInUsed(RuntimeError):
    """A Transformer Engine stand-in was used: this code path needs the real TE."""


class _InertMeta(type):
    """Classes whose unknown attributes are further inert classes (``te.ops.Sequential``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _inert(f"{cls.__qualname__}.{name}")


def _refuse(self, *args, **kwargs):
    raise StandInUsed(f"{type(self).__qualname__}: a Transformer Engine stand-in "
                      f"(scalevec_testing.bridge_shim); this needs the real TE")


def _inert(qualname: str) -> type:
    cls = _InertMeta(qualname.rsplit(".", 1)[-1], (), {"__init__": _refuse, "__call__": _refuse})
    cls.__qualname__ = qualname
    return cls


class _StandInModule(types.ModuleType):
    """A module whose every attribute is an inert class (cached, so ``is`` checks agree)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _inert(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _jit(fn=None, **kwargs):
    """``@triton.jit`` / ``@triton.jit(...)``: the kernel becomes an inert class."""
    if fn is None:
        return _jit
    return _inert(f"triton.jit.{getattr(fn, '__qualname__', 'kernel')}")


def te_stand_ins() -> dict:
    """Fresh stand-in modules: ``transformer_engine(.pytorch)``, ``triton(.language)``."""
    te, triton = _StandInModule("transformer_engine"), _StandInModule("triton")
    te.pytorch = _StandInModule("transformer_engine.pytorch")
    triton.language = _StandInModule("triton.language")
    triton.jit = _jit
    masks = "transformers.modeling_attn_mask_utils"  # only ever imported from (fromlist)
    return {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
            "triton": triton, "triton.language": triton.language, masks: _StandInModule(masks)}


def left_in_sys_modules() -> list:
    """Stand-ins or any ``transformer_engine`` module in ``sys.modules`` (must stay empty here:
    TE is not installed where the shim is used; triton may be, with torch's CUDA build)."""
    return sorted(n for n, m in list(sys.modules.items())
                  if isinstance(m, _StandInModule) or n.split(".")[0] == "transformer_engine")


def bridge_version() -> str:
    return importlib.metadata.version("megatron-bridge")


@contextlib.contextmanager
def _answer_te_imports(importers: dict):
    modules = te_stand_ins()
    real = builtins.__import__

    def scoped_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
        importer = (globals or {}).get("__name__")
        missing = importers.get(importer) if level == 0 else None
        if missing and (name == missing or name.startswith(missing + ".")):
            top = name.split(".")[0]
            answer = modules.get(name) if fromlist else modules.get(top)
            if answer is None:
                raise ImportError(f"bridge_shim: no stand-in for {name} (imported by {importer})")
            return answer
        return real(name, globals, locals, fromlist, level)

    builtins.__import__ = scoped_import
    try:
        yield
    finally:
        builtins.__import__ = real


def import_bridge():
    """``megatron.bridge`` imported with the scoped stand-ins (see the module docstring).

    Refuses a Bridge version whose TE importers are not listed. Importing Bridge takes ~20 s
    (it imports every model family); later calls return the imported module.
    """
    from scalevec_testing import OPT_IN, opted_in  # noqa: PLC0415

    if not opted_in():
        raise RuntimeError(f"scalevec_testing.bridge_shim answers Bridge's GPU imports in tests "
                           f"only: set {OPT_IN}=1 to use it (conftest.py does)")
    version = bridge_version()
    if version not in TE_IMPORTERS:
        raise RuntimeError(f"megatron-bridge {version}: bridge_shim knows the Transformer Engine "
                           f"imports of {sorted(TE_IMPORTERS)} only (pin one of them)")
    with _answer_te_imports(TE_IMPORTERS[version]):
        return importlib.import_module("megatron.bridge")


REQUIRE_ENV = "MEGATRON_SCALEVEC_REQUIRE_BRIDGE"

def bridge_or_skip():
    """For a test module: ``megatron.bridge`` imported, or the module skipped with the reason
    (Bridge not installed, or a version this shim does not know). With
    ``MEGATRON_SCALEVEC_REQUIRE_BRIDGE=1`` (CI's Bridge leg) the reason is a failure instead."""
    import os  # noqa: PLC0415

    import pytest  # noqa: PLC0415 -- test-only helper

    try:
        version = bridge_version()
    except importlib.metadata.PackageNotFoundError:
        reason = ("megatron-bridge is not installed (tools/test_deps.sh installs the "
                  "version constraints/cpu.txt pins, --no-deps)")
    else:
        reason = None if version in TE_IMPORTERS else (
            f"megatron-bridge {version} is not one this shim knows ({sorted(TE_IMPORTERS)})")
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            raise RuntimeError(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason, allow_module_level=True)
    return import_bridge()
