"""What trying a fix gave: each re-run of a session judged against the run it fixes.

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
from typing import Optional

from ..fixes.facts import StateAfter
from ..origin import Origin
from ..store import queries as q
from .origins import first_nonfinite

__all__ = ["Verification", "Verifications", "NOT_RUN", "verification", "judge_fix", "IMPROVE_DB"]

# how much a fix of a run without NaN/Inf must raise its output SQNR (dB) to count as working
IMPROVE_DB = 1.0


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
    fix: Optional[str] = None
    parent: Optional[str] = None

    def outcome(self) -> str:
        """What the re-run gave, in words: ``works, output SQNR 31.2 dB``, or why it does not."""
        if self.works:
            return "works" + (f", output SQNR {self.sqnr_db:.1f} dB" if self.sqnr_db is not None else "")
        return self.why or f"still NaN/Inf ({self.first_nonfinite})"


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


def verification(store, session: str, firsts: Optional[dict[str, Optional[Origin]]] = None) -> Verifications:
    """Every re-run of the session: what trying that fix from that run gave, judged by ``judge_fix``.
    ``firsts``: each run's first unexpected non-finite origin by run id, where the caller has found them already
    (the report): they are not looked for again."""
    info = store.session(session)
    out = {}
    parents: dict[str, tuple] = {}

    def quality(run_id: str) -> tuple:
        if run_id not in parents:
            last = q.last_accumulated_output(store, run_id)
            fn = firsts[run_id] if firsts is not None and run_id in firsts else first_nonfinite(store, run_id)
            parents[run_id] = (fn, None if last is None else last.sqnr_db, q.worst_gradient_sqnr(store, run_id),
                               q.first_nonfinite_state_after(store, run_id, fn.step) if fn is not None else None)
        return parents[run_id]

    runs = q.session_runs(store, info.session_id)
    names = {r.run_id: r.name for r in runs}
    for r in runs:
        if r.kind != "rerun" or not r.parent_run_id or not r.fix:
            continue
        first, sqnr, grad, state = quality(r.run_id)
        parent_first, parent_sqnr, parent_grad, parent_state = quality(r.parent_run_id)
        works, why = judge_fix(first, sqnr, parent_first, parent_sqnr, grad, parent_grad, state, parent_state)
        out[(r.parent_run_id, r.fix)] = Verification(
            r.name, r.run_id, works, why, sqnr, parent_sqnr, grad, parent_grad,
            None if first is None else first.op, r.fix, names.get(r.parent_run_id))
    return Verifications(out)
