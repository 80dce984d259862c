"""Suggestions that were verified: re-run a session's proposed fixes and say which of them work.

A fix is *verified* by the re-run it made from the run its diagnosis is about
(re-runs are deterministic, so one is enough), and judged by its effect
(``judge_fix``): it *works* when that re-run holds no unexpected non-finite
value (a mask's -inf is no failure: ``origin``) and improves on the run it
fixes: that run held NaN/Inf, or the fix raises the output SQNR against the
fp32 reference by at least ``IMPROVE_DB``.  A fix that leaves a finite run's
output where it was (an island on a module whose dtype comes from its inputs)
or makes it worse (bf16 on an integer count past 256) does not work, and says
so beside both SQNRs.  Nothing new is stored: the verdict is read
from the re-runs themselves, so a fix tried from the dashboard, the command
line or a script counts the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from ..fixes.catalogue import FixError, fix_label, split_specs
from ..fixes.facts import StateAfter
from ..origin import Origin
from ..store import DatabaseLocked
from ..store import queries as q
from .report import first_nonfinite
from .islands import bisect_fp32_islands
from .rerun import rerun_session

__all__ = ["Suggestion", "Verification", "Verifications", "Verdict", "NOT_RUN", "suggestions", "verification", "untried",
           "verify_session", "judge_fix", "IMPROVE_DB"]

Progress = Optional[Callable[[int, int, str], None]]
# how much a fix of a run without NaN/Inf must raise its output SQNR (dB) to count as working
IMPROVE_DB = 1.0


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A fix a diagnosis proposes: the spec as proposed, its label (``fix_label``) and the run it fixes."""

    fix: str
    label: str
    parent: str


@dataclass(frozen=True, slots=True)
class Verification:
    """What trying a fix from a run gave (``judge_fix``): the re-run (name and id), whether the fix works and why,
    the output SQNR (dB, against the fp32 reference) of the re-run and of the run it fixes, the worst SQNR of their
    parameter gradients where both ran backward, and the re-run's first unexpected non-finite op.  ``NOT_RUN``:
    no re-run to judge."""

    run: Optional[str] = None
    run_id: Optional[str] = None
    works: bool = False
    why: Optional[str] = None
    sqnr_db: Optional[float] = None
    parent_sqnr_db: Optional[float] = None
    grad_sqnr_db: Optional[float] = None
    parent_grad_sqnr_db: Optional[float] = None
    first_nonfinite: Optional[str] = None


NOT_RUN = Verification()


@dataclass(frozen=True, slots=True)
class Verifications:
    """Every re-run of a session judged: ``by_fix`` maps ``(parent run id, fix label)`` to its ``Verification``."""

    by_fix: dict[tuple[str, str], Verification]

    def get(self, parent: Optional[str], label: str) -> Optional[Verification]:
        """What trying ``label`` from run ``parent`` gave; None when no re-run tried it."""
        return self.by_fix.get((parent, label))

    def tried(self, parent: Optional[str], label: str) -> bool:
        return (parent, label) in self.by_fix

    def all(self) -> tuple[Verification, ...]:
        return tuple(self.by_fix.values())

    def any_works(self) -> bool:
        return any(v.works for v in self.by_fix.values())


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


def judge_fix(first: Optional[Origin], sqnr_db: Optional[float], parent_first: Optional[Origin],
              parent_sqnr_db: Optional[float], grad_db: Optional[float] = None,
              parent_grad_db: Optional[float] = None, weights_after: Optional[StateAfter] = None,
              parent_weights_after: Optional[StateAfter] = None) -> tuple[bool, str]:
    """``(works, why)`` of a re-run against the run it fixes: its first unexpected non-finite origin and output
    SQNR (dB, against the fp32 reference) beside the parent's, and where both ran backward the worst SQNR of
    their parameter gradients (``worst_gradient_sqnr``): a fix of the gradients (a loss scale) leaves the output
    where it was and is judged by them.  ``weights_after``: the first non-finite parameter record after the step of
    the run's first non-finite gradient (``first_nonfinite_state_after``): a fix that skips that optimizer step
    leaves the gradient non-finite and works when the weights it fixes turned non-finite and its own do not."""
    if (first is not None and first.direction == "backward" and weights_after is None
            and parent_weights_after is not None and sqnr_db is not None):
        return True, (f"the NaN/Inf gradient at {first.op} no longer reaches the weights (the run it fixes has "
                      f"non-finite weights from step {parent_weights_after.step} on), output SQNR {_db(sqnr_db)}")
    if first is not None:
        return False, f"still NaN/Inf at {first.op}"
    if parent_first is not None:
        return True, "no NaN/Inf left" + (f", output SQNR {_db(sqnr_db)}" if sqnr_db is not None else "")
    if grad_db is not None and parent_grad_db is not None and (sqnr_db is None or sqnr_db == parent_sqnr_db):
        if grad_db >= parent_grad_db + IMPROVE_DB:
            return True, f"parameter gradients' worst SQNR {_db(parent_grad_db)} -> {_db(grad_db)}"
        if sqnr_db is not None:
            return False, (f"changes nothing the output shows (output SQNR {_db(sqnr_db)}) and the parameter "
                           f"gradients' worst SQNR {_db(grad_db)} against {_db(parent_grad_db)}")
    if sqnr_db is None or parent_sqnr_db is None:
        return False, "the run it fixes held no NaN/Inf and no output SQNR says whether this one is better"
    if sqnr_db == parent_sqnr_db:
        return False, f"changes nothing the output shows: output SQNR {_db(sqnr_db)}, as the run it fixes"
    if sqnr_db >= parent_sqnr_db + IMPROVE_DB:
        return True, f"output SQNR {_db(parent_sqnr_db)} -> {_db(sqnr_db)}"
    worse = "worse than" if sqnr_db < parent_sqnr_db - IMPROVE_DB else "no better than"
    return False, f"{worse} the run it fixes: output SQNR {_db(sqnr_db)} against {_db(parent_sqnr_db)}"


def _db(v: float) -> str:
    return f"{v:.1f} dB" if math.isfinite(v) else ("exact" if v > 0 else "-inf dB")


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


def verification(store, session: str) -> Verifications:
    """Every re-run of the session: what trying that fix from that run gave, judged by ``judge_fix``."""
    info = store.session(session)
    out = {}
    parents: dict[str, tuple] = {}

    def quality(run_id: str) -> tuple:
        if run_id not in parents:
            last = q.last_accumulated_output(store, run_id)
            fn = first_nonfinite(store, run_id)
            parents[run_id] = (fn, None if last is None else last.sqnr_db, q.worst_gradient_sqnr(store, run_id),
                               q.first_nonfinite_state_after(store, run_id, fn.step) if fn is not None else None)
        return parents[run_id]

    for r in q.session_runs(store, info.session_id):
        if r.kind != "rerun" or not r.parent_run_id or not r.fix:
            continue
        first, sqnr, grad, state = quality(r.run_id)
        parent_first, parent_sqnr, parent_grad, parent_state = quality(r.parent_run_id)
        works, why = judge_fix(first, sqnr, parent_first, parent_sqnr, grad, parent_grad, state, parent_state)
        out[(r.parent_run_id, r.fix)] = Verification(
            r.name, r.run_id, works, why, sqnr, parent_sqnr, grad, parent_grad,
            None if first is None else first.op)
    return Verifications(out)


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
