"""The Diff page: reference stats | candidate stats | metrics, aligned per op,
and the N-run view with one column group per run."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import pandas as pd

from ..services.origins import first_nonfinite
from ..store import queries as q
from .common import escape_md
from ..store import views
from ..store.queries import session_runs
from ..store.views import SHOW_OPTIONS, base_run, pair_options, unmatched_counts
from ..metrics import SUMMARY_ERRORS
from ..records import RunInfo
from ..store.rows import ComparedPair
from .common import Page, cosine_text, paged, severity_label
from ..services.xdiff import diff_records, diff_rows, run_records

__all__ = ["RerunCard", "landing_op", "diff_page", "nrun_page", "rerun_cards", "sqnr_card", "DataDiff", "data_diff", "runs_by_id",
           "base_run_id", "pair_choices", "SHOW_CHOICES", "SessionRuns", "PairChoices"]

# what the Diff table may show (the read model's SHOW_OPTIONS), as the "Show" picker lists them
SHOW_CHOICES = tuple(SHOW_OPTIONS)


@dataclass(frozen=True, slots=True)
class SessionRuns:
    """A session's runs by run id (``by_id``), in the session's order."""

    by_id: dict[str, RunInfo]


def runs_by_id(store, session_id: str) -> SessionRuns:
    """The session's runs by run id, in the session's order: the Diff page's run pickers and its links to a run."""
    return SessionRuns({r.run_id: r for r in session_runs(store, session_id)})


def base_run_id(store, session_id: str) -> Optional[str]:
    """The run the N-run view aligns on first (``store.views.base_run``), by id; None for a session with no run."""
    base = base_run(store, session_id)
    return base.run_id if base else None


@dataclass(frozen=True, slots=True)
class PairChoices:
    """What the pair view offers besides its table: the (reference, candidate) pairs by label (``by_label``), in
    the order they were compared, and how many records of each pair matched exactly, by alignment or not at all
    (``matched``)."""

    by_label: dict[str, ComparedPair]
    matched: pd.DataFrame


def pair_choices(store, session_id: str) -> PairChoices:
    """The pair view's choices (``PairChoices``): the pairs of ``store.views.pair_options`` (the first of two
    with one label) and ``store.views.unmatched_counts``."""
    pairs: dict[str, ComparedPair] = {}
    for p in pair_options(store, session_id):
        pairs.setdefault(p.label, p)
    return PairChoices(pairs, unmatched_counts(store, session_id))


def diff_page(store, session_id: str, ref_run_id: str, cand_run_id: str, *, show: str = "all",
              pattern: str = "", page: int = 0, page_size: int = 50) -> Page:
    """Page ``page`` (0-based; past the end: the last) of the reference | candidate | metrics table
    (``store.views.diff_rows``), severity in words, cosine shown as text with 1 - cos; the decisive columns
    (verdict, max_rel_err, SQNR, reason) come right after the op, so they are on screen at 1400 px, before the
    two sides' statistics.  A pair compared on summary
    statistics has their errors in their own columns (summary_rel_err beside max_rel_err); a pair compared
    element-wise only is shown without them."""
    got = paged(lambda offset, limit: views.diff_rows(store, session_id, ref_run_id, cand_run_id, show=show,
                                                      pattern=pattern, offset=offset, limit=limit), page, page_size)
    df = got.rows.assign(severity=got.rows["severity"].map(severity_label))
    if not got.stats_basis:
        df = df.drop(columns=[c for c in SUMMARY_ERRORS if c in df.columns])
    if "cosine" in df.columns:
        df.insert(df.columns.get_loc("sqnr_db"), "cosine (1-cos)",
                  [cosine_text(c, d) for c, d in zip(df["cosine"], df["cosine_deficit"])])
        df = df.drop(columns=["cosine", "cosine_deficit"])
    lead = [c for c in DECISIVE_FIRST if c in df.columns]
    df = df[lead + [c for c in df.columns if c not in lead]]
    return replace(got, rows=df)


def nrun_page(store, session_id: str, run_ids: Sequence[str], *, base_run_id: Optional[str] = None,
              show: str = "all", pattern: str = "", page: int = 0, page_size: int = 50) -> Page:
    """Page ``page`` (0-based; past the end: the last) of the N-run table (``store.views.nrun_rows``): one row per
    record of the base run, one column group per other run."""
    return paged(lambda offset, limit: views.nrun_rows(store, session_id, run_ids, base_run_id=base_run_id, show=show,
                                                       pattern=pattern, offset=offset, limit=limit), page, page_size)


# the Diff table's first columns: which record, then what was decided about it and why
DECISIVE_FIRST = ("severity", "seq", "step", "rank", "op", "role", "index", "verdict", "max_rel_err",
                  "summary_rel_err", "sqnr_db", "reason")


@dataclass(frozen=True, slots=True)
class RerunCard:
    """A re-run before and after: its name, fix and the parent run's name; per side the forward records holding
    NaN/Inf (none in a run whose NaN/Inf are all intended: they reach no output, gradient or parameter), the
    output SQNR against the fp32 reference (None without one or when the output holds NaN/Inf the reference does
    not -- ``broken`` -- so a broken output is never credited with the SQNR of its finite values) and the op
    named first non-finite."""

    run: str
    fix: str
    parent: str
    nonfinite_before: int
    nonfinite_after: int
    sqnr_before: Optional[float]
    sqnr_after: Optional[float]
    broken_before: bool
    broken_after: bool
    first_before: Optional[str]
    first_after: Optional[str]


def rerun_cards(store, session_id: str, *, limit: int = 3) -> list[RerunCard]:
    """Before and after of the latest re-runs, newest first."""
    runs = session_runs(store, session_id)
    by_id = {r.run_id: r for r in runs}
    out = []
    for r in [r for r in runs if r.kind == "rerun" and r.parent_run_id in by_id][::-1][:limit]:
        parent = by_id[r.parent_run_id]

        def facts(run_id):
            last = q.last_accumulated_output(store, run_id)
            first = first_nonfinite(store, run_id)
            # NaN/inf that reach nothing (a mask's -inf, a fill a min consumes) are intended: a run without a
            # failure counts none
            return (q.count_records(store, run_id, nonfinite=True, direction="forward") if first else 0,
                    last.sqnr_db if last else None, bool(last and last.nonfinite_introduced),
                    first.op if first else None)

        (nb, sb, bb, fb), (na, sa, ba, fa) = facts(parent.run_id), facts(r.run_id)
        out.append(RerunCard(r.name, r.fix or "", parent.name, nb, na, sb, sa, bb, ba, fb, fa))
    return out


def sqnr_card(card: RerunCard) -> tuple[str, Optional[float], str]:
    """The re-run card's output SQNR as ``(value, delta, help)``: "NaN/Inf" for an output holding NaN/Inf (the
    worst result, never a number), a delta only between two finite outputs."""
    sa, sb = card.sqnr_after, card.sqnr_before
    value = "NaN/Inf" if card.broken_after else ("—" if sa is None else f"{sa:.1f}")
    before = ("NaN/Inf in its output" if card.broken_before else "—" if sb is None else f"{sb:.1f} dB")
    return (value, None if sa is None or sb is None else round(sa - sb, 1),
            f"The model's output against the fp32 reference; an output holding NaN/Inf has no SQNR. Before: "
            f"{before} in {escape_md(card.parent)}.")


def landing_op(store, run_id: str) -> Optional[str]:
    """The op a finished re-run opens on: where its parent first went non-finite (the op the fix was for), or
    None when the parent had no non-finite value."""
    run = q.run_row(store, run_id)
    parent = run.parent_run_id if run else None
    first = first_nonfinite(store, parent) if parent else None
    return first.op if first else None


@dataclass(frozen=True)
class DataDiff:
    """Two runs paired by their data (``services.xdiff``): the first divergent pair in a sentence, one row per
    pair with how it was matched, how sure, and the metrics side by side, and the calls left unpaired."""

    sentence: str
    diverged: bool
    rows: pd.DataFrame
    unpaired: pd.DataFrame


def data_diff(store, ref_run_id: str, cand_run_id: str) -> DataDiff:
    """Any two runs of the store, paired by their data and judged against their formats."""
    res = diff_records(run_records(store, ref_run_id), run_records(store, cand_run_id))
    f = res.first
    if f is None:
        sentence = (f"No pair diverges beyond what the formats explain ({len(res.pairing.pairs)} pairs, "
                    f"{len(res.pairing.unpaired_ref)} reference and {len(res.pairing.unpaired_cand)} candidate "
                    f"calls unpaired).")
    else:
        def g(v):
            return "not measured" if v is None else f"{v:.3g}"

        sentence = (f"First divergent pair: {f.pair.label} ({f.pair.how}, confidence {f.pair.confidence:.2f}): "
                    f"output error {g(f.out_error)} where {g(f.expected)} is explained by inputs that agree to "
                    f"{g(f.in_error)}" + (" (it holds NaN/Inf its reference does not)."
                                          if f.comparison is not None and f.comparison.nonfinite_introduced else "."))
    rows = pd.DataFrame(diff_rows(res), columns=["ref", "ref_calls", "cand", "cand_calls", "how", "confidence",
                                                 "basis", "out_error", "in_error", "expected", "sqnr_db",
                                                 "max_abs_err", "max_rel_err", "cosine", "diverges"])
    unpaired = pd.DataFrame([{"run": side, "op": c.op, "op_type": c.op_type}
                             for side, calls in (("reference", res.pairing.unpaired_ref),
                                                 ("candidate", res.pairing.unpaired_cand)) for c in calls],
                            columns=["run", "op", "op_type"])
    return DataDiff(sentence, f is not None, rows, unpaired)
