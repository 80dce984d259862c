"""One registry type for everything that can be added by name: dump readers, tensor file types, fixes, recipes,
diagnosis rules and the facts they read, replayable ops, dashboard pages.  The built-ins register through it exactly
as a plug-in does.

The rule is the same everywhere: a name is registered once; registering it
again raises unless ``replace=True``.  ``before=`` places an entry ahead of
another (order matters for diagnosis rules and readers).  Third-party packages
add entries through the entry point group a registry names (``[project.entry-points."precision_lab.readers"]``
in their ``pyproject.toml``), loaded the first time the registry is read; a
broken plug-in is skipped with one warning naming it.
"""

from __future__ import annotations

import inspect
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator, Optional

__all__ = ["Registry", "DuplicateName"]


class DuplicateName(ValueError):
    """A name is registered already; pass ``replace=True`` to replace it."""


class Registry:
    """An ordered name -> object mapping with one duplicate rule and entry-point plug-ins.

    ``group``: the entry point group searched for plug-ins.  An entry point's
    object is a registrable object (given ``name_of``), a callable taking this
    registry and registering what it brings, or a module whose import
    registered it (``mine = "my_rules"``: its ``@register_rule`` functions).
    """

    def __init__(self, kind: str, *, group: Optional[str] = None,
                 name_of: Optional[Callable[[Any], str]] = None):
        self.kind = kind
        self.group = group
        self._name_of = name_of
        self._items: dict[str, Any] = {}
        self._plugins_loaded = group is None

    # ---- adding -------------------------------------------------------------
    def register(self, name: str, obj: Any, *, replace: bool = False, before: Optional[str] = None) -> Any:
        """Add ``obj`` under ``name`` (at the end, or ahead of ``before``); returns ``obj``."""
        if name in self._items and not replace and self._items[name] is not obj:
            raise DuplicateName(f"a {self.kind} named {name!r} is already registered; pass replace=True to replace it")
        self._items.pop(name, None)
        if before is not None and before in self._items:
            items = list(self._items.items())
            at = next(i for i, (n, _) in enumerate(items) if n == before)
            items.insert(at, (name, obj))
            self._items = dict(items)
        else:
            self._items[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        self._items.pop(name, None)

    def pop(self, name: str, default: Any = None) -> Any:
        return self._items.pop(name, default)

    # ---- reading ------------------------------------------------------------
    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.group):
            try:
                obj = ep.load()
                if inspect.ismodule(obj):
                    continue  # importing it registered what it brings
                if inspect.isfunction(obj):
                    obj(self)  # a function that registers what the package brings
                elif self._name_of is not None:
                    self.register(self._name_of(obj), obj)
                else:
                    raise TypeError(f"{ep.value} is not a function that registers {self.kind}s")
            except Exception as e:  # one broken plug-in must not take the others (or the dashboard) down
                warnings.warn(f"{self.kind} plug-in {ep.name!r} ({ep.value}) was skipped: {type(e).__name__}: {e}",
                              RuntimeWarning, stacklevel=2)

    def get(self, name: str, default: Any = None) -> Any:
        self._load_plugins()
        return self._items.get(name, default)

    def __getitem__(self, name: str) -> Any:
        self._load_plugins()
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        self._load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        self._load_plugins()
        return iter(list(self._items))

    def __len__(self) -> int:
        self._load_plugins()
        return len(self._items)

    def names(self) -> list[str]:
        return list(self)

    def values(self) -> list[Any]:
        self._load_plugins()
        return list(self._items.values())

    def items(self) -> list[tuple[str, Any]]:
        self._load_plugins()
        return list(self._items.items())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"
