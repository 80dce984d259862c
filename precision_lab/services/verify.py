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
from typing import Callable, Optional

from ..fixes.catalogue import FixError, fix_label, split_specs
from ..fixes.facts import StateAfter
from ..origin import Origin
from ..store import DatabaseLocked
from ..store import queries as q
from .report import first_nonfinite
from .islands import bisect_fp32_islands
from .rerun import rerun_session

__all__ = ["suggestions", "verification", "untried", "verify_session", "judge_fix", "IMPROVE_DB"]

Progress = Optional[Callable[[int, int, str], None]]
# how much a fix of a run without NaN/Inf must raise its output SQNR (dB) to count as working
IMPROVE_DB = 1.0


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


def suggestions(store, session: str, *, top: Optional[int] = None) -> list[dict]:
    """The distinct fixes the session's diagnoses of its captured runs propose (a re-run's own diagnoses are
    about that attempt, not the session), in the order proposed: ``{fix, label, parent}`` -- ``parent`` the
    run the diagnosis is about."""
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
            out.append({"fix": f, "label": label, "parent": d.run_id})
    return out[:top] if top is not None else out


def verification(store, session: str) -> dict[tuple[str, str], dict]:
    """``(parent run id, fix label) -> {run, run_id, works, why, sqnr_db, parent_sqnr_db, first_nonfinite}`` for
    every re-run of the session: what trying that fix from that run gave, judged by ``judge_fix``."""
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
        out[(r.parent_run_id, r.fix)] = {
            "run": r.name, "run_id": r.run_id, "works": works, "why": why, "sqnr_db": sqnr,
            "parent_sqnr_db": parent_sqnr, "grad_sqnr_db": grad, "parent_grad_sqnr_db": parent_grad,
            "first_nonfinite": None if first is None else first.op}
    return out


def untried(store, session: str, *, top: int = 3) -> list[dict]:
    """The first ``top`` suggestions (``suggestions``) that no re-run has tried yet."""
    tried = verification(store, session)
    return [s for s in suggestions(store, session, top=top) if (s["parent"], s["label"]) not in tried]


def verify_session(store, session: str, *, top: int = 3, progress: Progress = None, grow: bool = False,
                   tolerance=None) -> list[dict]:
    """Re-run the first ``top`` suggestions not tried yet; every suggestion's verdict, in order:
    ``{fix, label, parent, run, works, sqnr_db, first_nonfinite, error}``.

    With ``grow``, when none of them works, an fp32 island is grown along the data flow from the first
    non-finite producer until the run meets ``tolerance`` (``bisect_fp32_islands``: every try is stored) and
    the island it found is verdict too, with ``grown`` set."""
    todo = suggestions(store, session, top=top)
    done = verification(store, session)
    out = []
    for i, s in enumerate(todo):
        key = (s["parent"], s["label"])
        row = dict(s, error=None)
        if key not in done:
            if progress is not None:
                progress(i, len(todo), f"verifying {s['label']}")
            try:
                rerun_session(store, session, s["fix"], parent=s["parent"])
            except DatabaseLocked:  # another process holds the database: no verdict on the fix, the caller says so
                raise
            except Exception as e:  # a fix that cannot apply to this model is a verdict too
                row["error"] = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            done = verification(store, session)
        row.update(done.get(key, {"run": None, "run_id": None, "works": False, "why": None, "sqnr_db": None,
                                  "parent_sqnr_db": None, "first_nonfinite": None}))
        out.append(row)
    if grow and not any(r["works"] for r in out):
        out.extend(_grown(store, session, tolerance, progress))
    if progress is not None:
        progress(len(todo), len(todo), "verified")
    return out


def _grown(store, session: str, tolerance, progress: Progress) -> list[dict]:
    res = bisect_fp32_islands(store, session, tolerance=tolerance, progress=progress)
    if not res.modules or not res.attempts:
        return []
    row = {"fix": res.fix, "label": res.fix, "parent": res.attempts[0].run_id, "grown": True,
           "error": None if res.passed else res.message}
    done = {v["run_id"]: v for v in verification(store, session).values()}
    last = next((a.run_id for a in reversed(res.attempts) if list(a.modules) == res.modules), None)
    row.update(done.get(res.final_run_id or last) or {"run": None, "run_id": None, "works": False, "why": None,
                                                      "sqnr_db": None, "parent_sqnr_db": None,
                                                      "first_nonfinite": None})
    return [row]
