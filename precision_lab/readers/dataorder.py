"""Execution order recovered from the data of a dump that carries none.

An op's output that is bit-identical to another op's input was (almost
certainly) passed from one to the other, so the first ran before the second.
Each tensor is hashed once while it is read (``digest``); ``order_from_data``
turns the edges into an order: a topological sort, ties and cycles broken by
the order the dump gave (by file time or by name).  Tensors that say nothing about where they came from
are left out of the edges: those with fewer than two elements and finite
constant ones (all zeros, all ones), which many unrelated ops share.  An
all-NaN or all-inf tensor gives a weak link: after an overflow it is often
all there is to link the ops that pass the value on, but unrelated ops share
it too, so among the ops ready to place, one no weak link waits on goes first.

A module and the ops inside it share tensors too (its input is its first
op's input, its output its last op's output): equal inputs or equal outputs
give no edge; a module is called before the ops inside it, and an op that
reads a module's output runs after every op inside that module.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np


__all__ = ["digest", "order_from_data", "DataOrder", "DATA_IN_ROLES", "DATA_OUT_ROLES"]

# the roles a value passes through from one op to the next (a parameter is no op's output)
DATA_IN_ROLES = frozenset({"input", "kwarg"})
DATA_OUT_ROLES = frozenset({"output"})


class Digest(bytes):
    """A tensor's hash; ``weak`` for an all-NaN or all-inf tensor, which unrelated ops after an overflow share
    (such a link orders ops only where nothing else does)."""

    weak = False


def digest(t) -> Optional[bytes]:
    """A 16-byte hash of a tensor's dtype, shape and bytes; None for tensors that cannot tell ops apart
    (fewer than two elements, or every element the same finite value) or whose bytes cannot be read."""
    try:
        a = t.detach().cpu() if hasattr(t, "detach") else t
        if hasattr(a, "numpy"):
            import torch  # deferred: only a torch tensor reaches this line, so torch is already imported

            if a.dtype in (torch.bfloat16,) or str(a.dtype).startswith("torch.float8"):
                a = a.view(torch.uint8 if a.element_size() == 1 else torch.int16)
            a = a.contiguous().numpy()
        a = np.ascontiguousarray(a)
        if a.size < 2:
            return None
        flat = a.reshape(-1)
        ints = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
        bits = flat.view(ints) if ints is not None else flat.view(np.uint8).reshape(a.size, -1)
        # three probes settle almost every tensor; only a candidate constant is compared whole
        constant = bool((bits[0] == bits[-1]).all() and (bits[0] == bits[a.size // 2]).all()
                        and (bits == bits[0]).all())
        if constant and (a.dtype.kind not in "fc" or np.isfinite(flat[:1]).all()):
            return None  # a finite constant (zeros, ones, a filled mask); an all-NaN/inf tensor is kept, weak
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(flat.view(np.uint8)))
        d = Digest(h.digest())
        d.weak = constant
        return d
    except Exception:  # an exotic dtype or layout: no evidence, never a failure
        return None


@dataclass
class DataOrder:
    """``rank``: op name -> place in execution order; ``edges``: how many output -> input links decided it."""

    rank: dict[str, int]
    edges: int


def order_from_data(entries: Iterable[tuple[str, str, Optional[bytes]]]) -> Optional[DataOrder]:
    """The order of the ops named in ``entries`` (``(op, role, digest)``, in the order the dump gave them:
    that order breaks ties), or None when no output of one op is the input of another (nothing to go on)."""
    ops: list[str] = []
    seen: set[str] = set()
    produced: dict[bytes, set[str]] = {}
    consumed: dict[bytes, set[str]] = {}
    for op, role, d in entries:
        if op not in seen:
            seen.add(op)
            ops.append(op)
        if d is None:
            continue
        if role in DATA_OUT_ROLES:
            produced.setdefault(d, set()).add(op)
        elif role in DATA_IN_ROLES:
            consumed.setdefault(d, set()).add(op)
    succ: dict[str, set[str]] = {o: set() for o in ops}
    weak: dict[str, set[str]] = {o: set() for o in ops}
    n_edges = 0
    for d, makers in produced.items():
        for a in makers:
            for b in consumed.get(d, ()):
                # a module and an op inside it share their first input / last output: not a link
                if a == b or _nested(a, b) or b in succ[a]:
                    continue
                # an op that also produced it is a module around the maker (its last op's output): no edge to it
                if b in makers:
                    continue
                if getattr(d, "weak", False):
                    weak[a].add(b)
                else:
                    succ[a].add(b)
                n_edges += 1
    if n_edges == 0:
        return None
    names = sorted(ops)

    def inside(a: str) -> list[str]:
        lo = bisect.bisect_left(names, a + ".")
        hi = bisect.bisect_left(names, a + "/")  # "/" sorts right after "."
        return names[lo:hi]

    # whatever reads a module's output runs after every op inside that module
    for links in (succ, weak):
        for a in [a for a in ops if links[a]]:
            inner = inside(a)
            for b in list(links[a]):
                for o in inner:
                    if not _nested(o, b):
                        links[o].add(b)
    # a module is called before the ops inside it
    for a in ops:
        succ[a].update(inside(a))
    return DataOrder(_toposort(ops, succ, weak), n_edges)


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + ".") or b.startswith(a + ".")


def _toposort(ops: Sequence[str], succ: dict[str, set[str]], weak: dict[str, set[str]]) -> dict[str, int]:
    """Kahn's algorithm over the strong links; among the ready ops, one no weak link still waits on first, then
    the one that came first in ``ops``; a cycle is broken at its first op."""
    key = {o: i for i, o in enumerate(ops)}
    indeg = {o: 0 for o in ops}
    waits = {o: 0 for o in ops}
    for a in ops:
        for b in succ[a]:
            indeg[b] += 1
        for b in weak[a] - succ[a]:
            waits[b] += 1
    rank: dict[str, int] = {}
    ready = {o for o in ops if indeg[o] == 0}
    while len(rank) < len(ops):
        if not ready:  # a cycle: take the first remaining op
            ready.add(min((o for o in ops if o not in rank), key=key.__getitem__))
        o = min(ready, key=lambda o: (waits[o] > 0, key[o]))
        ready.discard(o)
        rank[o] = len(rank)
        for b in succ[o]:
            if b not in rank:
                indeg[b] -= 1
                if indeg[b] <= 0:
                    ready.add(b)
        for b in weak[o] - succ[o]:
            waits[b] -= 1
    return rank
