"""One registry rule for readers, fixes, recipes, diagnosis rules and replayable ops; plug-ins by entry point."""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest

from precision_lab import readers
from precision_lab.fixes import catalogue, recipes, replay, rules
from precision_lab.registry import DuplicateName, Registry


def test_every_registry_refuses_a_second_entry_of_one_name():
    fix = next(iter(catalogue.FIXES.values()))
    catalogue.register_fix(fix)  # the same object again changes nothing
    with pytest.raises(ValueError, match="already registered"):
        catalogue.register_fix(dataclasses.replace(fix))
    rec = recipes.get_recipe("fp16-layernorm")
    with pytest.raises(recipes.RecipeError, match="already registered"):
        recipes.register_recipe(recipes.Recipe(rec.name, "dup", rec.build_fn, rec.default_policy))
    with pytest.raises(DuplicateName):
        rules.register_rule("overflow")(lambda ctx, ev: None)
    op = replay.REPLAY_OPS["softmax"]
    with pytest.raises(DuplicateName):
        replay.register_op(dataclasses.replace(op))
    with pytest.raises(DuplicateName):
        readers.register(readers.ordered()[0].__class__())


def test_before_orders_entries_and_replace_keeps_the_place_given():
    r = Registry("thing")
    r.register("a", 1)
    r.register("c", 3)
    r.register("b", 2, before="c")
    assert r.names() == ["a", "b", "c"] and r["b"] == 2 and "b" in r and len(r) == 3
    r.register("a", 10, replace=True)
    assert r.items()[-1] == ("a", 10)
    # the built-in diagnosis rules are tried in the order the module documents
    names = rules.RULES.names()
    assert names.index("nonfinite-in-reference") < names.index("fp8-scale") < names.index("overflow") \
        < names.index("nonfinite-producer")


def _plugin_dist(tmp_path, group: str, body: str, entry: str):
    (tmp_path / "pl_fake_plugin.py").write_text(body)
    dist = tmp_path / "pl_fake_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pl-fake-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{entry}\n")


def test_entry_point_plugins_load_and_a_broken_one_is_skipped_with_a_warning(tmp_path, monkeypatch):
    _plugin_dist(tmp_path, "pl_test.things",
                 "THING = type('Thing', (), {'name': 'from-plugin'})()\n"
                 "def add_more(registry):\n    registry.register('also', 42)\n",
                 "thing = pl_fake_plugin:THING\nmore = pl_fake_plugin:add_more\nbroken = pl_fake_plugin:MISSING")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "pl_fake_plugin", raising=False)
    reg = Registry("thing", group="pl_test.things", name_of=lambda t: t.name)
    reg.register("builtin", 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = reg.names()
    assert names == ["builtin", "from-plugin", "also"] and reg["also"] == 42
    assert [str(w.message) for w in caught if "broken" in str(w.message)] and \
        "pl_fake_plugin:MISSING" in str(caught[-1].message)


def test_every_entry_point_group_is_in_the_architecture_notes():
    """A plug-in author finds every group a registry reads in the table of what a newcomer adds."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    groups = {g for p in (root / "precision_lab").rglob("*.py")
              for g in re.findall(r'Registry\([^)]*group="([\w.]+)"', p.read_text())}
    notes = (root / "docs" / "architecture.md").read_text()
    table = notes[notes.index("## Where a newcomer adds"):notes.index("## Adding a rule")]
    assert {"precision_lab.readers", "precision_lab.file_types", "precision_lab.pages"} <= groups
    assert sorted(g for g in groups if f"`{g}`" not in table) == []
