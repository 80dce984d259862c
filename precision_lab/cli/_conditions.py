"""``--fail-on`` conditions of ``report`` and ``compare``: parsed, checked against a report, turned into an exit."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import typer

from ._app import echo
from ._common import EXIT_UNUSABLE
from ..alerts import RULES_BY_NAME
from ..metrics import ELEMENTWISE, ON_SUMMARIES, relative_error
from ..services.report import Report, ReportComparison

__all__ = ["CONDITIONS", "EXIT_TRIPPED", "Condition", "parse_condition", "check_conditions", "exit_on"]

# what --fail-on takes
CONDITIONS = "nonfinite | sqnr<DB | max_rel_err>X | alert | alert:RULE"

EXIT_TRIPPED = 1


def exit_on(rep: Report, conditions: list) -> None:
    """Say which ``--fail-on`` conditions tripped and exit 1 (2 when the data cannot answer one)."""
    tripped, unusable = check_conditions(rep, conditions)
    for line in tripped:
        echo(f"FAIL {line}", err=True)
    for line in unusable:
        echo(f"error: {line}", err=True)
    if unusable:
        raise typer.Exit(EXIT_UNUSABLE)
    if tripped:
        raise typer.Exit(EXIT_TRIPPED)
    if conditions:
        echo("ok: " + ", ".join(str(c) for c in conditions) + " did not trip", err=True)


@dataclass(frozen=True)
class Condition:
    """One ``--fail-on`` condition: ``nonfinite``, ``sqnr<DB``, ``max_rel_err>X``, ``alert``, ``alert:RULE``."""

    kind: str
    threshold: Optional[float] = None
    rule: Optional[str] = None

    def __str__(self) -> str:
        if self.kind == "nonfinite":
            return "nonfinite"
        if self.kind == "alert":
            return f"alert:{self.rule}" if self.rule else "alert"
        op = "<" if self.kind == "sqnr" else ">"
        return f"{self.kind}{op}{self.threshold:g}"


_COND_RE = re.compile(r"^\s*(sqnr|max_rel_err)\s*([<>])\s*([-+0-9.eE]+|inf)\s*$")


def parse_condition(text: str) -> Condition:
    t = text.strip()
    if t == "nonfinite":
        return Condition("nonfinite")
    if t == "alert":
        return Condition("alert")
    if t.startswith("alert:"):
        rule = t[len("alert:"):].strip()
        if rule in RULES_BY_NAME:
            return Condition("alert", rule=rule)
        raise typer.BadParameter(f"{text!r}: no alert rule {rule!r}; the rules are {', '.join(RULES_BY_NAME)}")
    m = _COND_RE.match(t)
    if m:
        kind, op, num = m.groups()
        if (kind, op) in (("sqnr", "<"), ("max_rel_err", ">")):
            try:
                return Condition(kind, float(num))
            except ValueError:
                pass
    raise typer.BadParameter(f"{text!r}: expected nonfinite, sqnr<DB (e.g. sqnr<30), max_rel_err>X "
                             "(e.g. max_rel_err>0.01), alert or alert:RULE (e.g. alert:growth)")


def check_conditions(report: Report, conditions: list[Condition]) -> tuple[list[str], list[str]]:
    """``(tripped, unusable)``: one line per tripped condition and per condition
    that this data cannot answer (e.g. ``sqnr`` with statistics-only dumps).

    - ``nonfinite``: a matched pair where the candidate is NaN/Inf where the
      reference is finite, or a candidate record with no reference
      counterpart that is non-finite.
    - ``sqnr<DB``: an element-wise comparison with SQNR below DB dB, or any
      tensor that ``nonfinite`` would name (an SQNR over the finite values
      alone says nothing of a NaN output).
    - ``max_rel_err>X``: a comparison (element-wise or on summary statistics)
      whose max relative error exceeds X: ``max_rel_err`` where the
      comparison is element-wise, else ``summary_rel_err`` (the largest
      relative difference of the summaries); the message says which; or any
      tensor that ``nonfinite`` would name.
    - ``alert`` / ``alert:RULE``: a long run's alert (of that rule); a session
      without a timeline cannot answer it, except ``underflow`` (and
      ``alert``, which then means it) where element-wise comparisons with a
      reference count the values flushed to zero.
    """
    comps = [c for c in report.comparisons if c.verdict is not None]
    newly = _newly_nonfinite(report, comps)
    tripped, unusable = [], []
    for cond in conditions:
        if cond.kind == "nonfinite":
            found = ([f"nonfinite: {newly}"] if newly else [], [])
        elif cond.kind == "alert":
            found = _check_alert(cond, report, comps)
        elif cond.kind == "sqnr":
            found = _check_sqnr(cond, comps, newly)
        else:
            found = _check_rel_err(cond, comps, newly)
        tripped += found[0]
        unusable += found[1]
    return tripped, unusable


def _newly_nonfinite(report: Report, comps: list[ReportComparison]) -> str:
    """The tensors non-finite in the candidate but not the reference, in words ("" when none): a matched pair
    that introduced NaN/inf, or a non-finite candidate record with no reference counterpart.  No error bound
    holds there, whatever the finite values say."""
    bad_nf = [c for c in comps if (c.nonfinite_introduced or 0) > 0]
    cand_runs = {r.name for r in report.runs if r.kind != "reference"}
    unmatched = {(c.cand_run, c.cand_rid) for c in report.comparisons if c.match == "unmatched_cand"}
    extra_nf = [t for t in report.tensors if t.run in cand_runs and t.nonfinite
                and (t.run, t.rid) in unmatched]
    if not report.comparisons:
        extra_nf = [t for t in report.tensors if t.run in cand_runs and t.nonfinite]
    if not (bad_nf or extra_nf):
        return ""
    first = bad_nf[0] if bad_nf else extra_nf[0]
    return (f"{len(bad_nf) + len(extra_nf)} tensor(s) non-finite in the candidate but not the reference, first "
            f"{first.op} {first.role} {first.index}")


def _check_alert(cond: Condition, report: Report, comps: list[ReportComparison]) -> tuple[list[str], list[str]]:
    """``(tripped, unusable)`` lines of an ``alert`` / ``alert:RULE`` condition."""
    flushed = cond.rule in (None, "underflow") and any(c.basis == "tensor" for c in comps)
    if not report.timeline and not flushed:
        return [], [f"{cond}: the session has no timeline (capture a long run with every=N"
                    + (", or compare with a reference for underflow)" if cond.rule is None else ")")]
    hits = [a for a in report.alerts if cond.rule is None or a.rule == cond.rule]
    if not hits:
        return [], []
    first = min(hits, key=lambda a: a.step)
    return [f"{cond}: {len(hits)} alert(s), first at step {first.step}: {first.message}"], []


def _check_sqnr(cond: Condition, comps: list[ReportComparison], newly: str) -> tuple[list[str], list[str]]:
    """``(tripped, unusable)`` lines of a ``sqnr<DB`` condition."""
    vals = [c for c in comps if c.basis == "tensor" and c.sqnr_db is not None]
    if not vals:
        return [], [f"{cond}: no element-wise comparisons (statistics-only dumps have no SQNR)"]
    tripped = []
    bad = [c for c in vals if (c.sqnr_db if not math.isnan(c.sqnr_db) else -math.inf) < cond.threshold]
    if newly:  # an SQNR over the finite values alone says nothing of a NaN output
        tripped.append(f"{cond}: {newly} (no SQNR holds there)")
    if bad:
        worst = min(bad, key=lambda c: c.sqnr_db)
        tripped.append(f"{cond}: {len(bad)} tensor(s), worst {worst.op} {worst.role} {worst.index} "
                       f"at {worst.sqnr_db:.4g} dB")
    return tripped, []


def _check_rel_err(cond: Condition, comps: list[ReportComparison], newly: str) -> tuple[list[str], list[str]]:
    """``(tripped, unusable)`` lines of a ``max_rel_err>X`` condition."""
    vals = [(c, *relative_error(c.max_rel_err, c.summary_rel_err)) for c in comps]
    vals = [v for v in vals if v[1] is not None]
    tripped = [f"{cond}: {newly} (no relative error bound holds there)"] if newly else []
    if not vals:
        return tripped, [] if newly else [f"{cond}: no comparisons with a relative error"]
    bad: dict[str, list] = {}
    for v in vals:
        if v[1] > cond.threshold:
            bad.setdefault(v[2], []).append(v)
    if bad:
        # the worst element-wise error where there is one: a summary's relative error is another quantity
        worst, err, how = max(bad.get(ELEMENTWISE) or bad[ON_SUMMARIES], key=lambda v: v[1])
        counts = ", ".join(f"{len(bad[k])} {k}" for k in (ELEMENTWISE, ON_SUMMARIES) if k in bad)
        tripped.append(f"{cond}: {sum(map(len, bad.values()))} tensor(s) ({counts}), worst {worst.op} "
                       f"{worst.role} {worst.index} at {err:.4g} ({how})")
    return tripped, []
