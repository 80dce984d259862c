"""Results cross a layer typed: a function another layer calls says what it returns, and it is not a bare dict.

A layer is a floor of tests/test_architecture.py (vocabulary, producers, settings, store, services, ui, cli) or
the pages.  A function "crosses" when a module of another layer imports it (by name, or through its module:
``from ..store import queries as q`` then ``q.session_runs``), and so do the public methods of the classes
``Store`` is made of.  Its return annotation must be present and must name no ``dict``, ``Mapping`` or ``Any``
(a frozen record, a named tuple, a DataFrame, a figure or a plain value says what the caller gets).

No function does: any that returned a dict across a layer would fail here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_architecture import ALL, PAGES, ROOT, _floor_of

UNTYPED = re.compile(r"\b(dict|Dict|Mapping|MutableMapping|Any)\b")
STORE_CLASS = ("precision_lab.store", "Store")


def _module_of(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = (module if is_pkg else module.rsplit(".", 1)[0]).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Source:
    """Every module of the package and the pages, parsed once: what each defines and imports."""

    def __init__(self, files: list[Path], root: Path):
        self.root = root
        self.trees: dict[str, tuple[ast.Module, bool, Path]] = {}
        for path in files:
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_pkg else parts)
            self.trees[name] = (ast.parse(path.read_text()), is_pkg, path)

    def layer(self, module: str) -> str:
        return _floor_of(module) if module.startswith("precision_lab") else "pages"

    def functions(self, module: str) -> dict[str, ast.FunctionDef]:
        tree = self.trees[module][0]
        return {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def definition(self, module: str, name: str, seen: int = 0):
        """(defining module, function) of ``module.name``, following a package's re-exports."""
        if module not in self.trees or seen > 8:
            return None
        fns = self.functions(module)
        if name in fns:
            return module, fns[name]
        tree, is_pkg, _ = self.trees[module]
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        return self.definition(_resolve(module, is_pkg, node), a.name, seen + 1)
        return None

    def crossings(self):
        """(defining module, function name, calling layer) for every function used from another layer."""
        for module, (tree, is_pkg, _) in self.trees.items():
            here = self.layer(module)
            aliases: dict[str, str] = {}
            named: list[tuple[str, str]] = []
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    target = _resolve(module, is_pkg, node)
                    for a in node.names:
                        if f"{target}.{a.name}" in self.trees:
                            aliases[a.asname or a.name] = f"{target}.{a.name}"
                        else:
                            named.append((target, a.name))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name in self.trees and a.asname:
                            aliases[a.asname] = a.name
            used = list(named)
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                    used.append((aliases[node.value.id], node.attr))
            for target, name in used:
                found = self.definition(target, name)
                if found and self.layer(found[0]) != here:
                    yield found[0], found[1], here
        yield from self._store_methods()

    def _store_methods(self):
        module, name = STORE_CLASS
        if module not in self.trees:
            return
        tree, is_pkg, _ = self.trees[module]
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        if name not in classes:
            return
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_pkg, node)
                for a in node.names:
                    if a.name in bases and target in self.trees:
                        for cls in self.trees[target][0].body:
                            if isinstance(cls, ast.ClassDef) and cls.name == a.name:
                                for fn in cls.body:
                                    if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_"):
                                        yield target, fn, "services"

    def untyped_crossings(self) -> dict[str, str]:
        """``module.function`` -> its return annotation ("" when none) for each crossing that is not typed."""
        out = {}
        for module, fn, _ in self.crossings():
            shown = ast.unparse(fn.returns) if fn.returns is not None else ""
            if not shown or UNTYPED.search(shown):
                out[f"{module}.{fn.name}"] = shown
        return out


def _project() -> Source:
    return Source([p for p, _, _ in ALL] + list(PAGES), ROOT)


def test_no_function_returns_a_dict_across_a_layer():
    untyped = {k: v or "(no annotation)" for k, v in _project().untyped_crossings().items()}
    assert not untyped, f"functions another layer calls return a bare dict or say nothing: {untyped}"


def test_the_check_sees_a_dict_crossing_a_layer(tmp_path):
    pkg = tmp_path / "precision_lab"
    (pkg / "store").mkdir(parents=True)
    (pkg / "services").mkdir()
    for d in (pkg, pkg / "store", pkg / "services"):
        (d / "__init__.py").write_text("")
    (pkg / "store" / "queries.py").write_text(
        "def runs(store) -> list[dict]:\n    return []\n"
        "def count(store) -> int:\n    return 0\n"
        "def rows(store):\n    return []\n"
        "def own(store) -> dict:\n    return {}\n")
    (pkg / "store" / "inside.py").write_text("from .queries import own\n")
    (pkg / "services" / "use.py").write_text(
        "from ..store import queries as q\nfrom ..store.queries import rows\n"
        "def f(s):\n    return q.runs(s), q.count(s), rows(s)\n")
    files = sorted(tmp_path.rglob("*.py"))
    found = Source(files, tmp_path).untyped_crossings()
    assert found == {"precision_lab.store.queries.runs": "list[dict]", "precision_lab.store.queries.rows": ""}
