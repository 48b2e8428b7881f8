"""Test-only: Transformer Engine's real Python package on a machine without CUDA.

TE's pure-Python wheel (``transformer-engine``, no extras) holds all of
``transformer_engine.pytorch``; what needs a GPU is its compiled extension
``transformer_engine_torch`` and the core library. CI installs the wheel beside the virtual
environment (:func:`te_python_dir`), so no other test, subprocess or megatron-core import sees
it. :func:`activate`, called inside the TE tests' forked ranks only (never in the pytest
process), puts that directory on ``sys.path`` and a stand-in extension under ``sys.modules``:
the pybind enums TE reads at import, with the member names and values of the pinned release's
``pybind_helper.h`` / ``pybind.cpp`` / C headers, the few functions of
:mod:`scalevec_testing.te_ops`, and a loud NotImplementedError for any other. It
skips the shared-library loading (``NVTE_PROJECT_BUILDING=1`` while ``transformer_engine.common``
imports, and a no-op ``load_framework_extension``), lends stand-ins that raise when used for
TE's triton-kernel and ONNX-export modules (only while triton / onnxscript are absent), and
re-imports megatron-core's TE modules, which decided ``HAVE_TE`` when first imported. TE's
constructors assert ``torch.cuda.is_available()``: :func:`cuda_claimed` answers True only around
construction. Where a real TE with its extension is installed, importing this module warns and
:func:`activate` refuses; a bare TE wheel installed into the environment itself (which would
break every megatron-core import: its ``except ImportError`` guards miss TE's RuntimeError) is
hidden from in-process tests by :func:`hide_unusable_te` (the repository root's conftest.py).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import warnings

import torch

from scalevec_testing import OPT_IN, opted_in

EXTENSION = "transformer_engine_torch"
_STUB_FLAG = "__megatron_scalevec_cpu_stand_in__"


def real_extension_installed() -> bool:
    """A compiled ``transformer_engine_torch`` exists (a real TE install)."""
    mod = sys.modules.get(EXTENSION)
    if mod is not None:
        return not getattr(mod, _STUB_FLAG, False)
    try:
        return importlib.util.find_spec(EXTENSION) is not None
    except (ImportError, ValueError):
        return False


if real_extension_installed():
    warnings.warn("scalevec_testing.te_stub imported where Transformer Engine's compiled "
                  "extension is installed: the CPU stand-in is for tests on machines without "
                  "CUDA and will refuse to activate here", RuntimeWarning, stacklevel=2)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def te_python_dir() -> str:
    """Where CI installs TE's pure-Python wheel for this Python, outside the virtual environment
    (``.ci/run``: ``pip install --no-deps --target``), so that no other test, subprocess or
    megatron-core import ever sees it; ``MEGATRON_SCALEVEC_TE_PYTHON`` overrides."""
    return os.environ.get("MEGATRON_SCALEVEC_TE_PYTHON") or os.path.join(
        ROOT, ".te_python", f"py{sys.version_info[0]}.{sys.version_info[1]}")


def available() -> bool:
    """TE's Python can be activated here (in :func:`te_python_dir` or already importable)."""
    return os.path.isdir(os.path.join(te_python_dir(), "transformer_engine")) or \
        _installed("transformer_engine")


def te_version() -> tuple[int, int]:
    major, minor = importlib.metadata.version("transformer-engine").split(".")[:2]
    return int(major), int(minor)


# ------------------------------------------------------------------ the extension's enums
def _seq(*names, start=0):
    return {n: i for i, n in enumerate(names, start)}


_QKV_LAYOUTS = ("SB3HD SBH3D SBHD_SB2HD SBHD_SBH2D SBHD_SBHD_SBHD BS3HD BSH3D BSHD_BS2HD "
                "BSHD_BSH2D BSHD_BSHD_BSHD T3HD TH3D THD_T2HD THD_TH2D THD_THD_THD SBHD_BSHD_BSHD "
                "BSHD_SBHD_SBHD THD_BSHD_BSHD THD_SBHD_SBHD Paged_KV_BSHD_BSHD_BSHD "
                "Paged_KV_BSHD_SBHD_SBHD Paged_KV_SBHD_BSHD_BSHD Paged_KV_SBHD_SBHD_SBHD "
                "Paged_KV_THD_BSHD_BSHD Paged_KV_THD_SBHD_SBHD").split()
_QKV_FORMATS = "SBHD BSHD THD BSHD_2SBHD SBHD_2BSHD THD_2BSHD THD_2SBHD".split()


def _enums_2_11() -> dict:
    """TE v2.11: common/util/pybind_helper.h and pytorch/csrc/extensions/pybind.cpp (names),
    common/include/transformer_engine/*.h and pytorch/csrc/common.h (values)."""
    nvte = lambda names: {f"NVTE_{n}": v for n, v in names.items()}  # noqa: E731
    return {
        # the bound subset of transformer_engine::DType (kInt16, kInt64, kFloat8E8M0 unbound)
        "DType": dict(kByte=0, kInt32=2, kFloat32=4, kFloat16=5, kBFloat16=6, kFloat8E4M3=7,
                      kFloat8E5M2=8, kFloat4E2M1=10),
        "NVTE_Bias_Type": nvte(_seq("NO_BIAS", "PRE_SCALE_BIAS", "POST_SCALE_BIAS", "ALIBI")),
        "NVTE_Mask_Type": nvte(_seq("NO_MASK", "PADDING_MASK", "CAUSAL_MASK",
                                    "PADDING_CAUSAL_MASK", "CAUSAL_BOTTOM_RIGHT_MASK",
                                    "PADDING_CAUSAL_BOTTOM_RIGHT_MASK")),
        "NVTE_Softmax_Type": nvte(_seq("VANILLA_SOFTMAX", "OFF_BY_ONE_SOFTMAX",
                                       "LEARNABLE_SOFTMAX")),
        "NVTE_QKV_Format": nvte(_seq(*_QKV_FORMATS)),
        "NVTE_QKV_Layout": nvte(_seq(*_QKV_LAYOUTS)),
        "NVTE_Fused_Attn_Backend": dict(NVTE_No_Backend=-1, NVTE_F16_max512_seqlen=0,
                                        NVTE_F16_arbitrary_seqlen=1, NVTE_FP8=2),
        "Float8BlockScaleTensorFormat": dict(GEMM_READY=0, COMPACT=1),
        "CommOverlapType": dict(RS=0, AG=1),
        "CommOverlapAlgo": _seq("BULK_OVERLAP_AG", "BULK_OVERLAP_RS", "SPLIT_PIPELINED_AG_P2P",
                                "SPLIT_PIPELINED_RS", "SPLIT_PIPELINED_RS_P2P", "ATOMIC_GEMM_RS",
                                "ATOMIC_GEMM_AG_P2P", "ATOMIC_GEMM_RS_P2P",
                                "EXTERNAL_BULK_OVERLAP_AG"),
        "FP8FwdTensors": _seq(*(f"GEMM{i}_{t}" for i in (1, 2, 3)
                                for t in ("INPUT", "WEIGHT", "OUTPUT"))),
        "FP8BwdTensors": _seq(*(f"GRAD_{t}{i}" for i in (1, 2, 3) for t in ("OUTPUT", "INPUT"))),
    }


def _enums_2_17() -> dict:
    """TE v2.17.1 (megatron-core 0.19's): 2.11's plus BHSD formats, NOT_SET, the router's map
    format; ``NVTE_F16_max512_seqlen`` gone."""
    enums = _enums_2_11()
    enums["NVTE_QKV_Format"].update(NVTE_BHSD=7, NVTE_QKV_Format_NOT_SET=8)
    enums["NVTE_QKV_Layout"]["NVTE_BHSD_BHSD_BHSD"] = 25
    del enums["NVTE_Fused_Attn_Backend"]["NVTE_F16_max512_seqlen"]
    enums["NVTERoutingMapFormat"] = dict(BYTEMAP=0, BITMAP_U8=1)
    return enums


# (major, minor) -> table; each checked against that tag's sources, no other release guessed
ENUM_TABLES = {(2, 11): _enums_2_11, (2, 17): _enums_2_17}


class _Raising(types.ModuleType):
    """A module whose names not set on it are functions raising NotImplementedError: the
    stand-in extension (its enums and te_ops' torch functions are set) and TE's triton /
    ONNX modules (:class:`_Unavailable`)."""

    _why = "is not implemented by the CPU stand-in (scalevec_testing.te_stub)"

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        where = self.__name__

        def missing(*args, **kwargs):
            raise NotImplementedError(f"{where}.{name} {self._why}")

        missing.__name__ = name
        return missing


def make_extension(version: tuple[int, int]) -> types.ModuleType:
    if version not in ENUM_TABLES:
        raise RuntimeError(f"te_stub: no enum table for Transformer Engine {version[0]}."
                           f"{version[1]} (have {sorted(ENUM_TABLES)}); read it from that "
                           "release's pybind sources before testing against it")
    from scalevec_testing import te_ops  # noqa: PLC0415

    mod = _Raising(EXTENSION, "CPU stand-in for Transformer Engine's compiled extension")
    setattr(mod, _STUB_FLAG, True)
    for name, members in ENUM_TABLES[version]().items():
        setattr(mod, name, enum.IntEnum(name, members))
    te_ops.install(mod)
    return mod


# ------------------------------------------------------------------ TE's triton and ONNX modules
class _Unavailable(_Raising):
    """One of TE's triton-kernel or ONNX-export modules, not executed (triton / onnxscript are
    not installed here): each name it would define raises when used."""

    _why = "is not run on this CPU test machine (TE's triton / ONNX module)"


_OPTIONAL = {"transformer_engine.common.triton.": "triton",
             "transformer_engine.pytorch.triton.": "triton",
             "transformer_engine.pytorch.onnx_extensions": "onnxscript"}


class _OptionalFinder:
    """Meta-path finder lending :class:`_Unavailable` for TE modules that import an absent
    triton / onnxscript (installed for TE's import only, then removed)."""

    def find_spec(self, name, path=None, target=None):
        for prefix, package in _OPTIONAL.items():
            if name.startswith(prefix) and not _installed(package):
                return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return _Unavailable(spec.name)

    def exec_module(self, module):
        pass


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _lend_absent_packages():
    finder = _OptionalFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


# ------------------------------------------------------------------ activation
_MEGATRON_TE_MODULES = ("megatron.core.extensions.transformer_engine",  # in this order
                        "megatron.core.fp8_utils",
                        "megatron.core.extensions.transformer_engine_spec_provider",
                        "megatron.core.models.backends",
                        "megatron.core.models.gpt.gpt_layer_specs",
                        "megatron.core.models.gpt.moe_module_specs")
_state: dict = {}


def activate() -> types.ModuleType:
    """Import the real ``transformer_engine.pytorch`` over the stand-in extension (idempotent);
    returns it. Test processes only."""
    if _state:
        return _state["te"]
    if not opted_in():
        raise RuntimeError(f"scalevec_testing.te_stub stands in for TE's GPU kernels in tests "
                           f"only: set {OPT_IN}=1 to use it (conftest.py does)")
    if real_extension_installed():
        raise RuntimeError("te_stub.activate(): a real Transformer Engine extension is installed;"
                           " test against it instead of the CPU stand-in")
    if torch.cuda.is_available():
        raise RuntimeError("te_stub.activate(): CUDA is available; use a real TE there")
    if not available():
        raise RuntimeError(f"te_stub.activate(): no Transformer Engine Python in {te_python_dir()}"
                           " (.ci/run installs it there) nor on sys.path")
    if os.path.isdir(te_python_dir()) and te_python_dir() not in sys.path:
        sys.path.append(te_python_dir())
        importlib.invalidate_caches()
    for name in [n for n in sys.modules if n == "transformer_engine" or
                 n.startswith("transformer_engine.")]:
        sys.modules.pop(name)  # None (hide_unusable_te) or a half import
    sys.modules[EXTENSION] = make_extension(te_version())
    saved = os.environ.get("NVTE_PROJECT_BUILDING")
    os.environ["NVTE_PROJECT_BUILDING"] = "1"  # transformer_engine.common: load no library
    try:
        with _lend_absent_packages(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            common = importlib.import_module("transformer_engine.common")
            common.load_framework_extension = lambda framework: None
            for name in [n for n in sys.modules if n.startswith("transformer_engine.pytorch")]:
                sys.modules.pop(name)  # the package __init__'s failed first try
            te = importlib.import_module("transformer_engine.pytorch")
            sys.modules["transformer_engine"].pytorch = te
    finally:
        if saved is None:
            os.environ.pop("NVTE_PROJECT_BUILDING", None)
        else:
            os.environ["NVTE_PROJECT_BUILDING"] = saved
    # TE's cached empty tensor is ``torch.Tensor().cuda()``: made once here, on this thread,
    # under compat/cpu.py's device mode (autograd's backward thread has no mode to map it)
    importlib.import_module("transformer_engine.pytorch.utils")._empty_tensor()
    # Two of TE's backward steps allocate on device="cuda" on autograd's thread, where
    # compat/cpu.py's device mode is not entered: the fused-accumulation placeholder wgrad
    # (``get_dummy_wgrad``, imported by name by TE's modules) and _GroupedLinear's bias
    # gradients. Both run under that mode (private names, checked on 2.11.0 and 2.17.1).
    from megatron_scalevec.compat.cpu import in_device_mode  # noqa: PLC0415

    dummy = in_device_mode(importlib.import_module(
        "transformer_engine.pytorch.module.base").get_dummy_wgrad)
    for name in [n for n in sys.modules if n.startswith("transformer_engine.pytorch.module")]:
        if hasattr(sys.modules[name], "get_dummy_wgrad"):
            sys.modules[name].get_dummy_wgrad = dummy
    grouped = importlib.import_module("transformer_engine.pytorch.module.grouped_linear")
    grouped._GroupedLinear.backward = staticmethod(
        in_device_mode(grouped._GroupedLinear.backward))
    # ... and so do the dense modules' backward under sequence parallelism (the FP8 all-gather
    # of the output gradient allocates its buffer there)
    for mod, cls in (("linear", "_Linear"), ("layernorm_linear", "_LayerNormLinear")):
        fn = getattr(importlib.import_module(f"transformer_engine.pytorch.module.{mod}"), cls)
        fn.backward = staticmethod(in_device_mode(fn.backward))
    # A recompute's re-forward (megatron-core's checkpoints, TE's) runs TE's forward on
    # autograd's thread, where cuda_claimed()'s thread-local mode is not entered: there too
    # (names checked on megatron-core 0.16.1 / 0.19.2, TE 2.11.0 / 2.17.1)
    mrandom = importlib.import_module("megatron.core.tensor_parallel.random")
    te_dist = importlib.import_module("transformer_engine.pytorch.distributed")
    # (megatron-core's already run under compat/cpu.py's device mode there; TE's now too)
    for holder, name, static in ((mrandom.CheckpointFunction, "backward", True),
                                 (mrandom.CheckpointWithoutOutputFunction, "backward", True),
                                 (mrandom.CheckpointWithoutOutput, "_recompute", False),
                                 (te_dist._CheckpointFunction, "backward", True)):
        fn = _claimed_on_any_thread(vars(holder)[name].__func__ if static else
                                    vars(holder)[name])
        if holder is te_dist._CheckpointFunction:
            fn = in_device_mode(fn)
        setattr(holder, name, staticmethod(fn) if static else fn)
    # TE's checkpoint saves and restores the CUDA RNG state itself: the CPU generator's here,
    # as compat/cpu.py does for megatron-core's (private names, TE 2.11.0 and 2.17.1)
    te_dist._get_cuda_rng_state = lambda *args, **kwargs: torch.default_generator.get_state()
    te_dist._set_cuda_rng_state = lambda state, *args, **kwargs: \
        torch.default_generator.set_state(state)
    # megatron-core caches TE's version on first ask (0.0.0 while TE was hidden, e.g. after a
    # Megatron-Bridge import asked): forget it. Private ``megatron.core.utils._te_version``,
    # checked on megatron-core 0.16.1 and 0.19.2.
    mcore_utils = importlib.import_module("megatron.core.utils")
    if hasattr(mcore_utils, "_te_version"):
        mcore_utils._te_version = None
    for name in _MEGATRON_TE_MODULES:  # they decided HAVE_TE when first imported
        old = sys.modules.pop(name, None)
        if old is not None:
            _rebind(old, importlib.import_module(name))
    # megatron-core's experts module took TE's FP8 padding modules (or not) when first imported
    # (private module-level names, megatron-core 0.16.1 and 0.19.2)
    # megatron-core took TE's checkpoint (FP8 full recompute) the same way: 0.16.1's block,
    # 0.19's recompute module
    for name in ("megatron.core.transformer.transformer_block", "megatron.core.recompute"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "te_checkpoint", 0) is None:
            mod.te_checkpoint = sys.modules["megatron.core.extensions.transformer_engine"] \
                .te_checkpoint
    experts = sys.modules.get("megatron.core.transformer.moe.experts")
    if experts is not None and not experts.HAVE_TE:
        ext = sys.modules["megatron.core.extensions.transformer_engine"]
        experts.Fp8Padding, experts.Fp8Unpadding = ext.Fp8Padding, ext.Fp8Unpadding
        experts.HAVE_TE = True
    from megatron_scalevec.layers import te as ours  # noqa: PLC0415

    ours.HAVE_TE = True  # layers/te_classes.py, which needs TE, can be imported from now on
    _state["te"] = te
    return te


def _rebind(old: types.ModuleType, new: types.ModuleType) -> None:
    """Modules that imported a function or class by name from a re-imported megatron-core module
    (e.g. ``transformer_block``'s ``get_fp8_context``) get the new module's, which sees TE."""
    defined = {k: v for k, v in vars(old).items()
               if getattr(v, "__module__", None) == old.__name__ and hasattr(new, k)}
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("megatron.") and m]:
        for key, value in defined.items():
            if vars(mod).get(key) is value:
                setattr(mod, key, getattr(new, key))


class _CudaTensors(torch.overrides.TorchFunctionMode):
    """``tensor.is_cuda`` answers True (TE's forward asserts it of its input)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is torch.Tensor.is_cuda:  # the property's getter
            return True
        return func(*args, **(kwargs or {}))


def _claimed_on_any_thread(fn):
    """``fn`` under :class:`_CudaTensors` while :func:`cuda_claimed` is on, whichever thread
    runs it."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _state.get("claimed"):
            return fn(*args, **kwargs)
        with _CudaTensors():
            return fn(*args, **kwargs)

    return run


# what TE's constructors and forward ask of torch.cuda (a CPU build cannot answer otherwise)
_DEVICE = types.SimpleNamespace(name="CPU stand-in", major=9, minor=0, multi_processor_count=1,
                                total_memory=0)
_CLAIMED = {"is_available": lambda: True, "is_current_stream_capturing": lambda: False,
            "get_device_properties": lambda *args, **kwargs: _DEVICE}


@contextlib.contextmanager
def cuda_claimed():
    """``torch.cuda.is_available()`` answers True inside (TE's module constructors and forward
    assert it), and no CUDA graph is being captured."""
    if not _state:
        raise RuntimeError("te_stub.cuda_claimed() outside an activated stand-in")
    saved = {name: getattr(torch.cuda, name) for name in _CLAIMED}
    saved_version = torch.version.cuda
    for name, value in _CLAIMED.items():
        setattr(torch.cuda, name, value)
    torch.version.cuda = "12.9"  # TE's FP8 support check reads it (None on a CPU build)
    _state["claimed"] = _state.get("claimed", 0) + 1
    try:
        with _CudaTensors():
            yield
    finally:
        _state["claimed"] -= 1
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        torch.version.cuda = saved_version


def hide_unusable_te() -> bool:
    """TE's wheel without its extension raises RuntimeError on import, which megatron-core's
    ``except ImportError`` guards let through: make it absent (ImportError) instead. Returns
    whether it hid it. Called by the repository root's conftest.py; :func:`activate` lifts it."""
    if real_extension_installed() or "transformer_engine" in sys.modules:
        return False
    present = _installed("transformer_engine")
    if present:
        sys.modules["transformer_engine"] = None
    return present
