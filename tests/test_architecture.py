"""The layering in docs/architecture.md, checked on the source.

Imports point down only; SQL lives in ``precision_lab/store``; project
imports sit at module top (a handful of deliberate exceptions, each with a
reason in a comment).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "precision_lab"

# lower number = lower floor; a module may import its own floor or below
FLOORS = {
    "vocabulary": 0,  # formats, records, stats, metrics and the other plain modules at the package top
    "producers": 1,   # live, readers, fixes
    "settings": 2,    # config, scratch (settings name the producers' limits)
    "store": 3,
    "services": 4,
    "ui": 5,         # view-models and renderers of a session (dashboard, HTML report)
    "cli": 6,        # the command line: services, and ui's renderers for --html
}
PRODUCERS = ("live", "readers", "fixes")
SETTINGS = ("config", "scratch")
MAX_DEFERRED_PROJECT_IMPORTS = 10
# SQL keywords as the project writes them (upper case), so prose such as "select a row from" is not SQL
SQL = re.compile(r"\b(SELECT\b[\s\S]{0,4000}?\bFROM|INSERT\s+INTO|DELETE\s+FROM|CREATE\s+TABLE|UPDATE\s+\w+\s+SET)\b")


def _floor_of(module: str) -> str:
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else ""
    if head in PRODUCERS:
        return "producers"
    if head in SETTINGS:
        return "settings"
    if head in ("store", "services", "ui", "cli"):
        return head
    return "vocabulary"


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield path, ".".join(parts), is_pkg


def _imports(path: Path, module: str, is_pkg: bool):
    """(line, imported module, inside a function?) for every precision_lab import of a file."""
    tree = ast.parse(path.read_text())
    package = module if is_pkg else module.rsplit(".", 1)[0]
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("precision_lab"):
                continue
            targets = [target]
            if node.module is None or target == "precision_lab":
                targets = [f"{target}.{a.name}" for a in node.names]
            else:  # ``from ..store import queries``: a submodule imported by name is that submodule
                where = ROOT.joinpath(*target.split("."))
                targets += [f"{target}.{a.name}" for a in node.names
                            if (where / f"{a.name}.py").exists() or (where / a.name / "__init__.py").exists()]
            for t in targets:
                yield node.lineno, t, id(node) in in_function
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("precision_lab"):
                    yield node.lineno, a.name, id(node) in in_function


ALL = list(_modules())


def test_the_checker_sees_the_package(tmp_path):
    names = {m for _, m, _ in ALL}
    assert {"precision_lab.store.queries", "precision_lab.services.ingest", "precision_lab.fixes.rules",
            "precision_lab.live.recorder", "precision_lab.readers.base"} <= names
    assert _floor_of("precision_lab.live.recorder") == "producers"
    assert _floor_of("precision_lab.formats") == "vocabulary"
    # the checker resolves relative imports and sees ones inside functions
    probe = tmp_path / "probe.py"
    probe.write_text("from ..services.ingest import ingest\ndef f():\n    from . import engine\n")
    got = list(_imports(probe, "precision_lab.live.x", False))
    assert [(t, inside) for _, t, inside in got] == [("precision_lab.services.ingest", False),
                                                     ("precision_lab.live.engine", True)]
    assert SQL.search("SELECT a\n FROM t") and SQL.search("INSERT INTO x") and not SQL.search("select a row from")


@pytest.mark.parametrize("path, module, is_pkg", ALL, ids=[m for _, m, _ in ALL])
def test_imports_point_down(path, module, is_pkg):
    mine = _floor_of(module)
    up = []
    for line, target, _ in _imports(path, module, is_pkg):
        theirs = _floor_of(target)
        if target == "precision_lab" or module == "precision_lab":
            continue  # the package root is the public face: it names what sits on every floor
        if FLOORS[theirs] > FLOORS[mine]:
            up.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({mine} -> {theirs})")
    assert not up, "\n".join(up)


# the read model: the store's named questions (the dashboard's views, the questions use cases share, a long run's
# timeline) and the typed rows they answer with, which ui and cli read directly; no service forwards them
READ_MODEL = ("precision_lab.store.views", "precision_lab.store.queries", "precision_lab.store.timeline",
              "precision_lab.store.rows")


def test_ui_and_cli_read_the_store_through_the_read_model_only():
    """ui and cli ask the store's named questions (``READ_MODEL``) and use the package's public face (``Store``,
    ``held``); the store's other modules (transfer, the connections) are the services' to use."""
    reach = []
    for path, module, is_pkg in ALL:
        if _floor_of(module) not in ("ui", "cli"):
            continue
        for line, target, _ in _imports(path, module, is_pkg):
            if target.startswith("precision_lab.store.") and target not in READ_MODEL:
                reach.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not reach, "\n".join(reach)


def _top_imports(path: Path):
    """(line, module) for every import of a script."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module or ""
            yield from ((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)


PAGES = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py"))]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_pages_only_render(page):
    """Pages lay out what ui shapes and start the use cases of services; they never reach the store."""
    text = page.read_text()
    assert not re.search(r"^\s*(import|from)\s+(torch|duckdb)\b", text, re.M), page.name
    assert not SQL.search(text), page.name
    store = [f"{page.name}:{line} imports {m}" for line, m in _top_imports(page)
             if m == "precision_lab.store" or m.startswith("precision_lab.store.")]
    assert not store, "\n".join(store)


def _defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _all_of(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    return []


def _imported_from(tree: ast.Module, package: str) -> dict[str, str]:
    """name -> the project module it was imported from, for a module's top-level ``from ... import`` lines."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(0, node.level - 1)] if node.level else []
            src = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            out.update({(a.asname or a.name): src for a in node.names})
    return out


@pytest.mark.parametrize("path, module, is_pkg", [m for m in ALL if _floor_of(m[1]) in ("services", "ui")],
                         ids=[m for _, m, _ in ALL if _floor_of(m) in ("services", "ui")])
def test_each_name_is_published_in_one_place(path, module, is_pkg):
    """A view-model module's ``__all__`` lists only what it defines; a service's never lists a name of the read
    model (a forward of the store's questions, as services/browse.py was): ui reads the read model directly."""
    tree = ast.parse(path.read_text())
    package = module if is_pkg else module.rsplit(".", 1)[0]
    sources = _imported_from(tree, package)
    published = [n for n in _all_of(tree) if n not in _defined_names(tree)]
    if _floor_of(module) == "services":
        published = [n for n in published if sources.get(n, "").startswith(READ_MODEL)]
    assert not published, f"{path.relative_to(ROOT)} publishes names it imports: {published}"


UI_PACKAGE = "precision_lab.ui"


def _ui_file(module: str):
    """The file of ``precision_lab.ui.<name>``, or None for anything else."""
    if not module.startswith(UI_PACKAGE + "."):
        return None
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    return path if path.exists() else None


def _own_names(tree: ast.Module) -> set[str]:
    """What a module defines at its top: a def, a class or an assignment, but not ``x = name_it_imported`` (a
    re-export under another name)."""
    imported = {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    aliases = {t.id for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name)
               and n.value.id in imported for t in n.targets if isinstance(t, ast.Name)}
    return _defined_names(tree) - aliases


def _ui_reads(path: Path, module: str, is_pkg: bool = False):
    """(line, ui module, name) for every name a file takes from a ui module: ``from precision_lab.ui.x import
    name`` (or its relative spelling) and ``alias.name`` where the file bound ``alias`` to a ui module at its top."""
    tree = ast.parse(path.read_text())
    package = module if is_pkg else module.rsplit(".", 1)[0]
    modules = {}  # alias -> ui module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                if _ui_file(f"{src}.{a.name}") is not None:
                    if node in tree.body:
                        modules[a.asname or a.name] = f"{src}.{a.name}"
                elif _ui_file(src) is not None:
                    yield node.lineno, src, a.name
        elif isinstance(node, ast.Import) and node in tree.body:
            modules.update({a.asname: a.name for a in node.names if a.asname and _ui_file(a.name) is not None})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            yield node.lineno, modules[node.value.id], node.attr


READERS = [(p, p.stem, False) for p in PAGES] + ALL


@pytest.mark.parametrize("path, module, is_pkg", READERS, ids=[str(p.relative_to(ROOT)) for p, _, _ in READERS])
def test_what_is_read_off_a_ui_module_is_defined_there(path, module, is_pkg):
    """A page (or any module) takes from a ui module only what that module defines (a def, a class, an
    assignment): a store question it merely imported is not ui's to hand on.  A page that needs what the read
    model answers calls the ui function that asks it and shapes the answer for the page."""
    own = {}
    bad = []
    for line, ui, name in _ui_reads(path, module, is_pkg):
        if ui not in own:
            own[ui] = _own_names(ast.parse(_ui_file(ui).read_text()))
        if name not in own[ui]:
            bad.append(f"{path.relative_to(ROOT)}:{line} reads {name} off {ui}, which does not define it")
    assert not bad, "\n".join(bad)


UI_MODULES = [m for m in ALL if _floor_of(m[1]) == "ui"]


@pytest.mark.parametrize("path, module, is_pkg", UI_MODULES, ids=[m for _, m, _ in UI_MODULES])
def test_a_ui_module_uses_every_name_it_imports(path, module, is_pkg):
    """An import a ui module does not use itself is there to be handed on (a re-export, with the ``noqa: F401``
    that silences the linter); ui re-exports nothing."""
    text = path.read_text()
    assert "noqa: F401" not in text, f"{path.relative_to(ROOT)} silences an unused import"
    tree = ast.parse(text)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    unused = [f"{path.relative_to(ROOT)}:{node.lineno} {a.asname or a.name}" for node in ast.walk(tree)
              if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__"
              for a in node.names if (a.asname or a.name).split(".")[0] not in used]
    assert not unused, "imported and not used (a re-export):\n" + "\n".join(unused)


def test_the_name_checks_see_a_re_export(tmp_path):
    """The two checks above, on a ui module that hands a store question on and a page that reads it."""
    ui = PKG / "ui"
    probe = tmp_path / "probe.py"
    probe.write_text("from ..store.views import record  # noqa: F401\nfrom ..store import views\n"
                     "lookup = views.find_records\nalias = record\n\ndef shaped(store):\n    return 1\n")
    tree = ast.parse(probe.read_text())
    assert _own_names(tree) == {"lookup", "shaped"}  # ``alias = record`` hands an import on
    page = tmp_path / "page.py"
    page.write_text("from precision_lab.ui import overview as ov\nfrom precision_lab.ui.detail import record\n"
                    "ov.top_offenders(1)\nov.runs_table(1)\n")
    reads = {(m, n) for _, m, n in _ui_reads(page, "page")}
    assert reads == {("precision_lab.ui.overview", "top_offenders"), ("precision_lab.ui.overview", "runs_table"),
                     ("precision_lab.ui.detail", "record")}
    assert "runs_table" in _own_names(ast.parse((ui / "overview.py").read_text()))


def _forwards(tree: ast.Module, aliases: set[str]) -> list[str]:
    """Top-level functions whose whole body (past a docstring) is ``return <alias>.<question>(...)``."""
    out = []
    for f in tree.body:
        if not isinstance(f, ast.FunctionDef):
            continue
        body = f.body[1:] if f.body and isinstance(f.body[0], ast.Expr) else f.body
        if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call):
            fn = body[0].value.func
            if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id in aliases:
                out.append(f.name)
            elif isinstance(fn, ast.Name) and fn.id in aliases:
                out.append(f.name)
    return out


def test_no_service_or_view_model_forwards_a_store_question():
    """A service is a use case with behaviour, a view-model shapes what it reads; a function of either that only
    returns a store question's answer is a forward, and its callers ask the read model themselves."""
    found = []
    for path, module, is_pkg in ALL:
        if _floor_of(module) not in ("services", "ui"):
            continue
        tree = ast.parse(path.read_text())
        package = module if is_pkg else module.rsplit(".", 1)[0]
        aliases = {n for n, src in _imported_from(tree, package).items()
                   if src.startswith("precision_lab.store")}
        found += [f"{path.relative_to(ROOT)}: {name}" for name in _forwards(tree, aliases) if not name.startswith("_")]
    assert not found, "\n".join(found)


def test_sql_is_written_in_the_store_only():
    found = []
    for path, module, _ in ALL:
        if module.startswith("precision_lab.store"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL.search(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
                if SQL.search(text):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("sql", "execute", "executemany"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.func.attr}(...)")
    assert not found, "SQL outside precision_lab/store:\n" + "\n".join(found)


def test_project_imports_sit_at_module_top():
    deferred = [f"{path.relative_to(ROOT)}:{line} {target}" for path, module, is_pkg in ALL
                for line, target, inside in _imports(path, module, is_pkg) if inside]
    assert len(deferred) <= MAX_DEFERRED_PROJECT_IMPORTS, "\n".join(deferred)
    # each one says why
    for entry in deferred:
        file, line = entry.split(" ")[0].rsplit(":", 1)
        lines = (ROOT / file).read_text().splitlines()
        context = " ".join(lines[max(0, int(line) - 3): int(line)])
        assert "#" in context, f"{entry}: a deferred project import needs a comment saying why"


def test_the_routing_shim_still_matches_streamlit(tmp_path, monkeypatch):
    """``ui.page._ensure_routed`` relies on Streamlit keeping the old pages/-folder mode in the class flag
    ``PagesManager.uses_pages_directory``, set by the first PagesManager from whether a ``pages/`` folder sits
    beside the main script.  When a Streamlit upgrade changes that, this fails: revisit the shim."""
    from streamlit.runtime.pages_manager import PagesManager

    assert "uses_pages_directory" in vars(PagesManager), "Streamlit dropped PagesManager.uses_pages_directory"
    (tmp_path / "pages").mkdir()
    (tmp_path / "app.py").write_text("")
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    PagesManager(str(tmp_path / "app.py"))
    assert PagesManager.uses_pages_directory is True, "Streamlit no longer detects a pages/ folder this way"
