"""The model as a tree: modules nested by path, each coloured by its worst headroom, the path to the failure marked.

A node's ``headroom`` is the smallest, over the ops it holds (its own call, the
functional ops inside it, its children) and over every step, of log2(format
max / |x| max); ``nonfinite`` says whether any of them held NaN/Inf.  Functional
ops belong to their module (``ops.enclosing_module``: the dump's nesting, else a
capture's name); dumps without a hierarchy are grouped by dotted name prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from ..alerts import op_format
from ..formats import get_format
from ..ops import enclosing_module, module_path
from ..store import queries as q

__all__ = ["ROOT", "ModuleNode", "build_tree", "run_tree", "tree_modules_of"]

ROOT = "(model)"


@dataclass(frozen=True, slots=True)
class ModuleNode:
    """A module of the tree: its path (``id``; ``ROOT`` for the model), its parent's path (``""`` for the root),
    the last part of its path, its worst headroom (None: no finite one), whether it held NaN/Inf, whether it lies
    on the path to the first failure, and the op it opens (its own call where recorded, else its worst op)."""

    id: str
    parent: str
    label: str
    headroom: Optional[float]
    nonfinite: bool
    on_path: bool
    op: Optional[str]


def build_tree(entries: Sequence, failing: Optional[str] = None) -> list[ModuleNode]:
    """The modules' nodes from ``entries`` (rows with ``op``, ``headroom``,
    ``nonfinite`` and optionally ``parent``: the op's enclosing call); ``failing`` is the module path of the
    first failure.  ``op`` of a node is the module's own call where recorded, else its worst op."""
    nodes: dict = {"": {"id": ROOT, "parent": "", "label": ROOT, "headroom": None, "nonfinite": False,
                        "on_path": failing is not None, "op": None, "_worst": math.inf}}
    for e in entries:
        path = enclosing_module(e.op, getattr(e, "parent", None))
        parts = path.split(".") if path else []
        h = e.headroom
        h = h if h is not None and math.isfinite(h) else None
        for i in range(len(parts) + 1):
            key = ".".join(parts[:i])
            n = nodes.get(key)
            if n is None:
                n = nodes[key] = {
                    "id": key, "parent": ROOT if i == 1 else ".".join(parts[:i - 1]), "label": parts[i - 1],
                    "headroom": None, "nonfinite": False, "op": None, "_worst": math.inf,
                    "on_path": failing is not None and (failing == key or failing.startswith(key + "."))}
            if h is not None and (n["headroom"] is None or h < n["headroom"]):
                n["headroom"] = h
            n["nonfinite"] = n["nonfinite"] or bool(e.nonfinite)
        leaf = nodes[path]
        own = module_path(e.op) == path and module_path(e.op) != e.op
        score = -1.0 if own else (h if h is not None else math.inf)  # the module's own call first
        if leaf["op"] is None or score < leaf["_worst"]:
            leaf["op"], leaf["_worst"] = e.op, score
    return [ModuleNode(n["id"], n["parent"], n["label"], n["headroom"], n["nonfinite"], n["on_path"], n["op"])
            for n in nodes.values()]


def run_tree(store, run_id: str, *, fmt: Optional[str] = None, failing_op: Optional[str] = None,
             failing_parent: Optional[str] = None) -> list[ModuleNode]:
    """The tree of a run's stored records, against ``fmt`` (default: the run's own low-precision format,
    else fp16); ``failing_op`` (and its ``failing_parent``) marks the path to the first producer."""
    run = q.run_row(store, run_id)
    f = get_format(fmt) if fmt else (op_format(run.dtype if run else None) or get_format("fp16"))
    failing = enclosing_module(failing_op, failing_parent) if failing_op else None
    return build_tree(q.op_extremes(store, run_id, f.max), failing)


def tree_modules_of(nodes: list[ModuleNode]) -> list[ModuleNode]:
    """The nodes that open an op, the path to the failure first (innermost first), then by worst headroom."""
    depth = lambda n: 0 if n.parent == "" else n.id.count(".") + 1  # noqa: E731  (the root has no parent)
    with_op = [n for n in nodes if n.op]
    with_op.sort(key=lambda n: (not n.on_path, -depth(n) if n.on_path else 0,
                                n.headroom if n.headroom is not None else math.inf))
    return with_op
