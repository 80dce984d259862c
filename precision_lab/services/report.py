"""What went wrong in a session: first non-finite producer, norm artefacts,
comparisons, as a stable JSON document and as a human-readable table.

First non-finite producer of a run, intended ``-inf`` and inherited values: ``precision_lab.origin``
(``analyse`` over the run's facts, which ``run_facts`` reads from the store).

Norm artefacts: a non-finite Norm (or Mean) with finite Max/Min is *not* non-finite: the dump computed the
norm in the tensor's own dtype and the sum of squares overflowed; such records are listed apart.

The report (``build_report``, a frozen ``Report``) is written as JSON by ``to_json``: each field a key, in the
order declared: ``session``, ``created``, ``source``, ``runs``,
``first_nonfinite`` (per run, ``origin.Origin.as_dict()`` or null), ``ranks`` (per run, its other ranks'
states), ``intended_nonfinite`` (per run, the ops that wrote a mask's ``-inf``), ``norm_artefacts``, ``tensors``, ``comparisons``,
``worst_comparisons`` (the ``WORST_KEPT`` worst, as Top offenders ranks them, non-finite ones included), ``diagnoses`` (``cards.DiagnosisCard``: errors first, then by execution order, as the Overview and the HTML report show them), ``fixes_tried`` (each re-run judged against the run it fixes: ``verdicts.Verification``), ``warnings``, ``alerts`` (a long run's alerts: run, op, step, rule, message, value,
threshold, steps_firing; see ``precision_lab.alerts``), ``timeline`` (per run with a timeline: the first
non-finite step, the steps with full records, and one row per step: loss, loss_scale, nonfinite_values,
grad_norm) and ``notes``.  Non-finite numbers are written
as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` so the document is
strict JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional

from ..alerts import Alert
from ..display import cosine_brief, num_text
from ..formats import format_for_dtype
from ..origin import ORDER_TEXT, Intended, Origin, order_text
from ..store import queries as q
from ..store import ranking
from ..store.rows import RunWarning, StepRow
from ..jsoncodec import dumps
from . import timeline as _timeline
from .cards import DiagnosisCard, diagnosis_cards
from .verdicts import Verification, verification
from .origins import (PATH_LENGTH, FiniteRank, RankOrigin, RankState, finite_text, first_nonfinite,
                      intended_nonfinite, nonfinite_origin, producer_text, rank_spread, run_facts)

__all__ = ["first_nonfinite", "intended_nonfinite", "nonfinite_origin", "run_facts", "norm_artefacts", "build_report",
           "order_notes", "OrderNotes", "NormArtefact", "FiniteRank", "RankOrigin", "RankState", "Report", "ReportRun",
           "ReportTensor", "ReportComparison", "WorstComparison", "ReportTimeline",
           "render_text", "to_json", "fix_tried_text", "PATH_LENGTH", "ORDER_TEXT", "order_text"]

@dataclass(frozen=True, slots=True)
class OrderNotes:
    """The order each run's dump gave, in words, with which parts are certain, by run id (runs ingest did not say
    for are left out)."""

    by_run: dict[str, str]

    def get(self, run_id: Optional[str], default: Optional[str] = None) -> Optional[str]:
        return self.by_run.get(run_id, default)


@dataclass(frozen=True, slots=True)
class NormArtefact:
    """A record whose Norm or Mean is NaN/Inf while its values are finite: where it is, its statistics, the
    float64 bound ``sqrt(numel) * absmax`` on its true norm, and why it is no non-finite value."""

    run: str
    run_id: str
    rid: int
    step: int
    rank: int
    seq: int
    op: str
    role: str
    index: str
    dtype: Optional[str]
    min: float
    max: float
    mean: Optional[float]
    l2norm: Optional[float]
    norm_bound_f64: float
    reason: str


def order_notes(store, session: str) -> OrderNotes:
    """run_id -> the order its dump gave, in words, with which parts are certain (what ingest recorded in the
    session's notes: an order list and whether it is call or completion order, file times and their ties, links
    found in the data); runs it did not say for are left out."""
    runs = (store.session(session).notes.get("ingest") or {}).get("runs") or {}
    return OrderNotes({v["run_id"]: v["order_from"] for v in runs.values()
                       if isinstance(v, dict) and v.get("run_id") and v.get("order_from")})


def norm_artefacts(store, session_id: str) -> list[NormArtefact]:
    """Records whose Norm or Mean is NaN/Inf while their values are finite.

    That happens when a dump computed the norm (or mean) in the tensor's own
    low-precision dtype: the sum of squares overflowed, not the tensor.
    ``reason`` says so in the format's terms and gives the float64 bound
    ``sqrt(numel) * absmax`` on the true norm.
    """
    rows = q.nonfinite_norms_of_finite_values(store, session_id)
    out = []
    for r in rows:
        fmt = format_for_dtype(r.dtype)
        fname = fmt.name if fmt else (r.dtype or "its dtype")
        absmax = max(abs(r.stats.min), abs(r.stats.max))
        bound = math.sqrt(r.stats.numel or 0) * absmax
        which = [n for n, v in (("Norm", r.stats.l2norm), ("Mean", r.stats.mean))
                 if v is not None and not math.isfinite(v)]
        what = "/".join(which)
        reason = (f"{fname} norm-arithmetic artefact: {what} is {num_text(r.stats.l2norm if 'Norm' in which else r.stats.mean)}"
                  f" while Max {num_text(r.stats.max)} and Min {num_text(r.stats.min)} are finite. The dump computed "
                  f"the {what.lower()} in {fname}")
        if fmt is not None and fmt.kind == "float":
            reason += (f", whose largest finite value is {num_text(fmt.max, grouped=True)}; the float64 norm is at most "
                       f"sqrt(numel) x absmax = {bound:.6g}")
        reason += ". The values did not overflow; this is not a non-finite tensor."
        out.append(NormArtefact(r.run, r.run_id, r.rid, r.step, r.rank, r.seq, r.op, r.role, r.index, r.dtype,
                                r.stats.min, r.stats.max, r.stats.mean, r.stats.l2norm, bound, reason))
    return out


_TENSOR_COLS = ("seq", "op", "op_type", "role", "index", "step", "rank", "direction", "dtype", "shape", "numel",
                "nan_count", "inf_count", "zero_count", "min", "max", "absmax", "mean", "std", "l2norm",
                "nonfinite", "rid", "location")


WORST_KEPT = 50  # the worst comparisons a report keeps, ranked
_WORST_COLS = ("kind", "seq", "op", "role", "index", "match", "basis", "verdict", "max_abs_err", "max_rel_err",
               "summary_abs_err", "summary_rel_err", "cosine", "cosine_deficit", "sqnr_db", "rounding_units",
               "nonfinite_introduced", "reason")


@dataclass(frozen=True, slots=True)
class ReportRun:
    """A run of the report: its name and id, kind, dtype, its parent's name and the fix that made it, its source,
    the order its dump gave (the word, in words, and what ingest said of it)."""

    name: str
    run_id: str
    kind: str
    dtype: Optional[str]
    parent: Optional[str]
    fix: Optional[str]
    source: Optional[str]
    order: Optional[str]
    order_text: str
    order_note: Optional[str]


@dataclass(frozen=True, slots=True)
class ReportTensor:
    """A record of a run, in (step, rank, seq) order: where it is, its dtype and shape, its NaN/Inf/zero counts and
    statistics."""

    run: str
    seq: int
    op: str
    op_type: Optional[str]
    role: str
    index: str
    step: int
    rank: int
    direction: Optional[str]
    dtype: Optional[str]
    shape: Optional[list[int]]
    numel: Optional[int]
    nan: Optional[int]
    inf: Optional[int]
    zero: Optional[int]
    min: Optional[float]
    max: Optional[float]
    absmax: Optional[float]
    mean: Optional[float]
    std: Optional[float]
    l2norm: Optional[float]
    nonfinite: Optional[bool]
    rid: int
    location: Optional[str]


@dataclass(frozen=True, slots=True)
class ReportComparison:
    """A stored comparison between the records of two runs (or, ``kind`` local, of an op against its fp32
    re-run): how they were matched, the element-wise errors (``max_*_err``) or, on summary statistics (basis
    ``stats``), the summaries' (``summary_*_err``), the verdict and why."""

    ref_run: Optional[str]
    cand_run: Optional[str]
    kind: str
    match: Optional[str]
    basis: Optional[str]
    step: Optional[int]
    rank: Optional[int]
    seq: Optional[int]
    op: Optional[str]
    role: Optional[str]
    index: Optional[str]
    max_abs_err: Optional[float]
    mean_abs_err: Optional[float]
    max_rel_err: Optional[float]
    summary_abs_err: Optional[float]
    summary_rel_err: Optional[float]
    cosine: Optional[float]
    cosine_deficit: Optional[float]
    sqnr_db: Optional[float]
    rounding_units: Optional[float]
    nonfinite_introduced: Optional[int]
    nonfinite_in_ref: Optional[int]
    cand_format: Optional[str]
    verdict: Optional[str]
    reason: Optional[str]
    ref_rid: Optional[int]
    cand_rid: Optional[int]


_CMP_COLS = tuple(ReportComparison.__annotations__)[2:]  # the columns of the comparisons table it holds

WorstComparison = dataclasses.make_dataclass(
    "WorstComparison", [(c, ReportComparison.__annotations__[c]) for c in ("cand_run",) + _WORST_COLS],
    frozen=True, slots=True, namespace={"__module__": __name__, "__doc__": (
        "One of the worst comparisons, as Top offenders ranks them (non-finite records without a comparison "
        "included, ``kind`` uncompared): these columns of a ``ReportComparison``, its candidate run's first.")})


@dataclass(frozen=True, slots=True)
class ReportTimeline:
    """A long run's timeline in the report: its first non-finite step (None: every step finite), the steps it holds
    full records of, and one row per step (``store.timeline.step_rows``)."""

    first_nonfinite_step: Optional[int]
    full_steps: list[int]
    steps: list[StepRow]


@dataclass(frozen=True, slots=True)
class Report:
    """What went wrong in a session (see the module doc); ``to_json`` writes it, every field in this order."""

    session: str
    created: Optional[str]
    source: Optional[str]
    runs: list[ReportRun]
    first_nonfinite: dict[str, Optional[Origin]]
    ranks: dict[str, list[RankState]]
    intended_nonfinite: dict[str, list[Intended]]
    norm_artefacts: list[NormArtefact]
    tensors: list[ReportTensor]
    comparisons: list[ReportComparison]
    worst_comparisons: list[WorstComparison]
    diagnoses: list[DiagnosisCard]
    fixes_tried: list[Verification]
    warnings: list[RunWarning]
    alerts: list[Alert]
    timeline: dict[str, ReportTimeline]
    notes: dict


def _report_runs(runs: list, names: dict[str, str], notes: OrderNotes) -> list[ReportRun]:
    return [ReportRun(r.name, r.run_id, r.kind, r.dtype, names.get(r.parent_run_id) if r.parent_run_id else None,
                      r.fix, r.source, r.order, order_text(r.order), notes.get(r.run_id)) for r in runs]


def _tensors(store, runs: list) -> list[ReportTensor]:
    shape = _TENSOR_COLS.index("shape")
    return [ReportTensor(r.name, *t[:shape], None if t[shape] is None else json.loads(t[shape]), *t[shape + 1:])
            for r in runs for t in q.run_tensors(store, r.run_id, _TENSOR_COLS)]


def _comparisons(store, sid: str, names: dict[str, str]) -> list[ReportComparison]:
    paired = ("ref_run_id", "cand_run_id") + _CMP_COLS
    return [ReportComparison(names.get(ref), names.get(cand), *values)
            for ref, cand, *values in q.session_comparisons(store, sid, paired)]


def _worst_comparisons(store, sid: str) -> list[WorstComparison]:
    """The worst comparisons as Top offenders ranks them (what a diagnosis names first), non-finite ones too."""
    worst = ranking.ranked_comparisons(store, sid, ranking.ACCUMULATED_KINDS + ranking.LOCAL_KINDS, n=WORST_KEPT,
                                       include_nonfinite=True)
    return [WorstComparison(w.run, *(getattr(w, k) for k in _WORST_COLS)) for w in worst]


def _timelines(store, sid: str) -> dict[str, ReportTimeline]:
    return {t.run: ReportTimeline(t.first_nonfinite_step, t.full_steps, t.steps)
            for t in _timeline.timeline_report(store, sid)}


def build_report(store, session: str) -> Report:
    """The session's findings (see the module doc), ready for ``to_json`` and ``render_text``."""
    info = store.session(session)
    sid = info.session_id
    # reference runs first, then in the order they were added
    runs = q.session_runs(store, sid, references_first=True)
    names = {r.run_id: r.name for r in runs}
    first, intended, spread, by_id = {}, {}, {}, {}
    for r in runs:
        f, masks = nonfinite_origin(store, r.run_id)
        first[r.name], intended[r.name], by_id[r.run_id] = f, masks, f
        spread[r.name] = rank_spread(store, r.run_id, f)
    warnings = [RunWarning(names.get(w.run_id), w.file, w.message) for w in q.session_warning_rows(store, sid)]
    return Report(info.name, info.created, info.source, _report_runs(runs, names, order_notes(store, sid)), first,
                  spread, intended, norm_artefacts(store, sid), _tensors(store, runs), _comparisons(store, sid, names),
                  _worst_comparisons(store, sid), diagnosis_cards(store, sid),
                  list(verification(store, session, by_id).all()), warnings, _timeline.session_alerts(store, sid),
                  _timelines(store, sid), info.notes)


def to_json(report: Report, *, indent: Optional[int] = 2) -> str:
    """Strict JSON (``allow_nan=False``): non-finite numbers become strings."""
    return dumps(report, indent=indent)


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _listing(title: str, top: int, lines: list[str]) -> list[str]:
    """A titled, indented list of at most ``top`` lines and how many more there are; nothing when empty."""
    if not lines:
        return []
    out = ["", title] + [f"  {ln}" for ln in lines[:top]]
    return out + ([f"  ... and {len(lines) - top} more"] if len(lines) > top else [])


def _runs_lines(report: Report) -> list[str]:
    out = [f"Session {report.session}  ({report.source or ''})", ""]
    out += _table([[r.name, r.kind, r.dtype or "-", r.parent or "-", r.fix or "-", r.order_text]
                   for r in report.runs], ["run", "kind", "dtype", "parent", "fix", "order"])
    said = [f"  {r.name}: {r.order_note}" for r in report.runs if r.order_note]
    return out + ((["", "Order used:"] + said) if said else [])


def _origin_lines(report: Report, run: str, f: Optional[Origin]) -> list[str]:
    """A run's first non-finite producer: where, why, how sure, the ops before it, and its other ranks."""
    if f is None:
        return [f"  {run}: none: {finite_text(report.intended_nonfinite.get(run) or [])}"]
    out = [f"  {run}: {producer_text(f)}  (step {f.step}, rank {f.rank}, seq {f.seq}, {f.role} {f.index})",
           f"    {f.reason}"]
    out += [f"    {f.certainty_text}"] if f.certainty_text else []
    out += [f"    called from {f.location}"] if f.location else []
    out.append(f"    path ({order_text(f.order)}): {' -> '.join(p.op for p in f.path)}")
    return out + [f"    {r.text}" for r in report.ranks.get(run) or []]


def _comparison_lines(report: Report, top: int) -> list[str]:
    """How many comparisons of each verdict per pair of runs, then the ``top`` worst as ``build_report`` ranked
    them (Top offenders' ranking)."""
    counts: dict[tuple, dict[str, int]] = {}
    for c in report.comparisons:
        key = (c.cand_run, c.ref_run, c.kind == "local")
        v = c.verdict or c.match
        counts.setdefault(key, {})[v] = counts.setdefault(key, {}).get(v, 0) + 1
    out = ["", "Comparisons:"]
    for (cand, ref, local), d in counts.items():
        summary = ", ".join(f"{k} {n}" for k, n in sorted(d.items()))
        # a local comparison sets each op of a run against its own fp32 re-run: not a second run
        out.append(f"  {cand}: local error (each op against its fp32 re-run): {summary}" if local
                   else f"  {cand} vs {ref}: {summary}")
    worst = report.worst_comparisons[:top]
    # a comparison on summary statistics has no element-wise error: its own columns, where there is one
    by_summary = any(c.basis == "stats" for c in worst)
    rows = [[c.cand_run, c.op, f"{c.role}.{c.index}", c.match or c.kind, c.basis or "-", num_text(c.max_abs_err),
             num_text(c.max_rel_err)]
            + ([num_text(c.summary_abs_err), num_text(c.summary_rel_err)] if by_summary else [])
            + [cosine_brief(c.cosine, c.cosine_deficit), num_text(c.sqnr_db),
               "-" if c.nonfinite_introduced is None else str(c.nonfinite_introduced), c.verdict] for c in worst]
    if not rows:
        return out
    header = (["run", "op", "tensor", "match", "basis", "max_abs", "max_rel"]
              + (["summary_abs", "summary_rel"] if by_summary else []) + ["cosine", "sqnr_db", "nf_new", "verdict"])
    return out + ["", f"Worst {len(rows)} comparisons:"] + ["  " + ln for ln in _table(rows, header)]


def _diagnosis_lines(report: Report) -> list[str]:
    return (["", "Diagnoses:"] + [f"  [{d.severity}] {d.run}: {d.op}: {d.message}"
                                  + (f"  fixes: {', '.join(d.fixes)}" if d.fixes else "") for d in report.diagnoses]
            if report.diagnoses else [])


def fix_tried_text(v: Verification) -> str:
    """A re-run as the reports list it: the run it fixes, the fix, the re-run and what it gave."""
    return f"{v.parent}: {v.fix} -> {v.run}: {v.outcome()}"


def _timeline_lines(report: Report) -> list[str]:
    return [line for run, t in report.timeline.items() for line in (
        "", f"Timeline of {run}: {len(t.steps)} steps, full records at {len(t.full_steps)}; "
            + (f"first non-finite value at step {t.first_nonfinite_step}" if t.first_nonfinite_step is not None
               else "every step finite"))]


def render_text(report: Report, *, top: int = 15) -> str:
    """A human-readable summary of ``build_report``'s report."""
    out = _runs_lines(report) + ["", "First non-finite producer:"]
    for run, f in report.first_nonfinite.items():
        out += _origin_lines(report, run, f)
    arts = report.norm_artefacts
    out += _listing(f"Norm artefacts ({len(arts)}): not non-finite values", top,
                    [f"{a.run}: {a.op} {a.role} {a.index}: {a.reason}" for a in arts])
    out += _comparison_lines(report, top) if report.comparisons else []
    out += _diagnosis_lines(report)
    out += _listing(f"Fixes tried ({len(report.fixes_tried)}):", top, [fix_tried_text(v) for v in report.fixes_tried])
    out += _listing(f"Alerts ({len(report.alerts)}):", top,
                    [f"[{a.rule}] {a.run} step {a.step}: {a.message}" for a in report.alerts])
    out += _timeline_lines(report)
    out += _listing(f"Warnings ({len(report.warnings)}):", top, [f"{w.file}: {w.message}" for w in report.warnings])
    return "\n".join(out) + "\n"
