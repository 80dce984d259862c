"""Following a failure back: the model's output of each step and rank, and the walk from a failure to the op
call, parameter or input where it started (``_walk``)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..enums import RunOrder
from ..ops import module_path
from .calls import _NUMBERED, _inside
from .values import _Event


@dataclass(frozen=True, slots=True)
class ModelOutputs:
    """The op call that returned the model's output at each step and rank (``model_outputs``)."""

    by_step: dict  # (step, rank) -> (op, root)


def model_outputs(ends: Sequence, order, parents: Optional[Mapping] = None) -> ModelOutputs:
    """(step, rank) -> ``(op, root)`` (``ModelOutputs.by_step``): the op call that returned the model's output,
    from ``store.queries.forward_ends`` rows (the forward op calls that start first and last), and whether it is
    known to be the root.  The first when it holds the last (a root recorded in call order) or the last when it
    holds the first (a root recorded as it completes): the root; else a record named as a model's output is
    (``named_root``: ``model.npy`` beside ``layers.0.npy``), or, in a known order, the last op of a dump
    without a root, taken as the output (``root`` False)."""
    known = RunOrder.of(order).known
    out = {}
    for e in ends:
        first, last = e.first, e.last
        key = (int(e.step), int(e.rank))
        if first is None or last is None:
            continue
        if first == last or _inside(last, first, parents):
            out[key] = (first, True)
        elif _inside(first, last, parents):
            out[key] = (last, True)
        elif e.named_root:
            out[key] = (e.named_root, False)
        elif known:
            out[key] = (last, False)
    return ModelOutputs(out)


def _explains(received: frozenset, wrote: frozenset) -> bool:
    """Whether values of the kinds ``received`` can become values of the kinds ``wrote``: NaN or ``+inf`` explains
    anything; ``-inf`` explains ``-inf`` passed on and NaN (``-inf - -inf``, ``0 x -inf``, a softmax row of
    ``-inf``), never a ``+inf``: that is new (``exp`` overflowing beside a mask)."""
    if not received:
        return False
    return bool(received - {"-inf"}) or "+inf" not in wrote


def _explained(e: _Event) -> bool:
    """Whether what ``e`` wrote can have come from what it received (``_explains``)."""
    return _explains(e.in_kinds, e.out_kinds)


def _signs_in(need: frozenset, have: frozenset) -> bool:
    """Whether every sign of inf in ``need`` is in ``have`` (NaN goes with anything)."""
    return all(k in have for k in ("+inf", "-inf") if k in need)


def _could_feed(src: _Event, dst: _Event) -> bool:
    """Whether ``src``'s output can be what ``dst`` received: each sign of inf ``dst`` received, ``src`` wrote."""
    return _signs_in(dst.in_kinds, src.out_kinds)


@dataclass
class _Walk:
    """The walk back from a failure over one step and rank: its answer and what it had to guess."""
    kind: str = "in"
    """``op`` (made there), ``param`` (a non-finite parameter of it) or ``in`` (it arrived through its inputs)."""
    event: Optional[_Event] = None
    guessed: list = field(default_factory=list)
    """What was inferred, in words."""
    needs: set = field(default_factory=set)
    """What evidence would settle those guesses (``order``, ``inputs``, ``links``: ``_decide``)."""
    others: list = field(default_factory=list)
    """Other ops the failure may have started at."""


def _holders(chain: list[_Event], by_op: dict, parents: Optional[Mapping]) -> dict[str, Optional[str]]:
    """Each op call's innermost enclosing op call among the chain (by the dump's nesting, else by name)."""
    holder: dict[str, Optional[str]] = {}
    scopes = {}
    for e in chain:
        scopes.setdefault(module_path(_NUMBERED.sub("", e.op)), []).append(e.op)
    for e in chain:
        by_parent = None
        p, seen = (parents or {}).get(e.op), 0
        while p is not None and seen < 256:
            if p in by_op and p != e.op:
                by_parent = p
                break
            p, seen = parents.get(p), seen + 1
        by_name = None
        parts = _NUMBERED.sub("", e.op).split(".")
        for n in range(len(parts) - 1, -1, -1):
            cands = [c for c in scopes.get(".".join(parts[:n]), ()) if c != e.op and _inside(e.op, c)]
            if cands:
                # calls of one module path (a module called twice, or two modules named alike): the one that
                # completed first after this op, else the last one called before it
                later = [c for c in cands if by_op[c].seq >= e.seq]
                by_name = (min(later, key=lambda c: by_op[c].seq) if later
                           else max(cands, key=lambda c: by_op[c].seq))
                break
        # the deeper of the two (a dump's nesting found from the data can be coarser than its names)
        h = by_name if by_parent is None or (by_name is not None and _inside(by_name, by_parent, parents)) \
            else by_parent
        holder[e.op] = h
    return holder


def _receivers(local: list[_Event]) -> dict[frozenset, tuple[list[int], list[int]]]:
    """The op calls that received non-finite values, by the kinds they received, in order: who read what an op
    wrote is looked up by kind and place (n log n), not by scanning every later op for each."""
    receivers: dict[frozenset, tuple[list[int], list[int]]] = {}
    for kinds in {o.in_kinds for o in local if o.in_kinds}:
        got = sorted((o.seq, bool(o.out_kinds)) for o in local if o.in_kinds == kinds)
        seqs = [q for q, _ in got]
        nxt = [len(got)] * (len(got) + 1)  # index of the next receiver (from here) that wrote something itself
        for i in range(len(got) - 1, -1, -1):
            nxt[i] = i if got[i][1] else nxt[i + 1]
        receivers[kinds] = (seqs, nxt)
    return receivers


class _Walker:
    """One walk back over the op calls of one step and rank (``_walk``): the chain of calls that wrote non-finite
    values, their nesting, and what the walk guessed so far."""

    def __init__(self, local: list[_Event], start: _Event, parents: Optional[Mapping], inputs_recorded: bool):
        self.parents = parents
        self.inputs_recorded = inputs_recorded
        self.chain = chain = [e for e in local if e.out_kinds or e.params]
        self.by_op = by_op = {e.op: e for e in chain}
        if start.op not in by_op:
            chain.append(start)
            by_op[start.op] = start
        self.holder = _holders(chain, by_op, parents)
        self.kids: dict[Optional[str], list[_Event]] = {}
        for e in sorted(chain, key=lambda e: (e.seq, e.op)):
            self.kids.setdefault(self.holder[e.op], []).append(e)
        self.guessed: list[str] = []
        self.needs: set[str] = set()
        self.done: dict[str, _Walk] = {}
        self.first_at = {}
        for e in chain:
            for k in e.out_kinds:
                self.first_at.setdefault(k, e.seq)
        self.alternatives: dict[str, str] = {}  # an op that may have written what another received -> that other op
        self.receivers = _receivers(local)
        self.latest_first = sorted(chain, key=lambda o: -o.seq)

    def unseen(self, e: _Event) -> bool:
        """What ``e`` received is not recorded (an outputs-only dump)."""
        return e.no_inputs and not self.inputs_recorded and not e.in_kinds

    def received(self, e: _Event) -> bool:
        if self.unseen(e):
            # an outputs-only dump: what it received is not recorded; it is taken to have received a value when an
            # op before it (not one holding it) wrote one that explains its own (inferred, said in ``trace``)
            return any(o.seq < e.seq and _explains(o.out_kinds, e.out_kinds) and not _inside(e.op, o.op, self.parents)
                       for o in self.chain)
        if e.no_inputs and e.out_kinds - {"-inf"} and any(self.first_at.get(k, e.seq) < e.seq for k in e.out_kinds):
            # a constant holding NaN or +inf after an op wrote such values: passed through Python
            # (torch.tensor(x.item())), not made here
            return True
        return _explained(e)

    def explain(self, e: _Event, depth: int = 0) -> _Walk:
        """Where the value ``e`` wrote came from: an op, a parameter, or ``e``'s inputs (``in``)."""
        if e.op in self.done:
            return self.done[e.op]
        w = _Walk("in", e)
        inner = self.kids.get(e.op, [])
        if inner and depth < 64:
            # the op inside it that wrote its output: the last one that wrote each sign of inf its output holds
            fits = [i for i in range(len(inner) - 1, -1, -1)
                    if _signs_in(e.out_kinds, inner[i].out_kinds)]
            last = fits[0] if fits else len(inner) - 1
            w = self.trace(inner, last, depth + 1)
            for i in fits[1:8]:
                # another op inside it whose value no recorded op read may be what reached its output
                a = self.explain(inner[i], depth + 1)
                if a.kind != "in" and a.event is not None and not self.readers(inner[i]):
                    self.alternatives.setdefault(a.event.op, e.op)
            if w.kind != "in":
                self.done[e.op] = w
                return w
        if e.params:
            w = _Walk("param", e)
        elif not self.received(e):
            src = self.outside(e, w.event) if inner and w.kind == "in" and w.event is not None else None
            if src is not None:
                # what an op inside ``e`` received came from no op inside it, and ``e``'s own inputs are finite: an
                # op the dump does not place inside ``e`` (nesting found from names or data can miss one) wrote it
                self.guessed.append(f"{w.event.op} is taken to have received its value from {src.op}, which the dump "
                                    f"does not place inside {e.op}")
                sibs = self.kids[self.holder[src.op]]
                w = self.trace(sibs, sibs.index(src), depth)
                self.done[e.op] = w
                return w
            w = _Walk("op", e)
        else:
            w = _Walk("in", w.event if inner else e)
        self.done[e.op] = w
        return w

    def read(self, p: _Event) -> tuple[bool, bool]:
        """(some later op received what ``p`` wrote, one of those wrote a non-finite value itself): each sign of
        inf a receiver got, ``p`` wrote."""
        any_reader = passed_on = False
        for kinds, (seqs, nxt) in self.receivers.items():
            if not kinds & p.out_kinds or not _signs_in(kinds, p.out_kinds):
                continue
            i = bisect.bisect_right(seqs, p.seq)
            if i < len(seqs):
                any_reader = True
                passed_on = passed_on or nxt[i] < len(seqs)
        return any_reader, passed_on

    def readers(self, p: _Event) -> bool:
        """Some later op call received what ``p`` wrote."""
        return self.read(p)[0]

    def absorbed(self, p: _Event) -> bool:
        """Every op that read what ``p`` wrote wrote nothing non-finite: ``p``'s value went no further."""
        any_reader, passed_on = self.read(p)
        return any_reader and not passed_on

    def outside(self, e: _Event, x: _Event) -> Optional[_Event]:
        """The nearest op before ``x``, outside ``e`` and not holding it, that wrote what ``x`` received."""
        parents = self.parents
        return next((o for o in self.latest_first if o.seq < x.seq and o.op not in (e.op, x.op)
                     and not _inside(o.op, e.op, parents) and not _inside(e.op, o.op, parents)
                     and o.out_kinds and _could_feed(o, x)), None)

    def unread_before(self, sibs: list[_Event], i: int) -> Optional[int]:
        """For an op that made its value from finite inputs: the sibling before it whose non-finite output (of the
        signs it wrote) no recorded op read, taken to have gone into it, if any."""
        e = sibs[i]
        s = next((j for j in range(i - 1, -1, -1) if sibs[j].out_kinds
                  and _signs_in(e.out_kinds, sibs[j].out_kinds)), None)
        return s if s is not None and not self.readers(sibs[s]) else None

    def feeders(self, sibs: list[_Event], i: int) -> Optional[list[int]]:
        """The earlier siblings that may have written what ``sibs[i]`` received, the likeliest first (at most 8);
        None when none wrote every kind it received and its holder received those kinds itself."""
        e = sibs[i]
        fits = []
        for j in range(i - 1, -1, -1):
            if self.absorbed(sibs[j]):
                continue  # its value died in the ops that read it (a mask a softmax took, log(0) dropped)
            if (_explains(sibs[j].out_kinds, e.out_kinds) if self.unseen(e) else _could_feed(sibs[j], e)):
                fits.append(j)
                if len(fits) == 8:
                    break
        # an op that wrote every kind ``e`` received is a better source than one that wrote only -inf where
        # ``e`` received NaN; with none, a holder that received those kinds itself is where they came in
        strong = [j for j in fits if e.in_kinds and e.in_kinds <= sibs[j].out_kinds]
        held_by = self.by_op.get(self.holder.get(e.op) or "")
        if not strong and held_by is not None and e.in_kinds and e.in_kinds <= held_by.in_kinds:
            return None
        return strong + [j for j in fits if j not in strong]

    def trace(self, sibs: list[_Event], i: int, depth: int) -> _Walk:
        """Where the value ``sibs[i]`` wrote came from, stepping back over its earlier siblings."""
        while True:
            w = self.explain(sibs[i], depth)
            e = sibs[i]
            if w.kind == "op" and w.event is e and e.op not in self.kids and i > 0:
                # an op that made its value from finite inputs, right after one whose non-finite output no recorded
                # op read: that value went somewhere unrecorded, most likely into this op (a module the dump does
                # not show holding it: a root named apart from its children)
                s = self.unread_before(sibs, i)
                if s is not None:
                    self.guessed.append(f"{e.op} is taken to hold {sibs[s].op}, whose non-finite output no recorded "
                                        f"op read (the dump does not say what {e.op} holds)")
                    self.alternatives.setdefault(e.op, sibs[s].op)
                    i = s
                    continue
            if w.kind != "in" or i == 0:
                return w
            fits = self.feeders(sibs, i)
            if fits is None:
                return w
            j = fits[0] if fits else i - 1
            if self.unseen(e):
                self.needs.add("inputs")
                self.guessed.append(f"{e.op}'s inputs are not recorded: it is taken to have received its value from "
                                    f"{sibs[j].op}, the op before it that wrote one")
            for k in fits[1:]:
                a = self.explain(sibs[k], depth)
                if a.kind != "in" and a.event is not None:
                    self.alternatives.setdefault(a.event.op, e.op)
            i = j


def _walk(local: list[_Event], start: _Event, parents: Optional[Mapping], inputs_recorded: bool) -> _Walk:
    """Follow the failure that ``start`` (the model's output, or the last op writing a value that carries it)
    shows back through ``local`` (the op calls of one step and rank, in execution order).

    An op call's non-finite output came from the last op call inside it that wrote one (its children, by
    nesting); an op that received a value that explains its own came from the nearest earlier op call beside
    it that wrote what it received; one that received nothing of the kind made it.  Where more than one earlier
    op could have written what an op received and they lead to different answers, the nearest is followed and
    the others are listed: a guess."""
    walker = _Walker(local, start, parents, inputs_recorded)
    top = start
    while walker.holder.get(top.op) is not None:
        top = walker.by_op[walker.holder[top.op]]
    sibs = walker.kids.get(None, [])
    w = walker.trace(sibs, sibs.index(top), 0) if top in sibs else walker.explain(top)
    mine = w.event.op if w.event is not None else None
    alternatives, guessed, needs = walker.alternatives, walker.guessed, walker.needs
    others = [op for op in alternatives if op != mine]
    if others:
        needs.add("links")
        guessed.append(f"which earlier op wrote what {alternatives[others[0]]} received is taken from the order (the "
                       f"nearest one that wrote such values); {', '.join(others[:3])}{', ...' if len(others) > 3 else ''} "
                       f"wrote such values too, and the failure may have started there")
    w.guessed, w.needs, w.others = guessed, needs, others
    return w
