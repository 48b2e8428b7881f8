"""What this environment has, and which of our code paths a run will take.

    python -m megatron_scalevec.env        (or: megatron-scalevec-env)

Prints megatron-core, torch (CUDA build, devices), Transformer Engine, apex and Megatron-LM as
found, whether each lies in the range this package supports, and per ``--transformer-impl``
which linears and which grouped experts (``--moe-grouped-gemm``) the specs will build: our local
linears or TE's, torch's grouped_mm or TE's GroupedLinear, or a refusal naming what is missing
(sequential experts always work). The path decisions are the specs' own functions, not a copy.
Exit 0 when the required packages are in range, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
import warnings

# setup.py's install_requires for these two (tests/test_packaging.py checks they agree)
SUPPORTED = {"torch": ">=2.13.0a0,<2.14", "megatron-core": ">=0.16.1,<0.20"}


def _version(*dists) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _in_range(version: str | None, spec: str) -> bool | None:
    if version is None:
        return None
    try:
        from packaging.specifiers import SpecifierSet  # noqa: PLC0415 (pip's own dependency)
        from packaging.version import Version  # noqa: PLC0415
    except ImportError:
        return None
    return SpecifierSet(spec, prereleases=True).contains(Version(version))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def facts() -> dict:
    """Versions and capabilities found here (imports torch, megatron-core and our specs; on
    CPU with or without the CPU layer, which :func:`main` enables, a library function never)."""
    import torch  # noqa: PLC0415

    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "devices": [], "megatron_core": _version("megatron-core", "megatron_core"),
           "te": _version("transformer-engine", "transformer_engine",
                          "transformer-engine-torch", "transformer_engine_torch"),
           "apex": importlib.util.find_spec("apex") is not None,
           "megatron_lm": importlib.util.find_spec("megatron.training") is not None}
    if out["cuda_available"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    with _backend_notes_quiet():
        from megatron_scalevec import megatron_lm, specs  # noqa: PLC0415
        from megatron_scalevec.layers.parts import linear_modules  # noqa: PLC0415

    out["megatron_lm_checked"] = sorted(megatron_lm.MEGATRON_LM_TAGS)
    for impl in ("local", "transformer_engine"):
        try:
            linear_modules(impl)
            out[f"linears_{impl}"] = None
        except Exception as e:  # noqa: BLE001 -- reported, not raised: this is a diagnosis
            out[f"linears_{impl}"] = _first_line(e)
        out[f"grouped_{impl}"] = specs.grouped_gemm_available(impl)
    return out


@contextlib.contextmanager
def _backend_notes_quiet():
    """megatron-core's "Transformer Engine / Apex not installed" at import: the report says so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
        yield


def describe(f: dict) -> list:
    """The report's lines from :func:`facts` (pure, so tests can feed any environment)."""
    def found(name, version, key):
        if version is None:
            return f"{name}: not installed"
        ok = _in_range(version, SUPPORTED[key])
        verdict = {True: "in", False: "OUTSIDE", None: "unchecked against"}[ok]
        return f"{name} {version} ({verdict} the supported range {SUPPORTED[key]})"

    cuda = (f"CUDA build {f['torch_cuda']}" if f["torch_cuda"] else "CPU-only build")
    devices = (f"{len(f['devices'])} device(s): {', '.join(sorted(set(f['devices'])))}"
               if f["devices"] else "no CUDA device visible")
    line = ".".join((f["megatron_core"] or "").split(".")[:2])
    lm = ("importable" if f["megatron_lm"] else "not importable (needed only for "
          "pretrain_gpt.py --spec megatron_scalevec.megatron_lm_spec ...)")
    checked = "yes" if line in f["megatron_lm_checked"] else "no: it warns and installs nothing"
    lines = [f"python {f['python']}",
             found("megatron-core", f["megatron_core"], "megatron-core"),
             found("torch", f["torch"], "torch") + f"; {cuda}; {devices}",
             f"Transformer Engine: {f['te'] or 'not installed'}",
             f"apex: {'installed' if f['apex'] else 'not installed'}",
             f"Megatron-LM (megatron.training): {lm}; our installer checked on megatron-core "
             f"{', '.join(f['megatron_lm_checked'])}: {checked}",
             "paths our specs will build:"]
    for impl, linears, grouped in (
            ("local", "our local linears (megatron-core's, vectors on our subclasses)",
             "local grouped_mm (torch), vectors folded"),
            ("transformer_engine", "TE linears (vectors folded into TE's weights)",
             "TE grouped (GroupedLinear), vectors folded")):
        err = f[f"linears_{impl}"]
        lines.append(f"  --transformer-impl {impl}: "
                     + (linears if err is None else f"unavailable ({err})"))
        lines.append("      experts with --moe-grouped-gemm: "
                     + (grouped if f[f"grouped_{impl}"] else "refused (needs "
                        + ("Transformer Engine" if impl != "local"
                           else "torch.nn.functional.grouped_mm") + ")"))
    lines.append("      experts without --moe-grouped-gemm: sequential (one MLP per expert)")
    return lines


def ok(f: dict) -> bool:
    return all(_in_range(f[k], SUPPORTED[d]) is not False and f[k] is not None
               for k, d in (("torch", "torch"), ("megatron_core", "megatron-core")))


def main(argv=None) -> int:
    if argv:
        print("usage: python -m megatron_scalevec.env   (no arguments)", file=sys.stderr)
        return 2
    from megatron_scalevec.compat.cpu import enable_cpu_compat  # noqa: PLC0415

    with _backend_notes_quiet():
        enable_cpu_compat()  # a no-op with CUDA; on CPU megatron-core imports fast with it
    f = facts()
    print("\n".join(describe(f)))
    return 0 if ok(f) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
