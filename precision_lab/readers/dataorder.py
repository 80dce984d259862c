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

``settle`` puts every source of order together for a dump (``Hint`` per
tensor): the dump's own list (tensor or module names, or the call numbers its
file names begin with; ops it leaves out are placed by what follows, never by
name), file times (ties broken by the
data), the output -> input links, and containers found from the data (a
record whose output is bit-identical to another's and whose input is a third
op's input encloses them: the root under any name); what is still tied goes
containers first, then the fewest non-finite values (a value spreads as it is
passed on), then the fewest NaN (an overflow writes inf; the ops after it turn
inf into NaN), then the name; backward ops (gradients only) go after the forward pass, in its reverse order, as
autograd runs them, and the gradient one hands on (``grad_input``) links it to the next (``grad_output``).  It
says which order it used and how certain it is.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
from dataclasses import dataclass, field
from itertools import combinations
from typing import Iterable, Optional, Sequence

import numpy as np

from ..records import GRAD_ROLES

_GRAD = frozenset(GRAD_ROLES)  # what a backward op records: gradients received, handed on and of its parameters


__all__ = ["digest", "order_from_data", "DataOrder", "DATA_IN_ROLES", "DATA_OUT_ROLES", "Hint", "Settled", "settle"]

# the roles a value passes through from one op to the next (a parameter is no op's output); in the backward pass
# an op's grad_input is the gradient it hands on, the next backward op's grad_output
DATA_IN_ROLES = frozenset({"input", "kwarg", "grad_output"})
DATA_OUT_ROLES = frozenset({"output", "grad_input"})


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
        if a.dtype.type.__module__ == "ml_dtypes":  # bf16/fp8 read without torch: labelled as torch's are above
            a = a.view(np.uint8 if a.dtype.itemsize == 1 else np.int16)
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
    ops, succ, weak, n_edges = _links(entries)
    if n_edges == 0:
        return None
    _container_links(ops, succ, weak, _names(ops))
    return DataOrder(_toposort(ops, succ, weak), n_edges)


def _links(entries) -> tuple[list[str], dict, dict, int]:
    """``(ops in the given order, strong links, weak links, how many)`` from outputs that are later inputs."""
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
    return ops, succ, weak, n_edges


def _names(ops: Sequence[str]):
    """``inside(a)``: the ops whose name puts them inside module ``a`` (every op for the root ``""``)."""
    names = sorted(ops)

    def inside(a: str) -> list[str]:
        if a == "":
            return [o for o in names if o != ""]
        lo = bisect.bisect_left(names, a + ".")
        hi = bisect.bisect_left(names, a + "/")  # "/" sorts right after "."
        return names[lo:hi]
    return inside


def _container_links(ops, succ, weak, inside, back=frozenset()) -> None:
    # whatever reads a module's output runs after every forward op inside that module (its backward op, named
    # under it, runs after the whole forward pass)
    for links in (succ, weak):
        for a in [a for a in ops if links[a]]:
            inner = inside(a)
            for b in list(links[a]):
                for o in inner:
                    if o not in back and not _nested(o, b):
                        links[o].add(b)
    # a module is called before the ops inside it
    for a in ops:
        succ[a].update(inside(a))


@dataclass(frozen=True)
class Hint:
    """One tensor as ``settle`` reads it: its op and role, its ``digest``, the rank of its file's modification
    time among the dump's distinct times (``tick``, None without usable times), its op's place in the dump's
    own order list (``listed``) and its share of non-finite values (``spread``)."""
    op: str
    role: str
    digest: Optional[bytes] = None
    tick: Optional[int] = None
    listed: Optional[int] = None
    spread: float = 0.0
    nan: float = 0.0  # its share of NaN: an overflow writes inf, the ops after it turn inf into NaN


@dataclass(frozen=True)
class Settled:
    """``rank``: op -> place; ``parents``: op -> the op found from the data to enclose it; ``kind``: the
    run's order (``RunSource.order``); ``note``: the order used and how certain it is, in words."""
    rank: dict[str, int]
    parents: dict[str, str] = field(default_factory=dict)
    kind: str = "name"
    note: str = ""
    edges: int = 0
    list_order: Optional[str] = None  # "call" or "completion" when the dump's list names modules around others


def _strong(d) -> bool:
    return d is not None and not getattr(d, "weak", False)


def settle(hints: Sequence[Hint], *, listed_from: str = "") -> Settled:
    """The order of the ops in ``hints`` (given in the reader's order: by file time, then name) from every
    source the dump has; ``listed_from`` names the order list (for the note)."""
    ops, succ, weak, n_edges = _links((h.op, h.role, h.digest) for h in hints)
    seen = _Seen.of(ops, hints)
    times, tied = _time_ties(seen.tick)
    inside = _names(ops)
    back = _backward_ops(hints)
    encl = _enclosing(ops, hints, seen, inside, succ, weak, back)
    by_time = times > 1 and not tied and not n_edges
    order = _data_order(ops, seen, inside, encl, succ, weak, back, by_time)
    list_order = None
    if seen.listed:
        slots = [i for i, o in enumerate(order) if o in seen.listed]
        for i, o in zip(slots, sorted(seen.listed, key=seen.listed.__getitem__)):
            order[i] = o
        list_order = _list_order(seen.listed, inside, encl)
    rank = {o: i for i, o in enumerate(order)}
    parents = _parents(encl, rank)
    kind, note = _say(ops, seen.listed, listed_from, list_order, n_edges, times, tied, bool(encl))
    if back and not seen.listed and not by_time:
        note += "; backward ops after the forward pass, in its reverse order (as autograd runs them)"
    return Settled(rank, parents, kind, note, n_edges, list_order)


@dataclass
class _Seen:
    """What the hints say of each op: the digests of the values it read (``ins``) and wrote (``outs``), its
    earliest file time and place in the order list, and the largest non-finite and NaN shares of its outputs."""

    ins: dict[str, set]
    outs: dict[str, set]
    tick: dict[str, int]
    listed: dict[str, int]
    spread: dict[str, float]
    nan: dict[str, float]

    @classmethod
    def of(cls, ops: Sequence[str], hints: Sequence[Hint]) -> "_Seen":
        seen = cls({o: set() for o in ops}, {o: set() for o in ops}, {}, {}, {o: 0.0 for o in ops},
                   {o: 0.0 for o in ops})
        for h in hints:
            if h.tick is not None:
                seen.tick[h.op] = min(seen.tick.get(h.op, h.tick), h.tick)
            if h.listed is not None:
                seen.listed[h.op] = min(seen.listed.get(h.op, h.listed), h.listed)
            wrote = h.role in DATA_OUT_ROLES or h.role == "tensor"
            if wrote:
                seen.spread[h.op] = max(seen.spread[h.op], h.spread)
                seen.nan[h.op] = max(seen.nan[h.op], h.nan)
            if _strong(h.digest):
                if wrote:
                    seen.outs[h.op].add(h.digest)
                elif h.role in DATA_IN_ROLES:
                    seen.ins[h.op].add(h.digest)
        return seen


def _time_ties(tick: dict[str, int]) -> tuple[int, int]:
    """How many distinct file times the ops have, and how many ops share one with another (0 for one time)."""
    times = len(set(tick.values()))
    per_tick: dict[int, int] = {}
    for t in tick.values():
        per_tick[t] = per_tick.get(t, 0) + 1
    return times, (sum(n for n in per_tick.values() if n > 1) if times > 1 else 0)


def _enclosing(ops, hints, seen: _Seen, inside, succ, weak, back) -> dict[str, tuple[set, set]]:
    """The containers found from the data and the root, each with the ops it holds; links each container ahead
    of what it holds (``succ``), as it is called before them."""
    encl = _data_containers(ops, seen.ins, seen.outs, inside)
    root = _root(ops, hints, inside)
    if root is not None:
        encl[root] = ({o for o in ops if o != root and not _nested(o, root)}, set())
    _container_links(ops, succ, weak, inside, back)
    for b, (inner, first) in encl.items():
        for o in inner | first:
            if b not in succ[o]:
                succ[b].add(o)
    return encl


def _data_order(ops, seen: _Seen, inside, encl, succ, weak, back, by_time: bool) -> list[str]:
    """The ops in the order file times (``by_time``: distinct for every op, with no data link to say otherwise)
    or the data links give, ties broken by file time, then the fewest non-finite values, the fewest NaN and the
    reader's order; a container goes where the first op it holds would go (it is called right before it)."""
    if by_time:  # hooks save as each module finishes: distinct times are the order itself
        return list(ops)
    given = {o: i for i, o in enumerate(ops)}
    own = {o: (seen.tick.get(o, 0), seen.spread[o], seen.nan[o], given[o]) for o in ops}
    key = {o: min([own[o]] + [own[i] for i in inside(o)] + [own[i] for i in encl.get(o, (set(), set()))[0]])
           for o in ops}
    rank = _toposort(sorted(ops, key=key.__getitem__), succ, weak)
    if back:  # the backward ops in the reverse of the forward order just found
        rank = _toposort(_backward_last(sorted(ops, key=rank.__getitem__), back), succ, weak)
    return sorted(ops, key=rank.__getitem__)


def _backward_ops(hints: Sequence[Hint]) -> set[str]:
    """The ops that record gradients only (``GRAD_ROLES``): a dump's backward ops."""
    roles: dict[str, set] = {}
    for h in hints:
        roles.setdefault(h.op, set()).add(h.role)
    return {o for o, r in roles.items() if r <= _GRAD}


def _backward_last(keyed: list[str], back: set[str]) -> list[str]:
    """``keyed`` with the backward ops ``back`` after every forward op, in the reverse order of their forward ops
    (autograd walks the graph from the loss back to the inputs: ``<op>.backward`` runs after the backward of the
    ops that used ``<op>``'s output); a backward op whose forward op is not in the dump goes last.  Data links
    still decide where they say something (``_toposort``)."""
    if not back:
        return keyed
    at = {o: i for i, o in enumerate(keyed)}

    def forward_at(o: str) -> int:
        for f in (o.replace(".backward", ".forward"), o.replace(".backward", "")):
            if f != o and f in at and f not in back:
                return at[f]
        return -1

    return [o for o in keyed if o not in back] + sorted(back, key=lambda o: (-forward_at(o), at[o]))


def _data_containers(ops, ins, outs, inside) -> dict[str, tuple[set, set]]:
    """container -> (the ops it encloses by the data: those whose output is its own, the ops whose input is
    its own), for pairs of ops sharing an output whose names do not already say which holds which."""
    by_out: dict[bytes, list[str]] = {}
    for o in ops:
        for d in outs[o]:
            by_out.setdefault(d, []).append(o)
    kids = {o: bool(inside(o)) for o in ops}
    encl: dict[str, tuple[set, set]] = {}
    for makers in by_out.values():
        for a, b in combinations(makers, 2):
            # an op that hands its input on unchanged (dropout in eval, identity) holds nothing
            if _nested(a, b) or "" in (a, b) or ins[a] & outs[a] or ins[b] & outs[b]:
                continue
            c = _outer(a, b, ops, ins, kids)
            if c is None:
                continue
            inner = b if c == a else a
            held, first = encl.setdefault(c, (set(), set()))
            held.add(inner)
            first.update(o for o in ops if o not in (c, inner) and ins[o] & ins[c] and not _nested(o, c))
    return encl


def _root(ops, hints, inside) -> Optional[str]:
    """The root module saved under a name its children do not carry (``model``, its class name): the one op
    with a name of one part, that holds no op by name, whose input is another op's
    input (its first child's; without inputs recorded: whose output is another op's output, its last child's,
    and no op named as a container shares it, all-NaN outputs counting too).  None when no op, or more than
    one, is like that."""
    ins: dict[str, set] = {o: set() for o in ops}
    outs: dict[str, set] = {o: set() for o in ops}
    reads: set[str] = set()  # ops with an input recorded
    for h in hints:
        if h.role in DATA_IN_ROLES:
            reads.add(h.op)
        if h.digest is not None:
            if h.role in DATA_OUT_ROLES or h.role == "tensor":
                outs[h.op].add(h.digest)
            elif h.role in DATA_IN_ROLES and _strong(h.digest):  # all-NaN inputs are shared after any overflow
                ins[h.op].add(h.digest)
    found = []
    for r in ops:
        if r == "" or "." in r or inside(r):
            continue
        if r in reads:  # its input is its first child's
            if any(o != r and ins[o] & ins[r] for o in ops):
                found.append(r)
        else:  # outputs only: its output is its last child's, and no module named as a container shares it
            same = [o for o in ops if o != r and outs[o] & outs[r]]
            if same and not any(inside(o) for o in same):
                found.append(r)
    return found[0] if len(found) == 1 else None


def _outer(a: str, b: str, ops, ins, kids) -> Optional[str]:
    """Which of two ops with the same output holds the other: the one whose input is a third op's input (its
    first op's), else the one other ops are named under, else the shallower name; None when nothing says."""
    def first_of(x, y):
        own = ins[x] - ins[y]
        return bool(own) and any(o not in (x, y) and ins[o] & own for o in ops)
    fa, fb = first_of(a, b), first_of(b, a)
    if fa != fb:
        return a if fa else b
    if kids[a] != kids[b]:
        return a if kids[a] else b
    da, db = a.count("."), b.count(".")
    if da != db:
        return a if da < db else b
    return None


def _parents(encl, rank) -> dict[str, str]:
    """op -> the innermost container found from the data whose span (from its first op to its last) holds it
    (an op held by name too is given it: the origin analysis walks these links, not the names, upward)."""
    spans = []
    for b, (held, first) in encl.items():
        members = held | first
        lo = min(rank[o] for o in members)
        hi = max(rank[o] for o in members)
        spans.append((hi - lo, b, lo, hi))
    parents: dict[str, str] = {}
    by_rank = sorted(rank, key=rank.__getitem__)
    for _size, b, lo, hi in sorted(spans):
        for o in by_rank[lo:hi + 1]:
            # never a module around ``b`` (by name, or the root ""): that would make each hold the other
            if o not in (b, "") and o not in parents and not _nested(o, b) and not _held(b, o, parents):
                parents[o] = b
    return parents


def _held(a: str, b: str, parents: dict[str, str]) -> bool:
    """Whether ``a`` is already inside ``b`` through ``parents``."""
    seen = 0
    while a in parents and seen < len(parents):
        a, seen = parents[a], seen + 1
        if a == b:
            return True
    return False


def _list_order(listed, inside, encl) -> Optional[str]:
    """Whether the dump's list puts modules before the modules inside them (call order, pre-order) or after
    (completion order, post-order); None when it lists no module around another."""
    before = after = 0
    for a in listed:
        for b in list(inside(a)) + sorted(encl.get(a, (set(), set()))[0]):
            if b in listed:
                before += listed[a] < listed[b]
                after += listed[a] > listed[b]
    if before == after == 0:
        return None
    return "call" if before >= after else "completion"


# how ties are broken once the data's links have spoken
_TIES = "containers first, then the fewest non-finite values, then the fewest NaN, then name"


def _say(ops, listed, listed_from, list_order, n_edges, times, tied, containers) -> tuple[str, str]:
    """The run's order kind and its note: what was used, and which parts of it are certain."""
    links = f"{n_edges} output(s) bit-identical to a later op's input" if n_edges else ""
    rest = "; ".join(x for x in (
        links and f"the data ({links})", "containers found from the data" if containers else "") if x)
    if listed:
        how = {"call": ", call order: each module before the modules inside it",
               "completion": ", completion order: each module after the modules inside it"}.get(list_order, "")
        note = f"execution order from {listed_from}{how}"
        missing = len(ops) - len(listed)
        if missing:
            by = "file modification times" if times > 1 else ""
            by = "; ".join(x for x in (by, rest) if x) or _TIES
            note += f"; {missing} op(s) it does not list placed by {by} (uncertain)"
        return "execution", note
    if times > 1 and not tied and not n_edges:
        return "mtime", "order from file modification times (certain)"
    if times > 1 and not tied:
        return "data", (f"order recovered from the data: {links}, certain along those links; file modification "
                        "times for the rest")
    if times > 1:
        note = (f"order from file modification times, certain between the {times} distinct times; {tied} op(s) "
                f"share a time, their order broken by ")
        note += "; ".join(x for x in (rest, _TIES) if x)
        return ("data" if n_edges else "mtime"), note
    if n_edges:
        return "data", f"order recovered from the data: {links}, certain along those links; the rest by {_TIES}"
    return "name", ("order unknown: by name, after containers first, the fewest non-finite values first (a value "
                    "spreads as it is passed on) and the fewest NaN first (an overflow writes inf); the dump has no "
                    "order list, no distinct file times and no output that is a later input")


def _nested(a: str, b: str) -> bool:
    return a.startswith(b + ".") or b.startswith(a + ".")


def _toposort(ops: Sequence[str], succ: dict[str, set[str]], weak: dict[str, set[str]]) -> dict[str, int]:
    """Kahn's algorithm over the strong links; among the ready ops, one no weak link still waits on first, then
    the one that came first in ``ops``; a cycle is broken at its first op.  The ready ops are a heap keyed
    (still waited on, place in ``ops``): an op whose last weak wait ends while ready is pushed again with its
    better key, and the entry left behind is skipped when it comes up (n log n, not n² for a wide dump)."""
    key = {o: i for i, o in enumerate(ops)}
    indeg = {o: 0 for o in ops}
    waits = {o: 0 for o in ops}
    for a in ops:
        for b in succ[a]:
            indeg[b] += 1
        for b in weak[a] - succ[a]:
            waits[b] += 1
    rank: dict[str, int] = {}
    ready: set[str] = set()
    heap: list[tuple[bool, int, str]] = []

    def make_ready(o: str) -> None:
        ready.add(o)
        heapq.heappush(heap, (waits[o] > 0, key[o], o))

    for o in ops:
        if indeg[o] == 0:
            make_ready(o)
    first_left = 0  # ops[:first_left] are all ranked (where a cycle is broken)
    while len(rank) < len(ops):
        if not ready:  # a cycle: take the first remaining op
            while ops[first_left] in rank:
                first_left += 1
            make_ready(ops[first_left])
        o = heapq.heappop(heap)[2]
        if o not in ready:  # ranked already, through the entry its weak waits' end pushed
            continue
        ready.discard(o)
        rank[o] = len(rank)
        for b in succ[o]:
            if b not in rank:
                indeg[b] -= 1
                if indeg[b] <= 0 and b not in ready:
                    make_ready(b)
        for b in weak[o] - succ[o]:
            waits[b] -= 1
            if waits[b] == 0 and b in ready:
                heapq.heappush(heap, (False, key[b], b))
    return rank
