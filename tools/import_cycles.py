#!/usr/bin/env python
"""Import cycles inside a package, function-local imports included.

Python hides a cycle when one of its imports sits inside a function: nothing fails on import,
yet the modules still depend on each other. This reads every ``import`` / ``from ... import``
anywhere in each module (module level, functions, classes, ``try`` blocks) with ``ast``, without
importing anything, and reports each strongly connected group of modules as one cycle.

An edge goes to the most specific module named: ``from pkg.sub import name`` is an edge to
``pkg.sub.name`` when that is a module of the package, else to ``pkg.sub``. Parent packages'
``__init__`` files are not counted as imported (that would make every package that re-exports
its submodules a cycle with each of them).

Usage: python tools/import_cycles.py [PACKAGE_DIR ...]   (default: megatron_scalevec)
Prints one line per cycle and the count; exits 1 when there is any cycle.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(package_dir: str) -> dict:
    """Dotted module name -> file path, for every ``.py`` under ``package_dir``."""
    package_dir = os.path.abspath(package_dir)
    base = os.path.dirname(package_dir)
    out = {}
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(root, f)
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_of(module: str, path: str, known: dict) -> set:
    """The modules of ``known`` that ``module`` imports anywhere in its source."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node)
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                     for a in node.names]
        for name in names:
            while name and name not in known:  # `import pkg.sub.attr` -> the module part
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph(package_dirs) -> dict:
    known = {}
    for d in package_dirs:
        known.update(modules(d))
    return {m: imports_of(m, p, known) for m, p in known.items()}


def cycles(edges: dict) -> list:
    """Strongly connected groups of more than one module (Tarjan), each as a closed path."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):  # recursion depth is bounded by the package's module count
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_shortest_cycle(edges, g) for g in sorted(groups)]


def _shortest_cycle(edges: dict, group: list) -> list:
    """One shortest closed path through the group's first module (readable evidence)."""
    start, members = group[0], set(group)
    paths, seen = [[start]], {start}
    while paths:
        nxt = []
        for path in paths:
            for w in sorted(edges[path[-1]] & members):
                if w == start:
                    return path + [start]
                if w not in seen:
                    seen.add(w)
                    nxt.append(path + [w])
        paths = nxt
    return group


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("packages", nargs="*", default=[os.path.join(ROOT, "megatron_scalevec")])
    a = p.parse_args(argv)
    for d in a.packages:
        if not os.path.isfile(os.path.join(d, "__init__.py")):
            print(f"import_cycles: {d} is not a package directory", file=sys.stderr)
            return 2
    found = cycles(graph(a.packages))
    for c in found:
        print(" -> ".join(c))
    names = ", ".join(os.path.basename(os.path.abspath(d)) for d in a.packages)
    print(f"{len(found)} import cycle(s) in {names}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
