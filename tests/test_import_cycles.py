"""No import cycles in the package, counted with function-local imports (tools/import_cycles.py).

The checker itself is tested on a small package with a cycle hidden inside a function, so a
checker that skipped function bodies (or relative imports) would fail here, not pass silently.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "import_cycles", os.path.join(ROOT, "tools", "import_cycles.py"))
ic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ic)


def test_package_has_no_import_cycle():
    found = ic.cycles(ic.graph([os.path.join(ROOT, "megatron_scalevec")]))
    assert found == [], "\n".join(" -> ".join(c) for c in found)


def test_test_support_has_no_import_cycle():
    found = ic.cycles(ic.graph([os.path.join(ROOT, "scalevec_testing")]))
    assert found == [], "\n".join(" -> ".join(c) for c in found)


def test_evidence_tooling_has_no_import_cycle():
    found = ic.cycles(ic.graph([os.path.join(ROOT, "evidence")]))
    assert found == [], "\n".join(" -> ".join(c) for c in found)


def _package(tmp_path, files: dict) -> str:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


def test_checker_sees_function_local_and_relative_imports(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from . import c\n",
        "sub/__init__.py": "",
        "c.py": "class K:\n    def g(self):\n        import pkg.a\n",
        "leaf.py": "import os\nfrom pkg.sub import nothing_here\n",
    })
    edges = ic.graph([pkg])
    assert edges["pkg.b"] == {"pkg.c"} and edges["pkg.c"] == {"pkg.a"}
    assert edges["pkg.leaf"] == {"pkg.sub"}
    assert ic.cycles(edges) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_command_exit_status(tmp_path):
    clean = _package(tmp_path, {"__init__.py": "", "a.py": "import os\n"})
    run = [sys.executable, os.path.join(ROOT, "tools", "import_cycles.py")]
    out = subprocess.run(run + [clean], capture_output=True, text=True)
    assert out.returncode == 0 and "0 import cycle(s) in pkg" in out.stdout
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    import pkg.a\n")
    (tmp_path / "pkg" / "a.py").write_text("import pkg.b\n")
    out = subprocess.run(run + [clean], capture_output=True, text=True)
    assert out.returncode == 1 and "pkg.a -> pkg.b -> pkg.a" in out.stdout
    out = subprocess.run(run + [str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 2 and "not a package directory" in out.stderr
