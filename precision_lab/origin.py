"""Where a run's first unexpected non-finite value came from: facts in, a frozen ``Origin`` out.

The analysis is pure: it reads a run's non-finite op calls and records (``RunFacts``, what the store
answers) and returns typed values; it never touches a database, so it is tested on hand-made facts.
``services.report`` reads the facts and renders the result; the Overview, the CLI, the diagnosis rules,
``bisect``/``verify`` and the localization bench all read the same ``Origin``.

The producer is the first op call, in execution order (``step``, then ``seq``, then ``rank``), whose input
records (``records.INPUT_ROLES``: inputs, keyword inputs, parameters, buffers, incoming gradients) hold no
unexpected non-finite value and one of whose output records does.  An op call is the group of records
sharing ``(step, rank, op)``.

Intended and unexpected (``intended_output``, the one rule): without a reference record to compare with, an
output whose every non-finite value is ``-inf`` is *intended* when

- a masking op wrote it (``ops.MASKING_OPS``: ``masked_fill``, ``where``, ``full``/``full_like``/
  ``new_full``, ``fill``, ``triu``/``tril``, and ``log``'s exact ``log(0)``);
- a constant wrote it (``ops.CONSTANT_OPS``: ``torch.tensor(float("-inf"))``, ``scalar_tensor``; or any op
  call that read no tensor in a run that records inputs);
- it is an additive mask: its finite values are all 0 (a 0/1 mask times ``finfo.min`` that became
  ``-inf`` in a narrower format);
- the op received ``-inf`` itself (softmax's input, a mask added to scores), or an op inside the module
  wrote it.

With a reference, a record is unexpected where it holds non-finite values the reference does not (the
comparison's ``nonfinite_introduced``, which counts positions masked in both runs as equal: see
``metrics``).  A parameter or buffer already non-finite before any op ran is itself the origin, named with
its value.  Containers pass values on: the innermost candidate is named.  When the order is unknown
(``order == "name"``) the first innermost candidate by name is named, ``certainty`` says so and ``others``
lists the rest.
"""

from __future__ import annotations

import dataclasses
import math
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
    """A run's ``order`` in words, as the reports and the Overview show it."""
    return ORDER_TEXT.get(order or "execution", order or "")


def order_known(order: Optional[str]) -> bool:
    """Whether a run's ``order`` says which op ran first."""
    return (order or "execution") not in UNKNOWN_ORDERS


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

    @property
    def producer(self) -> bool:
        """An op made the value (``origin`` is ``op``)."""
        return self.origin is OriginKind.OP

    @property
    def where(self) -> str:
        return f"step {self.step}, rank {self.rank}, seq {self.seq}"

    def with_path(self, path: Sequence[PathStep]) -> "Origin":
        return replace(self, path=tuple(path))

    def as_dict(self) -> dict:
        """The JSON form (the report's ``first_nonfinite`` entries): every field, plus ``producer``; enums as
        their words, tuples as lists."""
        d = dataclasses.asdict(self, dict_factory=_plain)
        d["producer"] = self.producer
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


def _inside(op: str, container: str, parents: Optional[Mapping] = None) -> bool:
    """Whether ``op`` ran inside ``container``: by the dump's own nesting (``parents``: op -> enclosing module
    call, msprobe's construct.json) or by name (``container``'s module path is a prefix of ``op``)."""
    if op == container:
        return False
    scope = module_path(container)
    if scope == "" or op.startswith(scope + "."):
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
        inside = any(k[:2] == (g.step, g.rank) and _inside(k[2], g.op, parents) for k in intended_scopes)
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
        out.append(_Event(**{f.name: getattr(g, f.name) for f in dataclasses.fields(NonfiniteCall)},
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
    hit, others, kind = _pick(events, known, facts.parents)
    param = _parameter(hit) if kind is OriginKind.PARAMETER else None
    rec = hit.first_rec if kind is OriginKind.OP else (hit.params[0] if param else hit.first_in)
    if kind is OriginKind.PARAMETER:
        reason = param.reason
    elif kind is OriginKind.OP and outputs_only:
        reason = (f"{hit.op} is the first module whose output is non-finite (inputs not recorded), the innermost "
                  f"one" + (f", in {order_text(order)}" if known else f" ({order_text(order)}"))
        if not known:
            reason += (f"; {len(others)} other(s) also qualify and may have run first: {', '.join(others[:5])}"
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
    certainty = Certainty.CERTAIN if known else Certainty.ORDER_UNKNOWN
    return Origin(
        run=facts.run, run_id=facts.run_id, op=hit.op, op_type=hit.op_type, direction=hit.direction,
        seq=hit.seq, step=hit.step, rank=hit.rank, rid=rec.rid, role=rec.role,
        index=rec.index, origin=kind, reason=reason, order=order, order_known=known, certainty=certainty,
        location=rec.location, parent=rec.parent, parameter=param, others=tuple(others),
        in_reference=in_reference, first_nan=first_nan, intended=intended), masks
