"""Where a run's failure started: facts in, a frozen ``Origin`` out.

The analysis is pure: it reads a run's non-finite op calls and records (``RunFacts``, what the store
answers) and returns typed values; it never touches a database, so it is tested on hand-made facts.
``services.report`` reads the facts and renders the result; the Overview, the CLI, the diagnosis rules,
``bisect``/``verify`` and the localization bench all read the same ``Origin``.

Start from the failure, not from a list of suspicious ops.  A failure is a non-finite value the run was not
meant to have in what matters: the model's output (the root module's, or the last op's in a dump without one,
``model_outputs``), a gradient, a parameter.  A run whose failures hold none is healthy, whatever NaN or inf it
holds on the way (a ``+inf`` fill that ``min`` consumes, a ``finfo.min`` mask that became ``-inf`` in fp16 and
met real scores, ``log(0)`` dropped by ``where``): those are listed as intended, never blamed.  With an fp32
reference, what the reference holds too is no failure of the lower precision.

From the failure the walk goes back (``_walk``): a module call's value came from the last op inside it that
wrote one; an op that received a value that explains its own (NaN or inf in, anything out; ``-inf`` in,
``-inf`` or NaN out) came from the nearest op before it that wrote what it received; an op whose inputs were
finite (or, with a reference, held only what the reference holds) made it, and is the answer, whatever its
type: a mask whose ``-inf`` fills a whole row that a softmax turns into NaN is named, not the softmax.  A
parameter or buffer already non-finite is itself the origin, named with its value.  An op list only orders
where the order says nothing.

Each answer says what it saw and what it inferred (``guessed``): inputs not recorded, an order recovered from
the data or from names, more than one earlier op that could have written what an op received.  It is
``certain`` only when nothing was guessed, else ``likely``, with the other candidates (``others``) and what
would settle it (``decide``).  Without the model's output (hand-made facts), the first op in order whose
inputs are finite and whose output is not is named, as before: ``_pick``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Mapping, Optional, Sequence

from .display import num_text
from .enums import Certainty, Direction, OriginKind, RunOrder
from .formats import format_for_dtype
from .ops import CONSTANT_OPS, MASKING_OPS, canonical, module_path
from .records import INPUT_ROLES, STATE_ROLES, StoredRecord
from .stats import TensorStats

__all__ = ["Origin", "OpRef", "PathStep", "ParameterOrigin", "Intended", "RunFacts", "NonfiniteCall",
           "ComparedRecord", "analyse", "ORDER_TEXT", "order_text", "order_known", "UNKNOWN_ORDERS",
           "intended_output", "is_additive_mask", "KINDS"]

# runs.order in words
ORDER_TEXT = {o.value: o.text for o in RunOrder}
# the orders that do not say which op ran first
UNKNOWN_ORDERS = frozenset(o.value for o in RunOrder if not o.known)
# what an origin can be (``OriginKind``)
KINDS = tuple(OriginKind)


def order_text(order: Optional[str]) -> str:
    """A run's ``order`` in words, as the reports and the Overview show it (a word that names no order: unknown)."""
    return RunOrder.of(order).text


def order_known(order: Optional[str]) -> bool:
    """Whether a run's ``order`` says which op ran first."""
    return RunOrder.of(order).known


def _plain(pairs) -> dict:
    """``dataclasses.asdict``'s dict factory for JSON: enum members as their words, tuples as lists."""
    return {k: v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v for k, v in pairs}


@dataclass(frozen=True)
class OpRef:
    """One op call: where it ran."""
    op: str
    """The op's name in the run (module path + op + call counter)."""
    op_type: Optional[str]
    """What it computes (``linear``, ``softmax``, a module class), where the dump says."""
    step: int
    """The training step (0 for a single forward)."""
    rank: int
    """The process (data-parallel rank) it ran in."""
    seq: int
    """Its place in execution order within its step and rank."""


@dataclass(frozen=True)
class Intended(OpRef):
    """An op call that wrote ``-inf`` that is no error by itself (a mask, a constant, ``log(0)``)."""
    count: int = 0
    """How many ``-inf`` values it wrote."""


@dataclass(frozen=True)
class PathStep:
    """One op call on the way to the origin: whether it received or wrote a non-finite value."""
    op: str
    op_type: Optional[str]
    seq: int
    nonfinite_in: bool
    """One of its input records holds NaN or inf."""
    nonfinite_out: bool
    """One of its other records (outputs) holds NaN or inf."""


@dataclass(frozen=True)
class ParameterOrigin:
    """A parameter or buffer that was non-finite before any op used it."""
    name: str
    """Module path + parameter name (``model.fc1.weight``)."""
    module_op: str
    """The op or module call whose records hold it."""
    index: str
    """The parameter's name within its module (``weight``, ``running_var``)."""
    dtype: Optional[str]
    ref_absmax: Optional[float]
    """The paired reference record's absmax (its value before the cast), None without a reference."""
    reason: str
    """One sentence: what it holds, against which format's max."""
    role: str = "param"
    """``param`` or ``buffer``."""


@dataclass(frozen=True)
class Origin:
    """Where a run's first unexpected non-finite value came from (``analyse``); ``as_dict`` is its JSON form."""
    run: str
    """The run's name."""
    run_id: str
    op: str
    """The op call named: the producer, the op reading the parameter, or the first op receiving the value."""
    op_type: Optional[str]
    """What ``op`` computes, where the dump says."""
    direction: Optional[Direction]
    """The pass ``op`` ran in, where the dump says."""
    seq: int
    """``op``'s place in execution order within its step and rank."""
    step: int
    rank: int
    rid: int
    """The record that shows it: the first unexpected output, the parameter, or the first non-finite input."""
    role: str
    """That record's role (one of ``records.ROLES``)."""
    index: str
    """That record's index (a position, or a parameter's or keyword's name)."""
    origin: OriginKind
    """What it came from: an op, a parameter (``parameter`` says which and why) or an input."""
    reason: str
    """Why, in one or two sentences with the numbers that show it."""
    order: RunOrder
    """The run's order, by which ``op`` is first."""
    order_known: bool
    """``order`` says which op ran first."""
    certainty: Certainty
    """``order unknown`` when the order is by name: then ``others`` lists the other candidates."""
    location: Optional[str] = None
    """The user code that called ``op`` (``file.py:12 in forward``), when recorded."""
    parent: Optional[str] = None
    """The module call ``op`` ran inside, where the dump says."""
    parameter: Optional[ParameterOrigin] = None
    """The parameter or buffer, when ``origin`` is ``parameter``."""
    others: tuple[str, ...] = ()
    """With the order unknown: the other innermost candidates, which may have run first."""
    in_reference: bool = False
    """The reference run holds the same non-finite values (not a precision problem)."""
    first_nan: Optional[OpRef] = None
    """The op that made the first NaN, when ``op`` made an inf and a later op turned it into NaN."""
    intended: tuple[str, ...] = ()
    """The ops that wrote ``-inf`` that is no error by itself (masks), not blamed."""
    path: tuple[PathStep, ...] = field(default=())
    """The op calls before ``op`` in its step and rank, then ``op`` (``services.report.nonfinite_origin``)."""
    guessed: tuple[str, ...] = ()
    """What the answer inferred rather than saw, in words (empty when ``certainty`` is certain)."""
    decide: Optional[str] = None
    """What would settle it, when something was guessed."""

    def __post_init__(self) -> None:
        # the words a caller or an older row gives become the enums (an unknown word is refused here)
        for name, kind in (("origin", OriginKind), ("certainty", Certainty), ("order", RunOrder),
                           ("direction", Direction)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, kind):
                object.__setattr__(self, name, kind(v))
        object.__setattr__(self, "others", tuple(self.others))
        object.__setattr__(self, "intended", tuple(self.intended))
        object.__setattr__(self, "path", tuple(self.path))
        object.__setattr__(self, "guessed", tuple(self.guessed))

    @property
    def producer(self) -> bool:
        """An op made the value (``origin`` is ``op``)."""
        return self.origin is OriginKind.OP

    @property
    def where(self) -> str:
        return f"step {self.step}, rank {self.rank}, seq {self.seq}"

    @property
    def certainty_text(self) -> str:
        """The certainty in words, as every report and the Overview show it: what was guessed and what would
        settle it."""
        if self.certainty is Certainty.CERTAIN:
            return ("certain: nothing was guessed (its inputs are recorded, and the order to every other op that "
                    "could have started it is known)")
        said = "; ".join(self.guessed) or "the run's order is unknown"
        return f"likely, not certain: {said}" + (f". What would decide: {self.decide}" if self.decide else "")

    def with_path(self, path: Sequence[PathStep]) -> "Origin":
        return replace(self, path=tuple(path))

    def as_dict(self) -> dict:
        """The JSON form (the report's ``first_nonfinite`` entries): every field, plus ``producer``; enums as
        their words, tuples as lists."""
        d = dataclasses.asdict(self, dict_factory=_plain)
        d["producer"] = self.producer
        d["certainty_text"] = self.certainty_text
        return d


@dataclass(frozen=True)
class NonfiniteCall:
    """An op call holding a NaN or inf (a row of ``store.queries.nonfinite_op_calls``)."""
    step: int
    rank: int
    op: str
    seq: int
    op_type: Optional[str]
    direction: Optional[Direction] = None
    no_inputs: bool = False
    """It has no input record at all (a constant, or an outputs-only dump)."""

    @classmethod
    def from_row(cls, row: Mapping) -> "NonfiniteCall":
        d = row.get("direction")
        return cls(int(row["step"]), int(row["rank"]), row["op"], int(row["seq"]), row.get("op_type"),
                   None if d is None else Direction(d), bool(row.get("no_inputs", False)))


@dataclass(frozen=True)
class ComparedRecord(StoredRecord):
    """A non-finite record with its stored comparison against a reference (a row of
    ``store.queries.nonfinite_records``)."""
    introduced: Optional[int] = None
    """The comparison's ``nonfinite_introduced``: non-finite values the reference does not hold; None without
    a comparison."""
    ref_absmax: Optional[float] = None
    """The paired reference record's absmax."""
    ref_nonfinite: Optional[bool] = None
    """The paired reference record holds NaN or inf."""
    match: Optional[str] = None
    masked: Optional[int] = None
    """The comparison's ``masked``: positions where the reference holds a mask's most negative value and this
    record ``-inf`` (or its own format's most negative value), compared as equal."""

    @property
    def newly_nonfinite(self) -> bool:
        """It holds non-finite values where the reference's are finite: introduced ones, or ``-inf`` where the
        reference holds a finite ``finfo.min`` (masked in both runs, but no longer a number here)."""
        return (self.introduced or 0) > 0 or ((self.masked or 0) > 0 and (self.stats.neg_inf_count or 0) > 0
                                              and not self.ref_nonfinite)


@dataclass(frozen=True)
class RunFacts:
    """What the analysis reads about one run (``services.report.run_facts`` answers it from the store)."""
    run: str
    run_id: str
    order: RunOrder
    calls: tuple[NonfiniteCall, ...]
    """The op calls holding any NaN/inf, in execution order."""
    records: tuple[ComparedRecord, ...]
    """Their non-finite records."""
    parents: Mapping[str, str] = field(default_factory=dict)
    """op -> the module call it ran in, where the dump says."""
    inputs_recorded: bool = True
    """The run records op inputs at all (an outputs-only dump does not, and there an op without input records
    is no constant)."""
    outputs: Mapping[tuple, tuple] = field(default_factory=dict)
    """(step, rank) -> ``(op, root)``: the op call that returned the model's output and whether it is the root
    (``model_outputs``); empty when not known: then every unexpected non-finite value counts as a failure and
    the first one in order is named."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "order", RunOrder.of(self.order))


@dataclass(frozen=True)
class _Event(NonfiniteCall):
    """An op call of the facts with what its non-finite records mean (``_classify``)."""
    nf_in: bool = False
    """An input holds an unexpected non-finite value (or the reference's own NaN spreads through it)."""
    nf_out: bool = False
    """An output holds an unexpected non-finite value."""
    shared_in: bool = False
    """An input carries the reference's own NaN/inf (not a mask)."""
    mask_in: bool = False
    """An input carries only expected values (a mask's ``-inf``)."""
    spread: bool = False
    """Only the reference's own NaN arrives and only NaN leaves."""
    nan_in: bool = False
    nan_out: bool = False
    intended_out: bool = False
    """Its outputs' ``-inf`` is intended (a mask, a constant) and it received nothing unexpected."""
    intended_count: int = 0
    """How many ``-inf`` its intended outputs hold."""
    first_rec: Optional[ComparedRecord] = None
    """Its first unexpected output record."""
    first_in: Optional[ComparedRecord] = None
    """Its first unexpected input record."""
    params: tuple[ComparedRecord, ...] = ()
    """Its unexpected parameter and buffer records."""
    in_kinds: frozenset = frozenset()
    """The kinds (``nan``, ``+inf``, ``-inf``) of the non-finite values it received that can carry a failure: every
    one without a reference; with one, those the reference does not hold (``newly_nonfinite``)."""
    out_kinds: frozenset = frozenset()
    """The same for what it wrote."""
    out_rec: Optional[ComparedRecord] = None
    """Its first output record that carries a failure (``out_kinds``)."""


# ---- which non-finite values are intended -----------------------------------------------------------

def is_additive_mask(st: TensorStats) -> bool:
    """Whether a tensor holding ``-inf`` is an additive mask: every non-finite value is ``-inf`` and every
    finite one is 0 (a 0/1 mask times ``finfo.min`` that overflowed to ``-inf`` in a narrower format).  From
    the counts where known, else from a summary's Min (``-inf``) and Max (0)."""
    if st.negative_inf_only is not True:
        return False
    if st.zero_count is not None and st.inf_count is not None and st.numel:
        return st.zero_count + st.inf_count == st.numel
    return st.max == 0


def intended_output(op_type: Optional[str], st: TensorStats, *, received_mask: bool, read_tensors: bool,
                    inside_intended: bool = False) -> bool:
    """Whether an output's non-finite values are no error by itself (see the module doc): the one rule the
    producer, the intended list, ``bisect``/``verify`` and the alerts share."""
    if st.negative_inf_only is not True:
        return False
    kind = canonical(op_type)
    return bool(kind in MASKING_OPS or kind in CONSTANT_OPS or not read_tensors or received_mask
                or inside_intended or is_additive_mask(st))


def _kinds(st: TensorStats) -> frozenset:
    """The kinds of non-finite value a tensor holds: ``nan``, ``+inf``, ``-inf``; from the counts where known,
    else from a summary's Min and Max; a non-finite value of no known kind counts as ``nan`` (anything)."""
    k = set()
    if (st.nan_count or 0) > 0:
        k.add("nan")
    inf = st.inf_count or 0
    if inf and st.neg_inf_count is not None:
        if st.neg_inf_count:
            k.add("-inf")
        if inf > st.neg_inf_count:
            k.add("+inf")
    elif inf or st.nan_count is None:
        for v, word in ((st.min, "-inf"), (st.max, "+inf")):
            if v is not None and math.isinf(v) and (v < 0) == (word == "-inf"):
                k.add(word)
            elif v is not None and math.isnan(v):
                k.add("nan")
    if not k and st.has_nonfinite:
        k.add("nan")
    return frozenset(k)


def _backward(op: str) -> bool:
    """Whether an op's name says it ran in the backward pass (``x.backward``, ``Functional.linear.3.backward``,
    ``Module.fc.Linear.backward.0``)."""
    return "backward" in op.split(".")


_NUMBERED = re.compile(r"^\d+[-_]")


def _inside(op: str, container: str, parents: Optional[Mapping] = None) -> bool:
    """Whether ``op`` ran inside ``container``: by the dump's own nesting (``parents``: op -> enclosing module
    call, msprobe's construct.json) or by name (``container``'s module path followed by a dot begins ``op``).
    A backward op never ran inside a forward one (``softmax.0.backward`` is not inside ``softmax.0``)."""
    if op == container or _backward(op) != _backward(container):
        return False
    # a call number a dump's file names begin with (003-layers.1.0, 009_layers.1) is no part of the module path
    bare, scope = _NUMBERED.sub("", op), module_path(_NUMBERED.sub("", container))
    if bare != _NUMBERED.sub("", container) and (scope == "" or bare.startswith(scope + ".")):
        return True
    seen = 0
    p = (parents or {}).get(op)
    while p is not None and seen < 256:  # a parent chain that loops ends here
        if p == container:
            return True
        p, seen = parents.get(p), seen + 1
    return False


def _classify(facts: RunFacts, *, use_reference: bool) -> list[_Event]:
    """Each op call of the facts with what its non-finite records mean (``_Event``).

    A record compared with a reference is unexpected when it holds non-finite values the reference does not
    (``use_reference``); one the reference lacks is judged as below when its op received only finite values
    and the run carried none of the reference's own, else taken as passed on.  Otherwise an input carrying
    only ``-inf`` is a mask (expected), and an output is judged by ``intended_output``."""
    parents = facts.parents
    by_call: dict[tuple, list[ComparedRecord]] = {}
    for r in facts.records:
        by_call.setdefault((r.step, r.rank, r.op), []).append(r)
    out: list[_Event] = []
    intended_scopes: list[tuple] = []
    carried: dict[tuple, bool] = {}  # (step, rank) -> a non-finite value the reference shares was seen
    for g in facts.calls:
        rs = by_call.get((g.step, g.rank, g.op), [])
        ins = [r for r in rs if r.role in INPUT_ROLES]
        outs = [r for r in rs if r.role not in INPUT_ROLES]
        # an op call that read no tensor at all (a constant), told apart from one whose inputs were finite
        read_tensors = bool(ins) or not facts.inputs_recorded or not g.no_inputs

        def by_reference(r: ComparedRecord) -> bool:
            """Whether the reference decides: a compared record, or (no reference tensor to compare) a received
            value, one passed on from non-finite inputs, or one made after the run already carried the
            reference's own non-finite values (through Python, e.g. torch.tensor(x.item())): those are blamed on
            the op that made the first of them."""
            return use_reference and (r.introduced is not None or r.role in INPUT_ROLES or bool(ins)
                                      or bool(carried.get((g.step, g.rank))))

        def unexpected(r: ComparedRecord) -> bool:
            if by_reference(r):
                return r.introduced is not None and int(r.introduced) > 0
            return r.stats.negative_inf_only is not True

        bad_in = [r for r in ins if unexpected(r)]
        mask_in = any(r not in bad_in for r in ins)
        # the reference's own NaN/inf arriving here (not a mask): what this op adds to them is not its doing
        shared_in = use_reference and any(r not in bad_in and r.stats.negative_inf_only is not True for r in ins)
        # only a -inf output the reference does not decide asks whether an op inside this one wrote intended -inf
        inside = any(r.stats.negative_inf_only is True and not by_reference(r) for r in outs) and any(
            k[:2] == (g.step, g.rank) and _inside(k[2], g.op, parents) for k in intended_scopes)
        bad_out, good_out = [], []
        for r in outs:
            if by_reference(r):
                (bad_out if unexpected(r) else good_out).append(r)
            elif intended_output(g.op_type, r.stats, received_mask=mask_in, read_tensors=read_tensors,
                                 inside_intended=inside):
                good_out.append(r)
            else:
                bad_out.append(r)
        if use_reference and any(r.introduced == 0 for r in rs):
            carried[(g.step, g.rank)] = True
        intended_out = (bool(good_out) and not bad_in and not mask_in
                        and all(r.stats.negative_inf_only for r in good_out))
        if intended_out:
            intended_scopes.append((g.step, g.rank, g.op))
        # the reference's own NaN arriving and only NaN leaving is their spread (a calibration poisoned by a NaN
        # row); an inf where the reference is finite is this op's own overflow, whatever else it received
        spread = shared_in and bool(bad_out) and all((r.stats.inf_count or 0) == 0 for r in bad_out)
        def carries(r: ComparedRecord) -> bool:
            """Whether ``r``'s non-finite values can carry a failure: any without a reference; with one, those it
            does not hold (the reference's own are not this run's doing, a mask's ``-inf`` where the reference
            is finite is)."""
            return not use_reference or unexpected(r) or r.newly_nonfinite

        in_kinds = frozenset().union(*(_kinds(r.stats) for r in ins if carries(r)))
        carried_out = [r for r in outs if carries(r)]
        out.append(_Event(**{f.name: getattr(g, f.name) for f in dataclasses.fields(NonfiniteCall)},
                          in_kinds=in_kinds | ({"nan"} if spread and not bad_in else frozenset()),
                          out_kinds=frozenset().union(*(_kinds(r.stats) for r in carried_out)),
                          out_rec=carried_out[0] if carried_out else None,
                          nf_in=bool(bad_in) or spread, nf_out=bool(bad_out), shared_in=shared_in,
                          mask_in=mask_in, spread=spread and not bad_in,
                          nan_in=any((r.stats.nan_count or 0) > 0 for r in bad_in),
                          nan_out=any((r.stats.nan_count or 0) > 0 for r in bad_out),
                          intended_out=intended_out,
                          intended_count=sum(int(r.stats.inf_count or 0) for r in good_out),
                          first_rec=bad_out[0] if bad_out else None, first_in=bad_in[0] if bad_in else None,
                          params=tuple(r for r in bad_in if r.role in STATE_ROLES)))
    return out


def _pick(events: list[_Event], known: bool,
          parents: Optional[Mapping] = None) -> tuple[_Event, list[str], OriginKind]:
    """(the call named, other candidates when the order is unknown, what the origin is).

    A candidate has no unexpected non-finite input and an unexpected non-finite output.  A candidate with
    another candidate inside it (same step and rank) is a module passing the value on: the innermost one is
    named.  When the first event is an op that *receives* a non-finite value no earlier op produced, a
    parameter of it (or of a module around it) that is already non-finite is the origin; else the value
    came from before the first record.  With the order unknown, parameters come first, then the innermost
    candidates of the first step and rank, the first by name named and the others listed."""
    cands = [g for g in events if g.nf_out and not g.nf_in]
    first = events[0]
    local = [g for g in events if (g.step, g.rank) == (first.step, first.rank)]
    with_params = [g for g in local if g.params]
    if known:
        if first.nf_out and not first.nf_in:
            hit = first
            lc = [g for g in cands if (g.step, g.rank) == (first.step, first.rank)]
            visited = {hit.op}
            while True:  # inward; a nesting that loops (two ops each said to hold the other) stops
                inner = next((g for g in lc if g.op not in visited and _inside(g.op, hit.op, parents)), None)
                if inner is None:
                    break
                hit = inner
                visited.add(hit.op)
            # a module inside it that holds a non-finite parameter or buffer (a dump that records a module's
            # own weights: the container's output is the first non-finite one, the weight was already inf)
            holder = next((g for g in with_params if g is hit or _inside(g.op, hit.op, parents)), None)
            if holder is None and hit.mask_in and with_params:
                # its input's -inf looked like a mask's, but a non-finite weight of this step wrote it (x * inf)
                holder = with_params[0]
            if holder is not None:
                return holder, [], OriginKind.PARAMETER
            gap = _gap_inside(local, hit, parents)
            return (gap, [], OriginKind.INPUT) if gap is not None else (hit, [], OriginKind.OP)
        holder = next((g for g in with_params if g is first or _inside(first.op, g.op, parents)), None)
        if holder is None and first.params:
            holder = first
        if holder is not None:
            return holder, [], OriginKind.PARAMETER
        return first, [], OriginKind.INPUT
    if with_params:
        return with_params[0], [], OriginKind.PARAMETER
    if not cands:
        return first, [], OriginKind.INPUT
    c0 = cands[0]
    lc = [g for g in cands if (g.step, g.rank) == (c0.step, c0.rank)]
    innermost = sorted((g for g in lc if not any(_inside(o.op, g.op, parents) for o in lc)),
                       key=lambda g: (g.seq, g.op))
    gap = _gap_inside(local, innermost[0], parents)
    if gap is not None:
        return gap, [], OriginKind.INPUT
    return innermost[0], [g.op for g in innermost[1:]], OriginKind.OP


def _gap_inside(local: list[_Event], hit: _Event, parents: Optional[Mapping]) -> Optional[_Event]:
    """The first op inside ``hit`` whose input the comparison shows newly non-finite: the value appeared inside
    ``hit`` from an op the dump does not record (a cast), so that consumer is named, not the container."""
    # a backward op is named after its forward one ("fc1.linear.0.backward") but never ran inside it
    return next((g for g in local if g.nf_in and g.first_in is not None and g.first_in.introduced
                 and g.direction == hit.direction and _inside(g.op, hit.op, parents)), None)


def _parameter(call: _Event) -> ParameterOrigin:
    """The first non-finite parameter (or buffer) of ``call``, named by its module path, with its value
    against the format."""
    r = call.params[0]
    scope = module_path(call.op)
    name = f"{scope}.{r.index}" if scope else str(r.index)
    fmt = format_for_dtype(r.dtype)
    fname = fmt.name if fmt else (r.dtype or "its dtype")
    st = r.stats
    what = " and ".join(s for s in (f"{st.nan_count:,} NaN" if st.nan_count else "",
                                    f"{st.inf_count:,} inf" if st.inf_count else "") if s) or "non-finite values"
    ref = r.ref_absmax
    noun = "buffer " if r.role == "buffer" else ""
    if ref is not None and math.isfinite(ref) and not r.ref_nonfinite and fmt is not None \
            and fmt.kind == "float" and ref >= fmt.overflow_threshold:
        reason = (f"{noun}{name} holds {ref:.1e} > {fname} max {num_text(fmt.max, grouped=True)}: {what} after the "
                  f"cast to {fname}, before any op ran")
    elif r.ref_nonfinite:
        reason = (f"{noun}{name} is already non-finite in the reference run ({what} in {fname}): the stored "
                  "weights are bad")
    else:
        reason = (f"{noun}{name} holds {what} in {fname} before any op used it (stored non-finite, or it overflowed "
                  f"when the model was cast)")
    return ParameterOrigin(name, call.op, str(r.index), r.dtype, ref, reason, r.role)


def _intended_of(calls: list[_Event]) -> list[Intended]:
    return [Intended(c.op, c.op_type, c.step, c.rank, c.seq, c.intended_count)
            for c in calls if c.intended_out and not c.nf_out]


# ---- following a failure back --------------------------------------------------------------------------

def model_outputs(ends: Sequence[Mapping], order, parents: Optional[Mapping] = None) -> dict[tuple, tuple]:
    """(step, rank) -> ``(op, root)``: the op call that returned the model's output, from
    ``store.queries.forward_ends`` rows (the forward op calls that start first and last), and whether it is
    known to be the root.  The first when it holds the last (a root recorded in call order) or the last when it
    holds the first (a root recorded as it completes): the root; else a record named as a model's output is
    (``named_root``: ``model.npy`` beside ``layers.0.npy``), or, in a known order, the last op of a dump
    without a root, taken as the output (``root`` False)."""
    known = RunOrder.of(order).known
    out = {}
    for e in ends:
        first, last = e.get("first"), e.get("last")
        key = (int(e["step"]), int(e["rank"]))
        if first is None or last is None:
            continue
        if first == last or _inside(last, first, parents):
            out[key] = (first, True)
        elif _inside(first, last, parents):
            out[key] = (last, True)
        elif e.get("named_root"):
            out[key] = (e["named_root"], False)
        elif known:
            out[key] = (last, False)
    return out


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


def _walk(local: list[_Event], start: _Event, parents: Optional[Mapping], inputs_recorded: bool) -> _Walk:
    """Follow the failure that ``start`` (the model's output, or the last op writing a value that carries it)
    shows back through ``local`` (the op calls of one step and rank, in execution order).

    An op call's non-finite output came from the last op call inside it that wrote one (its children, by
    nesting); an op that received a value that explains its own came from the nearest earlier op call beside
    it that wrote what it received; one that received nothing of the kind made it.  Where more than one earlier
    op could have written what an op received and they lead to different answers, the nearest is followed and
    the others are listed: a guess."""
    chain = [e for e in local if e.out_kinds or e.params]
    by_op = {e.op: e for e in chain}
    if start.op not in by_op:
        chain.append(start)
        by_op[start.op] = start
    # each op call's innermost enclosing op call among the chain (by the dump's nesting, else by name)
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
    kids: dict[Optional[str], list[_Event]] = {}
    for e in sorted(chain, key=lambda e: (e.seq, e.op)):
        kids.setdefault(holder[e.op], []).append(e)
    guessed: list[str] = []
    needs: set[str] = set()
    done: dict[str, _Walk] = {}

    def unseen(e: _Event) -> bool:
        """What ``e`` received is not recorded (an outputs-only dump)."""
        return e.no_inputs and not inputs_recorded and not e.in_kinds

    first_at = {}
    for e in chain:
        for k in e.out_kinds:
            first_at.setdefault(k, e.seq)

    def received(e: _Event) -> bool:
        if unseen(e):
            # an outputs-only dump: what it received is not recorded; it is taken to have received a value when an
            # op before it (not one holding it) wrote one that explains its own (inferred, said in ``trace``)
            return any(o.seq < e.seq and _explains(o.out_kinds, e.out_kinds) and not _inside(e.op, o.op, parents)
                       for o in chain)
        if e.no_inputs and e.out_kinds - {"-inf"} and any(first_at.get(k, e.seq) < e.seq for k in e.out_kinds):
            # a constant holding NaN or +inf after an op wrote such values: passed through Python
            # (torch.tensor(x.item())), not made here
            return True
        return _explained(e)

    def explain(e: _Event, depth: int = 0) -> _Walk:
        """Where the value ``e`` wrote came from: an op, a parameter, or ``e``'s inputs (``in``)."""
        if e.op in done:
            return done[e.op]
        w = _Walk("in", e)
        inner = kids.get(e.op, [])
        if inner and depth < 64:
            # the op inside it that wrote its output: the last one that wrote each sign of inf its output holds
            fits = [i for i in range(len(inner) - 1, -1, -1)
                    if _signs_in(e.out_kinds, inner[i].out_kinds)]
            last = fits[0] if fits else len(inner) - 1
            w = trace(inner, last, depth + 1)
            for i in fits[1:8]:
                # another op inside it whose value no recorded op read may be what reached its output
                a = explain(inner[i], depth + 1)
                if a.kind != "in" and a.event is not None and not readers(inner[i]):
                    alternatives.setdefault(a.event.op, e.op)
            if w.kind != "in":
                done[e.op] = w
                return w
        if e.params:
            w = _Walk("param", e)
        elif not received(e):
            src = _outside(e, w.event) if inner and w.kind == "in" and w.event is not None else None
            if src is not None:
                # what an op inside ``e`` received came from no op inside it, and ``e``'s own inputs are finite: an
                # op the dump does not place inside ``e`` (nesting found from names or data can miss one) wrote it
                guessed.append(f"{w.event.op} is taken to have received its value from {src.op}, which the dump does "
                               f"not place inside {e.op}")
                sibs = kids[holder[src.op]]
                w = trace(sibs, sibs.index(src), depth)
                done[e.op] = w
                return w
            w = _Walk("op", e)
        else:
            w = _Walk("in", w.event if inner else e)
        done[e.op] = w
        return w

    alternatives: dict[str, str] = {}  # an op that may have written what another received -> that other op

    # the op calls that received non-finite values, by the kinds they received, in order: who read what an op
    # wrote is looked up by kind and place (n log n), not by scanning every later op for each
    receivers: dict[frozenset, tuple[list[int], list[int]]] = {}
    for kinds in {o.in_kinds for o in local if o.in_kinds}:
        got = sorted((o.seq, bool(o.out_kinds)) for o in local if o.in_kinds == kinds)
        seqs = [q for q, _ in got]
        nxt = [len(got)] * (len(got) + 1)  # index of the next receiver (from here) that wrote something itself
        for i in range(len(got) - 1, -1, -1):
            nxt[i] = i if got[i][1] else nxt[i + 1]
        receivers[kinds] = (seqs, nxt)

    def read(p: _Event) -> tuple[bool, bool]:
        """(some later op received what ``p`` wrote, one of those wrote a non-finite value itself): each sign of
        inf a receiver got, ``p`` wrote."""
        any_reader = passed_on = False
        for kinds, (seqs, nxt) in receivers.items():
            if not kinds & p.out_kinds or not _signs_in(kinds, p.out_kinds):
                continue
            i = bisect.bisect_right(seqs, p.seq)
            if i < len(seqs):
                any_reader = True
                passed_on = passed_on or nxt[i] < len(seqs)
        return any_reader, passed_on

    def readers(p: _Event) -> bool:
        """Some later op call received what ``p`` wrote."""
        return read(p)[0]

    def absorbed(p: _Event) -> bool:
        """Every op that read what ``p`` wrote wrote nothing non-finite: ``p``'s value went no further."""
        any_reader, passed_on = read(p)
        return any_reader and not passed_on

    latest_first = sorted(chain, key=lambda o: -o.seq)

    def _outside(e: _Event, x: _Event) -> Optional[_Event]:
        """The nearest op before ``x``, outside ``e`` and not holding it, that wrote what ``x`` received."""
        return next((o for o in latest_first if o.seq < x.seq and o.op not in (e.op, x.op)
                     and not _inside(o.op, e.op, parents) and not _inside(e.op, o.op, parents)
                     and o.out_kinds and _could_feed(o, x)), None)

    def trace(sibs: list[_Event], i: int, depth: int) -> _Walk:
        """Where the value ``sibs[i]`` wrote came from, stepping back over its earlier siblings."""
        while True:
            w = explain(sibs[i], depth)
            e = sibs[i]
            if w.kind == "op" and w.event is e and e.op not in kids and i > 0:
                # an op that made its value from finite inputs, right after one whose non-finite output no recorded
                # op read: that value went somewhere unrecorded, most likely into this op (a module the dump does
                # not show holding it: a root named apart from its children)
                s = next((j for j in range(i - 1, -1, -1) if sibs[j].out_kinds
                          and _signs_in(e.out_kinds, sibs[j].out_kinds)), None)
                if s is not None and not readers(sibs[s]):
                    guessed.append(f"{e.op} is taken to hold {sibs[s].op}, whose non-finite output no recorded op read "
                                   f"(the dump does not say what {e.op} holds)")
                    alternatives.setdefault(e.op, sibs[s].op)
                    i = s
                    continue
            if w.kind != "in" or i == 0:
                return w
            fits = []
            for j in range(i - 1, -1, -1):
                if absorbed(sibs[j]):
                    continue  # its value died in the ops that read it (a mask a softmax took, log(0) dropped)
                if (_explains(sibs[j].out_kinds, e.out_kinds) if unseen(e) else _could_feed(sibs[j], e)):
                    fits.append(j)
                    if len(fits) == 8:
                        break
            # an op that wrote every kind ``e`` received is a better source than one that wrote only -inf where
            # ``e`` received NaN; with none, a holder that received those kinds itself is where they came in
            strong = [j for j in fits if e.in_kinds and e.in_kinds <= sibs[j].out_kinds]
            held_by = by_op.get(holder.get(e.op) or "")
            if not strong and held_by is not None and e.in_kinds and e.in_kinds <= held_by.in_kinds:
                return w
            fits = strong + [j for j in fits if j not in strong]
            j = fits[0] if fits else i - 1
            if unseen(e):
                needs.add("inputs")
                guessed.append(f"{e.op}'s inputs are not recorded: it is taken to have received its value from "
                               f"{sibs[j].op}, the op before it that wrote one")
            for k in fits[1:]:
                a = explain(sibs[k], depth)
                if a.kind != "in" and a.event is not None:
                    alternatives.setdefault(a.event.op, e.op)
            i = j

    top = start
    while holder.get(top.op) is not None:
        top = by_op[holder[top.op]]
    sibs = kids.get(None, [])
    w = trace(sibs, sibs.index(top), 0) if top in sibs else explain(top)
    mine = w.event.op if w.event is not None else None
    others = [op for op in alternatives if op != mine]
    if others:
        needs.add("links")
        guessed.append(f"which earlier op wrote what {alternatives[others[0]]} received is taken from the order (the "
                       f"nearest one that wrote such values); {', '.join(others[:3])}{', ...' if len(others) > 3 else ''} "
                       f"wrote such values too, and the failure may have started there")
    w.guessed, w.needs, w.others = guessed, needs, others
    return w


def analyse(facts: RunFacts) -> tuple[Optional[Origin], list[Intended]]:
    """``(origin, intended)`` of a run: the first unexpected non-finite value's origin (None when the run
    holds none: a run whose only NaN/inf are a mask's ``-inf`` is clean) and the op calls that wrote
    intended ``-inf``, in execution order.  ``path`` is left empty: the caller reads it (the op calls before
    the origin are not among the facts)."""
    if not facts.calls:
        return None, []
    compared = any(r.introduced is not None for r in facts.records)
    calls = _classify(facts, use_reference=compared)
    in_reference = False
    # with a reference, values it shares are no event: a later op that adds its own (an fp16-only overflow after
    # a 0/0 row the fp32 run has too) is still the answer
    first_event = next((c for c in calls if c.nf_in or c.nf_out), None)
    if compared and (first_event is None or first_event.spread):
        # nothing was introduced by the lower precision before the reference's own NaN spread: the reference has
        # the same non-finite values, and the op that made them there is the answer
        calls = _classify(facts, use_reference=False)
        in_reference = True
    masks = _intended_of(calls)
    intended = tuple(m.op for m in masks)
    events = [c for c in calls if c.nf_in or c.nf_out]
    if not events:
        return None, masks
    order = facts.order
    known = order.known
    outputs_only = not facts.inputs_recorded
    guessed: list[str] = []
    needs: set[str] = set()
    failure = _failure(calls, facts) if facts.outputs else None
    walked = failure is not None and failure is not False
    if failure is None and not known and not any((c.out_kinds | c.in_kinds) - {"-inf"} for c in calls):
        # neither the order nor the model's output is known, and every non-finite value is -inf: nothing became
        # NaN or +inf, as a failure that passes through a layer does (-inf times weights of both signs is NaN)
        return None, _writers(calls)
    if failure is False:
        # nothing unexpected reaches the model's output, a gradient or a parameter: every non-finite value was
        # intended, whatever wrote it
        return None, _writers(calls)
    if walked:
        key, start, failed = failure
        local = [c for c in calls if (c.step, c.rank) == key]
        w = _walk(local, start, facts.parents, facts.inputs_recorded)
        hit, others, guessed, needs = w.event, list(w.others), list(w.guessed), set(w.needs)
        kind = {"op": OriginKind.OP, "param": OriginKind.PARAMETER}.get(w.kind, OriginKind.INPUT)
        if kind is OriginKind.OP and others:
            # several ops made values that may each have reached the failure (q, k and v of one attention, each
            # quantised with a zero row's scale): the first of them in order is where it started
            pool = [hit] + [c for c in local if c.op in others and not c.params and c.out_kinds >= hit.out_kinds]
            earliest = min(pool, key=lambda c: (c.seq, c.op))
            if earliest is not hit:
                others = [hit.op] + [o for o in others if o != earliest.op]
                hit = earliest
        if kind is OriginKind.OP:
            gap = _gap_inside(local, hit, facts.parents)
            if gap is not None:
                hit, kind = gap, OriginKind.INPUT
        if order is not RunOrder.EXECUTION:
            rivals = [c.op for c in local if c.out_kinds and not _explained(c) and c.op != hit.op
                      and not _inside(c.op, hit.op, facts.parents) and not _inside(hit.op, c.op, facts.parents)
                      and c.op not in others and not any(_inside(o.op, c.op, facts.parents) for o in local
                                                         if o.out_kinds and not _explained(o))]
            others += rivals
            if not known or others:
                needs.add("order")
            if not known:
                guessed.append(f"the run's order is unknown: the ops are placed by name and by how many non-finite "
                               f"values they hold, so which op wrote what {hit.op} is blamed for is inferred")
            elif others:
                guessed.append(f"the run's order is {order_text(order)}: that {hit.op} ran before "
                               f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''} (which also wrote "
                               "non-finite values from finite inputs) is inferred")
        if kind is OriginKind.OP and hit.no_inputs and outputs_only:
            needs.add("inputs")
            guessed.append(f"{hit.op}'s inputs are not recorded: that they were finite is inferred")
    else:
        hit, others, kind = _pick(events, known, facts.parents)
        failed = None
        if not known and others:
            needs.add("order")
            guessed.append(f"the run's order is unknown: {hit.op} is first by name; {', '.join(others[:3])}"
                           f"{', ...' if len(others) > 3 else ''} may have run first")
        if kind is OriginKind.OP and hit.no_inputs and outputs_only:
            needs.add("inputs")
            guessed.append(f"{hit.op}'s inputs are not recorded: that they were finite is inferred")
    param = _parameter(hit) if kind is OriginKind.PARAMETER else None
    by_call = [r for r in facts.records if (r.step, r.rank, r.op) == (hit.step, hit.rank, hit.op)]
    if kind is OriginKind.OP:
        rec = hit.first_rec or hit.out_rec
    elif param:
        rec = hit.params[0]
    else:
        rec = hit.first_in or next((r for r in by_call if r.role in INPUT_ROLES), None)
    rec = rec or hit.first_rec or hit.out_rec or by_call[0]
    if walked:  # the module holding the origin (or an op inside it) wrote its value: not listed as intended
        intended = tuple(m.op for m in masks if m.op != hit.op and not _inside(hit.op, m.op, facts.parents)
                         and not _inside(m.op, hit.op, facts.parents))
    if kind is OriginKind.PARAMETER:
        reason = param.reason
    elif kind is OriginKind.OP and outputs_only:
        reason = (f"{hit.op} is the first module whose output is non-finite (inputs not recorded), the innermost "
                  f"one" + (f", in {order_text(order)}" if known else f" ({order_text(order)}"))
        if not known:
            reason += (f"; {len(others)} other(s) also qualify and may have run first: {', '.join(others[:5])}"
                       f"{', ...' if len(others) > 5 else ''})" if others else ")")
    elif kind is OriginKind.OP and walked:
        reason = f"{hit.op} is where the failure starts: its inputs are all finite and its {rec.role} {rec.index} is not"
        if rec.stats.negative_inf_only:
            reason += _mask_words(rec, failed)
        elif failed:
            reason += f"; that value reaches {failed}"
        if not known:
            reason += f" ({order_text(order)}" + (
                f"; {len(others)} other(s) also qualify and may have run first: {', '.join(others[:5])}"
                f"{', ...' if len(others) > 5 else ''})" if others else ")")
    elif kind is OriginKind.OP and known:
        reason = (f"{hit.op} is the first op whose inputs are all finite and whose {rec.role} "
                  f"{rec.index} is not")
    elif kind is OriginKind.OP:
        reason = (f"{hit.op}: its inputs are all finite and its {rec.role} {rec.index} is not, and no op "
                  f"inside it is like that ({order_text(order)}, so the innermost such op is named")
        reason += (f"; {len(others)} other(s) also qualify and may have run first: {', '.join(others[:5])}"
                   f"{', ...' if len(others) > 5 else ''})" if others else ")")
    elif rec.introduced and not in_reference:
        # a gap: the comparison shows this input newly non-finite, and no recorded op wrote it
        reason = (f"{hit.op} receives a {rec.role} {rec.index} that is newly non-finite (the reference's is "
                  "finite), and no recorded op produced it: its producer was not recorded (likely a cast or a view, "
                  "e.g. Tensor.to, which some dumpers leave out)")
    else:
        reason = (f"{hit.op} already receives a non-finite {rec.role} {rec.index}; no recorded op "
                  "produced it (it comes from before the first recorded op, e.g. the model's inputs)")
        if not known:
            reason += f" ({order_text(order)})"
    if in_reference:
        reason += "; the reference run holds the same non-finite values"
    if intended:
        reason += (f" ({len(intended)} op(s) wrote -inf that is no error by itself (a mask, a constant, or log(0)) "
                   f"and are not blamed: {', '.join(intended[:3])}{', ...' if len(intended) > 3 else ''})")
    first_nan = None
    if kind is OriginKind.OP and known and not hit.nan_out:
        nan_hit = next((c for c in events if c.nan_out and not c.nan_in
                        and (c.step, c.rank, c.seq) >= (hit.step, hit.rank, hit.seq)), None)
        if nan_hit is not None and nan_hit.op != hit.op:
            first_nan = OpRef(nan_hit.op, nan_hit.op_type, nan_hit.step, nan_hit.rank, nan_hit.seq)
    certainty = Certainty.LIKELY if guessed else Certainty.CERTAIN
    return Origin(
        run=facts.run, run_id=facts.run_id, op=hit.op, op_type=hit.op_type, direction=hit.direction,
        seq=hit.seq, step=hit.step, rank=hit.rank, rid=rec.rid, role=rec.role,
        index=rec.index, origin=kind, reason=reason, order=order, order_known=known, certainty=certainty,
        location=rec.location, parent=rec.parent, parameter=param, others=tuple(others),
        in_reference=in_reference, first_nan=first_nan, intended=intended, guessed=tuple(guessed),
        decide=_decide(needs, known, outputs_only, compared) if guessed else None), masks


def _failure(calls: list[_Event], facts: RunFacts):
    """What failed first: ``(step and rank, the op call to walk back from, the failure in words)``; False when
    nothing unexpected reaches the model's output, a gradient or a parameter (the run is healthy)."""
    keys = list(dict.fromkeys((c.step, c.rank) for c in calls))
    for key in keys:
        local = [c for c in calls if (c.step, c.rank) == key]
        out, root = facts.outputs.get(key, (None, False))
        if root and any(c.nf_out and c.op != out and not _inside(c.op, out, facts.parents) for c in local):
            root = False  # an op not inside it wrote a failure: it is no root (a nesting found from the data)
        sink = next((c for c in local if c.op == out), None)
        if sink is not None and sink.nf_out:
            return key, sink, f"the model's output ({sink.op})" if root else f"the last op's output ({sink.op})"
        grads = [c for c in local if c.direction is Direction.BACKWARD and c.nf_out]
        if grads:
            return key, grads[-1], f"the gradients ({grads[-1].op})"
        held = [c for c in local if any(_state_failed(r) for r in c.params)]
        if held:
            return key, held[0], f"a parameter of {held[0].op}"
        if out is None or (not root and any(c.first_rec is not None and (c.first_rec.introduced or 0) > 0
                                            for c in local)):
            # this step and rank's output is not known, or only guessed (a dump without a root, which may leave
            # the model's output out) while the reference shows values newly non-finite: those are the failure
            bad = [c for c in local if c.nf_out]
            if bad:
                return key, bad[-1], f"{bad[-1].op}'s output"
    return False


def _state_failed(r: ComparedRecord) -> bool:
    """Whether a non-finite parameter or buffer is a failure by itself: a parameter always; a buffer when the
    reference holds finite values there (a running variance that overflowed in the cast), or, without a
    reference, when it holds finite values beside the non-finite ones.  A buffer of nothing but +-inf (the start
    of a running min, TransformerLens's ``IGNORE``) is a constant, a failure only where its value reaches one."""
    if r.role != "buffer":
        return True
    if r.introduced is not None:
        return r.newly_nonfinite
    st = r.stats
    return not (st.numel and (st.inf_count or 0) + (st.nan_count or 0) == st.numel)


def _writers(calls: list[_Event]) -> list[Intended]:
    """Every op call that wrote a non-finite value it did not receive, in execution order: in a run whose
    failures hold none, each of them was intended."""
    return [Intended(c.op, c.op_type, c.step, c.rank, c.seq,
                     sum(int((r.stats.nan_count or 0) + (r.stats.inf_count or 0)) for r in (c.out_rec,) if r))
            for c in calls if (c.out_kinds or c.intended_out) and not _explained(c) and not c.mask_in] or \
        _intended_of(calls)


def _mask_words(rec: ComparedRecord, failed: Optional[str]) -> str:
    """Why a ``-inf`` that looks like a mask's is blamed: it reaches the failure (a fully masked row becomes NaN),
    and, where the reference holds a finite ``finfo.min`` there, the cast is what made it ``-inf``."""
    words = "; its -inf looks like a mask's, but it reaches " + (failed or "the failure")
    if rec.newly_nonfinite and (rec.masked or 0) > 0:
        fmt = format_for_dtype(rec.dtype)
        words += (f" (where the reference holds a finite mask value, below -{num_text(fmt.max, grouped=True)}, "
                  f"{fmt.name}'s most negative number: it became -inf in the cast)" if fmt is not None and
                  fmt.kind == "float" else " (the reference holds a finite value there)")
    return words + ": a row masked throughout turns into NaN where -inf meets -inf (softmax, 0 x -inf, -inf - -inf)"


def _decide(needs: set[str], known: bool, outputs_only: bool, compared: bool) -> str:
    """What would settle an answer that guessed: the evidence it lacked (``needs``: ``order``, ``inputs``,
    ``links``)."""
    need = []
    if not known or "order" in needs:
        need.append("the order the ops ran in (an order list, such as a manifest's call order, or a capture)")
    if outputs_only or "inputs" in needs:
        need.append("each op's inputs (a dump that records inputs as well as outputs)")
    if "links" in needs:
        need.append("which op's output each op read (tensor dumps, whose values link outputs to inputs)"
                    + ("" if compared else ", or an fp32 reference run, which shows which non-finite values are new"))
    return "; ".join(need) or "a capture of the run (order, inputs and a reference recorded)"
