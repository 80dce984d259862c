"""The rows the read model answers, typed, and the one place a query's result becomes them.

A row is a frozen dataclass with slots, as the records the producers exchange are (``records.RunInfo``,
``records.StoredRecord``, ``fixes.facts``): it is read by field name only (a named tuple would also unpack and
index by position, and ``jsoncodec`` would write it as a JSON list), it cannot be changed by the page or use
case that reads it, and ``jsoncodec.jsonable`` writes it as the object of its fields in order, the keys the
query's columns had.  A run's row is ``records.RunInfo``, the dataclass the runs table is made from.

``rows_as(cls, result)`` builds them from a query's result by its description: each column fills the field of
the same name, and a column the type does not name (or a field no column fills) is an error where the query
is, not a missing key where a page reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, TypeVar

from ..metrics import Comparison
from ..records import Diagnosis, StoredRecord

__all__ = ["rows_as", "records_as", "one_as", "SessionRow", "SessionListRow", "ForwardOpCall", "WarningRow",
           "StepRow", "TimelineOp", "HeatmapCell", "HeatmapBuckets", "OpStepValues", "OpWorst",
           "RunWarning", "DiagnosisRow", "TimelineRun", "RankStepCell", "StepOp", "OutputRecord", "RecordChoice",
           "Counterpart", "ComparedPair", "RunValues", "NamedRecord", "RecordOfRun", "RecordWithData",
           "ReferenceRecords", "OpParents", "RecordIds", "ForwardEnds", "OpExtreme",
           "RecordComparison", "RankedComparison", "TableColumns"]

T = TypeVar("T")


def _names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def rows_as(cls: type[T], result) -> list[T]:
    """Every row of ``result`` (a cursor or ``reader.Result`` that ran its query) as a ``cls``; its columns must
    be ``cls``'s fields, in any order."""
    got = result.fetchall()
    columns = [d[0] for d in result.description]
    if sorted(columns) != sorted(_names(cls)):
        raise TypeError(f"{cls.__name__} has fields {list(_names(cls))}; the query answered columns {columns}")
    return [cls(**dict(zip(columns, r))) for r in got]


def records_as(cls: type[T], result) -> list[T]:
    """Every row of ``result`` as a ``cls`` whose ``from_row`` reads a mapping of the columns (a record that nests
    its statistics: ``records.StoredRecord`` and the types made from it)."""
    columns = [d[0] for d in result.description]
    return [cls.from_row(dict(zip(columns, r))) for r in result.fetchall()]


def one_as(cls: type[T], result) -> Optional[T]:
    """The first row of ``result`` as a ``cls`` (see ``rows_as``), or None."""
    got = rows_as(cls, result)
    return got[0] if got else None


@dataclass(frozen=True, slots=True)
class SessionRow:
    """A session: ``notes`` is what ingest, capture and the rules noted on it (its stored JSON, decoded)."""

    session_id: str
    name: str
    created: Optional[str]
    source: Optional[str]
    recipe: Optional[str]
    notes: dict


@dataclass(frozen=True, slots=True)
class SessionListRow:
    """A session as the list of sessions shows it, with how many runs it holds."""

    session_id: str
    name: str
    created: Optional[str]
    source: Optional[str]
    recipe: Optional[str]
    runs: int


@dataclass(frozen=True, slots=True)
class WarningRow:
    """A warning a session's ingest or capture stored: the file it is about and what was wrong."""

    session_id: str
    run_id: Optional[str]
    file: Optional[str]
    message: str


@dataclass(frozen=True, slots=True)
class RunWarning:
    """A warning as a page lists it: its run's name (None for a warning of no run), its file and message."""

    run: Optional[str]
    file: Optional[str]
    message: str


@dataclass(frozen=True)
class DiagnosisRow(Diagnosis):
    """A stored diagnosis with its run's name, as the pages list them."""

    run: Optional[str] = None


@dataclass(frozen=True, slots=True)
class ForwardOpCall:
    """A forward op call of a run: its type, where it starts in execution order, whether it holds NaN or inf."""

    op: str
    op_type: Optional[str]
    seq: int
    nonfinite: bool


@dataclass(frozen=True, slots=True)
class TimelineRun:
    """A run with a timeline: its steps (how many, the first and last) and how many ops they summarise."""

    run_id: str
    name: str
    dtype: Optional[str]
    steps: int
    first_step: int
    last_step: int
    ops: int


@dataclass(frozen=True, slots=True)
class RankStepCell:
    """One rank at one step of a timeline: the unexpected NaN/Inf values its summaries counted, and whether the
    job's GradScaler skipped that step there."""

    rank: int
    step: int
    nonfinite: float
    skipped: bool


@dataclass(frozen=True, slots=True)
class StepOp:
    """A timeline op at one step, ranks merged: its NaN and Inf counts, its largest magnitude, its first seq."""

    op: str
    role: str
    nan_count: Optional[int]
    inf_count: Optional[int]
    absmax: Optional[float]
    seq: int


@dataclass(frozen=True, slots=True)
class OutputRecord:
    """A stored output record of an op at a step: its record id, rank and name."""

    rid: int
    step: int
    rank: int
    name: str


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step of a long run: its loss and loss scale (None where not recorded), its unexpected NaN/Inf values
    (summed over ranks), the global L2 norm of its parameter gradients (ranks merged; None without any) and how
    many tensors its summaries cover."""

    step: int
    loss: Optional[float]
    loss_scale: Optional[float]
    nonfinite_values: Optional[float]
    grad_norm: Optional[float]
    tensors: int


@dataclass(frozen=True, slots=True)
class TimelineOp:
    """A series of a long run's timeline (op, role, index) with its op type and location, the first step it
    appears at and its seq there."""

    op: str
    role: str
    index: str
    op_type: Optional[str]
    location: Optional[str]
    first_step: int
    seq: int


@dataclass(frozen=True, slots=True)
class HeatmapCell:
    """A cell of the ops x steps heatmap: a series (op, role, index), the first step of its bucket, and the
    metric's value over the bucket (None where no step of it has one)."""

    op: str
    role: str
    index: str
    bucket: int
    value: Optional[float]


@dataclass(frozen=True, slots=True)
class HeatmapBuckets:
    """The cells of the ops x steps heatmap over buckets of ``width`` consecutive steps."""

    width: int
    cells: list[HeatmapCell]


@dataclass(frozen=True, slots=True)
class OpStepValues:
    """One op's values at one step, ranks merged: its largest and smallest nonzero magnitudes, its NaN, Inf and
    element counts, and of its finite values how many a format overflows and how many it rounds to zero or a
    subnormal (``low``); None where not counted."""

    step: int
    absmax: Optional[float]
    min_abs_nonzero: Optional[float]
    nan_count: Optional[int]
    inf_count: Optional[int]
    numel: Optional[int]
    finite: Optional[int]
    overflow: Optional[int]
    low: Optional[int]
    dtype: Optional[str]
    location: Optional[str]


@dataclass(frozen=True, slots=True)
class OpWorst:
    """An op of a long run over every step: its smallest headroom below a format's max (bits; None without a
    finite nonzero magnitude), the step of its largest magnitude, whether it ever held NaN or Inf, its op type
    and first seq."""

    op: str
    headroom: Optional[float]
    worst_step: Optional[int]
    nonfinite: bool
    op_type: Optional[str]
    seq: int


@dataclass(frozen=True, slots=True)
class RecordChoice:
    """A record as the op picker offers it: its id, name, where it ran and whether it holds NaN or inf."""

    rid: int
    name: str
    seq: int
    step: int
    rank: int
    nonfinite: bool


@dataclass(frozen=True, slots=True)
class Counterpart:
    """A record another was compared with: which ``side`` it is (``reference`` or ``candidate``), the comparison's
    kind and match, and the record's run (id and name), id and name."""

    side: str
    kind: str
    match: Optional[str]
    run_id: str
    rid: int
    run: str
    name: Optional[str]


@dataclass(frozen=True, slots=True)
class ComparedPair:
    """A reference and a candidate run that were compared: how many comparisons, and how the pair is labelled
    (``candidate vs reference``, by run name)."""

    ref_run_id: str
    cand_run_id: str
    rows: int
    label: str


@dataclass(frozen=True, slots=True)
class RunValues:
    """The distinct steps, ranks, roles and op types a run's records hold, ascending: what its filters offer."""

    steps: list
    ranks: list
    roles: list
    op_types: list


@dataclass(frozen=True)
class NamedRecord(StoredRecord):
    """A stored record with its name and the file it was read from (``source``), where replay reads its tensor
    back: a record of one op call (``queries.op_records``) or the reference paired with one
    (``queries.reference_of``)."""

    name: Optional[str] = None
    source: Optional[str] = None


@dataclass(frozen=True)
class RecordOfRun(NamedRecord):
    """A stored record with its run's name, kind and dtype and its session: the record an op page shows
    (``views.record``), a norm artefact the report lists (``queries.nonfinite_norms_of_finite_values``)."""

    run: Optional[str] = None
    run_kind: Optional[str] = None
    run_dtype: Optional[str] = None
    session_id: Optional[str] = None


@dataclass(frozen=True)
class RecordWithData(StoredRecord):
    """A stored record with its kept tensor's ``.npy`` bytes (None where none was kept)."""

    npy: Optional[bytes] = None


@dataclass(frozen=True, slots=True)
class ReferenceRecords:
    """The reference records paired with candidate records, by the candidate's record id."""

    by_rid: dict[int, NamedRecord]


@dataclass(frozen=True, slots=True)
class OpParents:
    """The module call each op ran inside, by op, for the ops whose dump says so (msprobe's construct.json)."""

    by_op: dict[str, str]


@dataclass(frozen=True, slots=True)
class RecordIds:
    """A run's record ids by ``(step, rank, name)``."""

    by_name: dict[tuple[int, int, str], int]


@dataclass(frozen=True, slots=True)
class ForwardEnds:
    """At one step and rank, the forward op calls with an output record that start first and last, and a record
    named as a model's output is (None when none is), by op name."""

    step: int
    rank: int
    first: str
    last: str
    named_root: Optional[str]


@dataclass(frozen=True, slots=True)
class OpExtreme:
    """An op's forward outputs: the smallest headroom below a format's max (bits; None without a finite nonzero
    value), whether one held NaN or inf, the module call it ran inside, its first seq and its type."""

    op: str
    headroom: Optional[float]
    nonfinite: bool
    parent: Optional[str]
    seq: int
    op_type: Optional[str]


@dataclass(frozen=True)
class RecordComparison(Comparison):
    """A stored comparison a record takes part in: the pair it joins, ``this_side`` (``candidate`` or
    ``reference``) the record is on and ``other``, the other run's name."""

    session_id: Optional[str] = None
    kind: Optional[str] = None
    ref_run_id: Optional[str] = None
    ref_rid: Optional[int] = None
    cand_run_id: Optional[str] = None
    cand_rid: Optional[int] = None
    step: Optional[int] = None
    rank: Optional[int] = None
    seq: Optional[int] = None
    op: Optional[str] = None
    role: Optional[str] = None
    index: Optional[str] = None
    match: Optional[str] = None
    other: Optional[str] = None
    this_side: Optional[str] = None


@dataclass(frozen=True, slots=True)
class RankedComparison:
    """A comparison as the ranking of the worst orders them (``ranking.ranked_comparisons_sql``): the candidate
    run's name (``run``) and id, the record compared (``rid``) and its reference's, where it ran and how it was
    judged."""

    run: str
    seq: int
    op: str
    role: str
    index: str
    kind: str
    basis: Optional[str]
    verdict: str
    match: Optional[str]
    nonfinite_introduced: Optional[int]
    max_abs_err: Optional[float]
    max_rel_err: Optional[float]
    summary_abs_err: Optional[float]
    summary_rel_err: Optional[float]
    cosine: Optional[float]
    cosine_deficit: Optional[float]
    sqnr_db: Optional[float]
    rounding_units: Optional[float]
    reason: Optional[str]
    run_id: str
    rid: Optional[int]
    ref_run_id: Optional[str]
    ref_rid: Optional[int]


@dataclass(frozen=True, slots=True)
class TableColumns:
    """The columns of tables, in order, with their DuckDB types: ``by_table[table][column]``."""

    by_table: dict[str, dict[str, str]]
