"""Suggestions that were verified: re-run a session's proposed fixes and say which of them work (each judged
as ``verdicts`` says)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..fixes.catalogue import FixError, fix_label, split_specs
from ..store import DatabaseLocked
from ..store import queries as q
from .verdicts import IMPROVE_DB, NOT_RUN, Verification, Verifications, judge_fix, verification
from .islands import bisect_fp32_islands
from .rerun import rerun_session

__all__ = ["Suggestion", "Verification", "Verifications", "Verdict", "NOT_RUN", "suggestions", "verification", "untried",
           "verify_session", "judge_fix", "IMPROVE_DB"]

Progress = Optional[Callable[[int, int, str], None]]


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A fix a diagnosis proposes: the spec as proposed, its label (``fix_label``) and the run it fixes."""

    fix: str
    label: str
    parent: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """A suggestion verified: the fix, its label and the run it fixes, what its re-run gave (``result``;
    ``NOT_RUN`` when none was made), ``error`` when the fix could not apply to the model, and ``grown`` for an
    fp32 island grown along the data flow."""

    fix: str
    label: str
    parent: str
    result: Verification = NOT_RUN
    error: Optional[str] = None
    grown: bool = False


def suggestions(store, session: str, *, top: Optional[int] = None) -> list[Suggestion]:
    """The distinct fixes the session's diagnoses of its captured runs propose (a re-run's own diagnoses are
    about that attempt, not the session), in the order proposed, each with the run the diagnosis is about."""
    info = store.session(session)
    captured = {r.run_id for r in q.session_runs(store, info.session_id) if r.kind == "candidate"}
    seen, out = set(), []
    for d in q.session_diagnoses(store, info.session_id):
        if d.rule == "fix-verified" or d.run_id not in captured:
            continue
        for f in d.fixes:
            try:
                label = fix_label(split_specs(f))
            except FixError:
                continue
            key = (d.run_id, label)
            if key in seen:
                continue
            seen.add(key)
            out.append(Suggestion(f, label, d.run_id))
    return out[:top] if top is not None else out


def untried(store, session: str, *, top: int = 3) -> list[Suggestion]:
    """The first ``top`` suggestions (``suggestions``) that no re-run has tried yet."""
    tried = verification(store, session)
    return [s for s in suggestions(store, session, top=top) if not tried.tried(s.parent, s.label)]


def verify_session(store, session: str, *, top: int = 3, progress: Progress = None, grow: bool = False,
                   tolerance=None) -> list[Verdict]:
    """Re-run the first ``top`` suggestions not tried yet; every suggestion's verdict, in order.

    With ``grow``, when none of them works, an fp32 island is grown along the data flow from the first
    non-finite producer until the run meets ``tolerance`` (``bisect_fp32_islands``: every try is stored) and
    the island it found is verdict too, with ``grown`` set."""
    todo = suggestions(store, session, top=top)
    done = verification(store, session)
    out = []
    for i, s in enumerate(todo):
        error = None
        if not done.tried(s.parent, s.label):
            if progress is not None:
                progress(i, len(todo), f"verifying {s.label}")
            try:
                rerun_session(store, session, s.fix, parent=s.parent)
            except DatabaseLocked:  # another process holds the database: no verdict on the fix, the caller says so
                raise
            except Exception as e:  # a fix that cannot apply to this model is a verdict too
                error = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            done = verification(store, session)
        out.append(Verdict(s.fix, s.label, s.parent, done.get(s.parent, s.label) or NOT_RUN, error))
    if grow and not any(r.result.works for r in out):
        out.extend(_grown(store, session, tolerance, progress))
    if progress is not None:
        progress(len(todo), len(todo), "verified")
    return out


def _grown(store, session: str, tolerance, progress: Progress) -> list[Verdict]:
    res = bisect_fp32_islands(store, session, tolerance=tolerance, progress=progress)
    if not res.modules or not res.attempts:
        return []
    done = {v.run_id: v for v in verification(store, session).all()}
    last = next((a.run_id for a in reversed(res.attempts) if list(a.modules) == res.modules), None)
    return [Verdict(res.fix, res.fix, res.attempts[0].run_id, done.get(res.final_run_id or last) or NOT_RUN,
                    None if res.passed else res.message, grown=True)]
