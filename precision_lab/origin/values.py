"""The origin analysis' values: the facts it reads (``RunFacts``, ``NonfiniteCall``, ``ComparedRecord``) and the
frozen answer it returns (``Origin`` and its parts), with the run orders in words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Mapping, Optional, Sequence

from ..enums import Certainty, Direction, OriginKind, RunOrder
from ..records import StoredRecord

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
