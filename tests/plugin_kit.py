"""What the plug-in tests share: the worked examples of docs/architecture.md's "Adding a ..." sections, and an
installed distribution whose entry points name modules written in a test's folder."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_examples(title: str) -> dict[str, str]:
    """File name -> code of the ``python`` blocks (each opening with ``# <file>.py``) of section ``## <title>``."""
    notes = (ROOT / "docs" / "architecture.md").read_text()
    section = notes[notes.index(f"## {title}\n"):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    return dict(re.findall(r"```python\n# (\w+\.py)\n(.*?)```", section, re.S))


def install(tmp_path: Path, monkeypatch, modules: dict[str, str], entry_points: dict[str, list[str]],
            registries=()) -> None:
    """Write ``modules`` (file name -> code) and a distribution with ``entry_points`` (group -> ``name = target``
    lines) on ``sys.path``; ``registries`` read their entry points again, as in a process that has not read them
    yet.  The modules are imported afresh."""
    for file, code in modules.items():
        (tmp_path / file).write_text(code)
        monkeypatch.delitem(sys.modules, file.removesuffix(".py"), raising=False)
    dist = tmp_path / "pl_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pl-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("".join(f"[{group}]\n" + "".join(f"{line}\n" for line in lines)
                                                   for group, lines in entry_points.items()))
    monkeypatch.syspath_prepend(str(tmp_path))
    for registry in registries:
        monkeypatch.setattr(registry, "_plugins_loaded", False)
