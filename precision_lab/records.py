"""The records every layer exchanges.  Store columns are derived from these."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from operator import attrgetter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from .hostview import host_view
from .stats import TensorStats

__all__ = ["code_location", "TensorRecord", "StoredRecord", "RunInfo", "Diagnosis", "TimelineRow", "TimelineShare", "StepScalar", "tensor_name", "ROLES", "INPUT_ROLES", "OUTPUT_ROLES", "GRAD_ROLES", "STATE_ROLES", "NAMING_SEVERITIES", "split_tensor_name", "free_name", "to_numpy",
           "npy_bytes", "npy_load", "record_columns",
           "stats_columns", "dataclass_columns", "shape_json", "ColumnValues", "record_column_values"]

# input/output of a forward op; grad_input/grad_output of a backward op
# (msprobe's backward "input" is the gradient flowing in = grad_output in torch
# terms; we keep the dump's own words); param/param_grad for parameters; buffer for a module's
# floating-point buffers (BatchNorm's running statistics), recorded like parameters, without gradients.
ROLES = ("input", "output", "kwarg", "param", "buffer", "grad_input", "grad_output", "param_grad", "tensor")
# what flows into an op call (a backward call's grad_output included): a NaN there was made elsewhere
INPUT_ROLES = ("input", "kwarg", "param", "buffer", "grad_output")
# a module's own state, recorded once per step on its first call: made before any op ran
STATE_ROLES = ("param", "buffer")
# what an op makes: its outputs, or a dump's free tensors (role tensor: a name that says no op or role)
OUTPUT_ROLES = ("output", "tensor")
# the gradients, recorded on the backward pass
GRAD_ROLES = ("grad_input", "grad_output", "param_grad")


def tensor_name(op: str, role: str, index: int | str) -> str:
    return f"{op}.{role}.{index}"


_NAME_RE = re.compile(r"^(?P<op>.+)\.(?P<role>" + "|".join(r for r in ROLES if r != "tensor")
                      + r")\.(?P<index>[^.]+)$")


def split_tensor_name(name: str) -> Optional[tuple[str, str, str]]:
    """``'blocks.0.fc1.output.0'`` -> ``('blocks.0.fc1', 'output', '0')``; None if not of that form."""
    m = _NAME_RE.match(name)
    return (m["op"], m["role"], m["index"]) if m else None


def free_name(base: str, taken, pattern: str = "{base}-{i}") -> str:
    """``base`` if it is not in ``taken``, else ``pattern`` with the smallest ``i >= 2`` that is free.

    Session and run names are chosen this way so a new one never replaces an old one.
    """
    if base not in taken:
        return base
    i = 2
    while pattern.format(base=base, i=i) in taken:
        i += 1
    return pattern.format(base=base, i=i)


def code_location(filename: str, line: int, function: str) -> str:
    """A line of code as records show it: ``"model/model.py:16 in forward"`` (at most the path's last three
    parts)."""
    parts = [p for p in re.split(r"[\\/]", filename) if p]
    return f"{'/'.join(parts[-3:])}:{int(line)} in {function}"


@dataclass
class TensorRecord:
    """Where one tensor came from, with its statistics.

    ``seq`` is execution order within a run (per step and rank).  ``op`` is
    stable across runs of the same model (module path + op + call counter),
    which is what pairs a reference with a candidate.  ``index`` is a string
    so dict keys (``weight``, ``bias``) and positions share one column.
    ``tensor`` is kept only when asked for (exact comparison, replay); it is
    not a store column.
    """

    run_id: str
    seq: int
    op: str
    op_type: str
    role: str
    index: str
    stats: Any  # precision_lab.stats.TensorStats
    step: int = 0
    rank: int = 0
    direction: str = "forward"  # forward | backward
    source: str = ""  # file it was read from, or "capture"
    parent: Optional[str] = None  # the op (module call) this one ran inside, where the dump says (msprobe)
    location: Optional[str] = None  # the user code that called the op ("file.py:123 in forward"), when known
    tensor: Any = field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        return tensor_name(self.op, self.role, self.index)


@dataclass(frozen=True)
class StoredRecord:
    """One stored tensor record as the analyses read it (a row of the tensors table, typed once where the query
    answers it: ``StoredRecord.from_row``)."""

    rid: int  # unique within the run
    run_id: str
    op: str
    op_type: Optional[str]
    role: str  # one of ``ROLES``
    index: str
    step: int
    rank: int
    seq: int
    direction: Optional[str]  # forward | backward
    nonfinite: bool  # holds NaN or inf (the stored flag)
    stats: TensorStats  # counts None where the source did not give them (a summary-only record)
    location: Optional[str] = None  # the user code that called the op, when known
    parent: Optional[str] = None  # the module call it ran inside, where the dump says

    @classmethod
    def from_row(cls, row, hist: Optional[np.ndarray] = None) -> "StoredRecord":
        """A row of the tensors table (a mapping of its columns), with its histogram when given; a subclass's
        own fields are read from the row's columns of the same name."""
        own = {f.name for f in dataclasses.fields(StoredRecord)}
        return cls(rid=int(row["rid"]), run_id=row.get("run_id"), op=row["op"], op_type=row.get("op_type"),
                   role=row["role"], index=str(row["index"]), step=int(row["step"]), rank=int(row["rank"]),
                   seq=int(row["seq"]), direction=row.get("direction"), nonfinite=bool(row.get("nonfinite")),
                   stats=TensorStats.from_row(row, hist), location=row.get("location"), parent=row.get("parent"),
                   **{f.name: row.get(f.name) for f in dataclasses.fields(cls) if f.name not in own})

    @property
    def dtype(self) -> str:
        return self.stats.dtype

    @property
    def magnitude(self) -> Optional[float]:
        """Its largest finite magnitude: ``absmax``, else the larger of ``|min|`` and ``|max|`` (a summary that
        gives only those, or ``absmax`` NaN: no finite value); None when neither says."""
        a, mn, mx = self.stats.absmax, self.stats.min, self.stats.max
        if a is not None and not (isinstance(a, float) and math.isnan(a)):
            return float(a)
        return None if mn is None or mx is None else max(abs(mx), abs(mn))


@dataclass(frozen=True)
class RunInfo:
    """A run: a row of the runs table (which is made from these fields), as the store answers it."""

    run_id: str
    session_id: str
    name: str
    dtype: str = ""  # dominant compute dtype, e.g. float16
    kind: str = "candidate"  # reference | candidate | rerun
    parent_run_id: Optional[str] = None
    fix: Optional[str] = None  # fix spec(s) that made this run from its parent
    policy: Optional[str] = None  # JSON of the precision policy, when known
    source: str = ""  # folder/zip path, recipe name, or "capture"
    order: str = "execution"  # execution | name (when a dump carries no order)
    created: Optional[str] = None


# a diagnosis of these severities names the op where its failure was introduced or amplified, not where it
# shows (an ``info`` one reports on the run: a fix verified, a compiled graph): the ranking of the worst
# comparisons (``store.views.top_offenders``) puts that op's outputs ahead of the ops that only carry it on.
# Which rules name an op is declared where each is registered (``fixes.rulebook``: ``names_op``), which gives
# their findings these severities and the others ``info``
NAMING_SEVERITIES = ("error", "warn")


@dataclass(frozen=True)
class Diagnosis:
    session_id: str
    run_id: str
    op: str
    rule: str
    message: str
    fixes: tuple[str, ...] = ()
    severity: str = "error"  # error | warn | info
    seq: int = -1

    def fixes_json(self) -> str:
        return json.dumps(list(self.fixes))

    @staticmethod
    def decode_fixes(stored) -> tuple[str, ...]:
        """A stored ``fixes`` column as the tuple ``fixes_json`` encoded, best first (None: none; a value that is
        not a JSON list of specs, from an older or foreign database, is one fix as written)."""
        if not stored:
            return ()
        try:
            got = json.loads(stored)
        except ValueError:
            return (str(stored),)
        if isinstance(got, list):
            return tuple(str(f) for f in got)
        return (str(got),)


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """One op's summary at one step of a long run: what the timeline, its alerts and its heatmaps read.

    ``tid`` is unique within the run.  Values are those of the op's
    ``TensorStats`` (finite values only; counts of NaN and +/-inf apart).
    """

    run_id: str
    tid: int
    step: int
    rank: int
    seq: int
    op: str
    op_type: str
    role: str
    index: str
    direction: str
    dtype: str
    numel: int
    nan_count: Optional[int]
    inf_count: Optional[int]
    neg_inf_count: Optional[int]
    zero_count: Optional[int]
    absmax: Optional[float]
    min_abs_nonzero: Optional[float]
    l2norm: Optional[float]
    location: Optional[str] = None


@dataclass(frozen=True, slots=True)
class TimelineShare:
    """How one timeline row's values would land in one watched format (``Representability`` counts)."""

    run_id: str
    tid: int
    fmt: str
    finite: int
    overflow: int
    underflow: int
    subnormal: int


@dataclass(frozen=True, slots=True)
class StepScalar:
    """A number of a whole step: ``loss``, ``loss_scale`` (a GradScaler's scale)."""

    run_id: str
    step: int
    rank: int
    name: str
    value: Optional[float]


# ---- a kept tensor as bytes ----------------------------------------------------------

def to_numpy(t) -> np.ndarray:
    """A tensor or array as a numpy array that survives ``.npy`` (bf16/fp8 widened to float32, exactly)."""
    if isinstance(t, np.ndarray):
        # ml_dtypes arrays (bfloat16, fp8: kind "V", and float8_e5m2, whose kind "f" writes a '<f1' numpy cannot
        # read back) do not survive .npy; float32 holds their values exactly
        return t.astype(np.float32) if t.dtype.kind == "V" or t.dtype.type.__module__ == "ml_dtypes" else t
    t = t.detach().cpu()
    if "bfloat16" in str(t.dtype) or "float8" in str(t.dtype):
        return t.float().numpy()  # a new tensor: its own storage
    return host_view(t)


def npy_bytes(t) -> bytes:
    """``.npy`` bytes of a tensor (no pickles)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(to_numpy(t)), allow_pickle=False)
    return buf.getvalue()


def npy_load(b: bytes) -> np.ndarray:
    """The array of ``npy_bytes`` (pickled objects refused)."""
    return np.load(io.BytesIO(b), allow_pickle=False)


# ---- the columns a record becomes (the store and the shards derive their schemas from these) ----

def _kind(annotation) -> Optional[str]:
    """``int``/``float``/``str``/``bool`` for a field's annotation; None for fields that are not columns."""
    a = (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation)))
    a = a.replace("typing.", "").replace(" ", "")
    m = re.fullmatch(r"Optional\[(.+)\]", a) or re.fullmatch(r"(.+)\|None", a)
    if m:
        a = m.group(1)
    if a in ("int", "bool", "float", "str"):
        return a
    if a.startswith("np.ndarray") or a == "Any":
        return None
    return "str"  # tuples and the rest are stored as JSON text


def dataclass_columns(cls, skip=()) -> list[tuple[str, str]]:
    """(name, kind) of a record dataclass's column fields."""
    return [(f.name, k) for f in dataclasses.fields(cls) if f.name not in skip and (k := _kind(f.type))]


def stats_columns() -> list[tuple[str, str]]:
    """(name, kind) of ``TensorStats`` as columns (the histogram is stored apart; the shape as JSON text)."""
    out = []
    for f in dataclasses.fields(TensorStats):
        if f.name == "hist":
            continue
        k = "str" if f.name == "shape" else _kind(f.type)
        if k:
            out.append((f.name, k))
    return out


def record_columns() -> list[tuple[str, str]]:
    """(name, kind) of one stored tensor record: rid, record fields, stats fields, derived flags."""
    return ([("rid", "int")] + dataclass_columns(TensorRecord, skip=("stats", "tensor")) + stats_columns()
            + [("name", "str"), ("nonfinite", "bool"), ("has_hist", "bool")])


def shape_json(shape) -> str:
    """A shape as stored: JSON text of its sizes ("null" when unknown)."""
    # a list of ints prints as its JSON text does
    return str([int(s) for s in shape]) if shape is not None else "null"


_RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(TensorRecord))
_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(TensorStats))


@dataclass(frozen=True)
class ColumnValues:
    """Records as columns: ``by_name[column]`` is the list of that column's values, one per record."""

    by_name: dict[str, list]


def record_column_values(records: Sequence[TensorRecord], names) -> ColumnValues:
    """The values of the named ``record_columns()`` (``rid`` aside) over ``records``, whose statistics are
    computed, one list per column: what the store's tensors rows and a shard's columns hold, built a column at a
    time (no Python branch per value)."""
    stats = [r.stats for r in records]
    out: dict[str, list] = {}
    for n in names:
        if n == "shape":
            out[n] = [shape_json(s.shape) for s in stats]
        elif n == "name":
            out[n] = [r.name for r in records]
        elif n == "nonfinite":
            out[n] = [s.has_nonfinite for s in stats]
        elif n == "has_hist":
            out[n] = [s.hist is not None for s in stats]
        elif n in _STATS_FIELDS:
            out[n] = list(map(attrgetter(n), stats))
        elif n in _RECORD_FIELDS:
            out[n] = list(map(attrgetter(n), records))
        else:
            out[n] = [None] * len(records)
    return ColumnValues(out)
