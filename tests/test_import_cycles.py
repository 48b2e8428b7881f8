"""No import cycles in the package, counted with function-local imports (tools/import_cycles.py),
and no test file imports another test module, in any directory of the suites (fixtures that
several test files share live in tests/conftest.py, functions in scalevec_testing/, markers
included: scalevec_testing/markers.py).

Each checker is itself tested on a small tree with the import hidden inside a function, so a
checker that skipped function bodies (or relative imports) would fail here, not pass silently.
"""

import ast
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


# ---------------------------------------------------------------- test files import no test module
TEST_DIRS = ("tests", "benchmarks/tests", "evidence/tests")


def _test_files(root: str) -> list:
    """Every test_*.py and conftest.py under the suites' directories (pyproject's testpaths),
    in every subdirectory (tests/layers/, tests/parity/, ...)."""
    found = []
    for top in TEST_DIRS:
        for dirpath, _, names in os.walk(os.path.join(root, top)):
            found += [os.path.join(dirpath, n) for n in names
                      if n == "conftest.py" or (n.startswith("test_") and n.endswith(".py"))]
    return sorted(found)


def imports_of_test_modules(root: str) -> list:
    """``file:line imports name`` for each import (anywhere in the file, function bodies
    included) of a test module -- another test_*.py of the suites, a conftest, or a ``tests``
    package -- in a test file or conftest under ``root``."""
    files = _test_files(root)
    test_modules = {os.path.basename(f)[:-3] for f in files} | {"conftest", "tests"}
    found = []
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # from tests import test_x, from . import x
                base = node.module or ""
                names = [base] + [f"{base}.{a.name}".lstrip(".") for a in node.names]
            else:
                continue
            for name in names:
                if test_modules.intersection(name.split(".")):
                    found.append(f"{os.path.relpath(path, root)}:{node.lineno} imports {name}")
                    break
    return found


def test_no_test_file_imports_another_test_module():
    found = imports_of_test_modules(ROOT)
    assert found == [], ("move what they share to tests/conftest.py (fixtures) or to "
                         "scalevec_testing/ (functions):\n" + "\n".join(found))


def test_checker_sees_every_form_of_test_module_import(tmp_path):
    files = {
        "tests/test_a.py": "import os\nfrom scalevec_testing import models\n",
        "tests/layers/__init__.py": "",
        "tests/layers/test_b.py": "def f():\n    from test_a import X\n",
        "tests/layers/test_k.py": "from megatron_scalevec.layers import fused\n",
        "tests/parity/test_i.py": "from ..layers import test_b\nfrom .. import conftest\n",
        "tests/conftest.py": "import pytest\nfrom tests.layers.test_k import F\n",
        "tests/test_c.py": "class K:\n    def g(self):\n        import tests.test_a\n",
        "tests/test_d.py": "from . import test_a\n",
        "tests/test_e.py": "from conftest import needs_te\n",
        "benchmarks/tests/test_f.py": "from benchmarks.tests.test_g import Y\n",
        "benchmarks/tests/test_g.py": "from benchmarks import overhead\n",
        "evidence/tests/test_h.py": "import test_b as helpers\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert imports_of_test_modules(str(tmp_path)) == [
        "benchmarks/tests/test_f.py:1 imports benchmarks.tests.test_g",
        "evidence/tests/test_h.py:1 imports test_b",
        "tests/conftest.py:2 imports tests.layers.test_k",
        "tests/layers/test_b.py:2 imports test_a",
        "tests/parity/test_i.py:1 imports layers.test_b",
        "tests/parity/test_i.py:2 imports conftest",
        "tests/test_c.py:3 imports tests.test_a",
        "tests/test_d.py:1 imports test_a",
        "tests/test_e.py:1 imports conftest",
    ]


# ---------------------------------------------------------------- the cycle checker itself
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
