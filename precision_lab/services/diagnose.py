"""Diagnose a session: run the diagnosis rules over what the store recorded.

``diagnose_session(store, session)`` reads the stored statistics and
comparisons of every candidate and re-run in a session and writes one
``Diagnosis`` row per finding, replacing the session's earlier diagnoses in
one transaction (running it twice gives the same rows).  The rules
themselves live in ``precision_lab.fixes.rules`` and see the store only
through ``StoreFacts``, which answers with the store's typed rows (``records.StoredRecord``, ``records.RunInfo``,
``fixes.facts``).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

from ..fixes.recipes import RecipeNotFound, get_recipe
from ..fixes.facts import FACTS
from ..fixes.rules import Context, diagnose_run, module_facts, quantise_findings
from ..ops import aliases_of
from ..records import Diagnosis
from ..store import DatabaseLocked
from ..store import queries as q
from .origins import first_nonfinite
from .sessions import recipe_name, run_policy

__all__ = ["check_sessions", "diagnose", "diagnose_session", "StoreFacts"]


class StoreFacts:
    """``fixes.rules.RunFacts`` answered from a store, as typed rows; a fact registered with
    ``fixes.facts.register_fact`` is answered by its function, given this store."""

    def __init__(self, store):
        self.store = store
        self._quantise: dict[str, list] = {}  # run_id -> its quantise calls (read once per diagnosis pass)

    def __getattr__(self, name: str):
        fact = None if name.startswith("_") else FACTS.get(name)
        if fact is None:
            raise AttributeError(f"no fact {name!r}: register one with precision_lab.fixes.facts.register_fact")
        return partial(fact, self.store)

    def zero_gradients(self, run_id):
        return q.zero_gradients(self.store, run_id)

    def op_records(self, run_id, op, step, rank):
        return q.op_records(self.store, run_id, op, step, rank)

    def module_call(self, run_id, module, step, rank, seq, *, after=True):
        return q.module_call(self.store, run_id, module, step, rank, seq, after=after)

    def reference_of(self, cand_run_id, recs, ref_run_id):
        return q.reference_of(self.store, cand_run_id, recs, ref_run_id).by_rid

    def first_nonfinite_output_of_type(self, run_id, op_type):
        return q.first_nonfinite_output_of_type(self.store, run_id, op_type)

    def warning_starting(self, run_id, prefix):
        return q.warning_starting(self.store, run_id, prefix)

    def ops_above(self, run_id, absmax):
        return q.ops_above(self.store, run_id, absmax)

    def worst_local_errors(self, run_id, limit):
        return q.worst_local_errors(self.store, run_id, limit)

    def last_accumulated_output(self, run_id):
        return q.last_accumulated_output(self.store, run_id)

    def last_forward_output_finite(self, run_id):
        return q.last_forward_output_finite(self.store, run_id)

    def error_growth(self, run_id):
        return q.error_growth(self.store, run_id)

    def paired_values(self, run_id, roles, op_types=None):
        return q.paired_values(self.store, run_id, roles, op_types)

    def first_nonfinite_state_after(self, run_id, step):
        return q.first_nonfinite_state_after(self.store, run_id, step)

    def quantise_calls(self, run_id):
        if run_id not in self._quantise:
            self._quantise[run_id] = q.quantise_calls(self.store, run_id, ("quantise",) + aliases_of("quantise"))
        return self._quantise[run_id]


def _recipe_modules(name: Optional[str], policy) -> dict[str, dict]:
    """Module facts of a recipe's model under ``policy`` ({} for dump sessions or unknown recipes)."""
    if not name:
        return {}
    try:
        recipe = get_recipe(name)
    except RecipeNotFound:
        return {}
    model = recipe.build_model()
    if policy is not None:
        try:
            policy.prepare(model)
        except ValueError:
            pass
    return module_facts(model).modules


def diagnose(store, session: str) -> list[Diagnosis]:
    """The diagnoses of a session, computed from the store (nothing written)."""
    return _diagnose(store, session)[0]


def _diagnose(store, session: str) -> tuple[list[Diagnosis], list[tuple], str]:
    """``(diagnoses, judgements, session id)``: the session's diagnoses, and ``(run_id, op, step, rank, verdict,
    reason)`` for each quantise op call whose output is worse than expected against its own input."""
    info = store.session(session)
    runs = q.session_runs(store, info.session_id)
    ref = next((r for r in runs if r.kind == "reference"), None)
    ctx = Context(StoreFacts(store), info, runs, ref)
    for r in runs:
        ctx.policies[r.run_id] = run_policy(r)
    recipe = recipe_name(store, info, runs)
    modules_by_policy: dict[str, dict] = {}
    out: list[Diagnosis] = []
    judged: list[tuple] = []
    for run in runs:
        if run.kind == "reference":
            continue
        policy = ctx.policies.get(run.run_id)
        key = policy.to_json() if policy is not None else ""
        if key not in modules_by_policy:
            modules_by_policy[key] = _recipe_modules(recipe, policy)
        ctx.modules = modules_by_policy[key]
        out.extend(diagnose_run(ctx, run, first_nonfinite(store, run.run_id)))
        judged.extend((run.run_id, c.op, c.step, c.rank, qf.verdict,
                       f"judged against its own input: {qf.message}") for c, qf in quantise_findings(ctx, run))
    return out, judged, info.session_id


def diagnose_session(store, session: str) -> list[Diagnosis]:
    """Recompute a session's diagnoses and store them, replacing earlier ones (one transaction); a quantise op's
    output comparisons take the verdict of its quantisation where that is worse (``rules.quantise_findings``:
    re-run in fp32, the op quantises too, so its comparison cannot see values flushed to zero)."""
    found, judged, sid = _diagnose(store, session)
    with store.extend_session(session) as w:
        w.clear_diagnoses()
        for d in found:
            w.add_diagnosis(d)
        for j in judged:
            w.worsen_verdicts(*j)
        w.mark_diagnosed()
    return [Diagnosis(sid, d.run_id, d.op, d.rule, d.message, d.fixes, d.severity, d.seq) for d in found]


def check_sessions(store) -> list[tuple[str, str]]:
    """Diagnose every session a write left undiagnosed (a process killed between storing a session and
    diagnosing it); ``[(session, what was done)]``.  Where the rules fail, the session gets a warning saying why,
    so it is never left without a word."""
    out = []
    for name in store.undiagnosed_sessions():
        try:
            found = diagnose_session(store, name)
        except (DatabaseLocked, OSError):  # not the rules: the session stays unmarked for the next check
            raise
        except Exception as e:  # noqa: BLE001 - said on the session and here
            why = f"diagnosis rules failed: {type(e).__name__}: {str(e)[:300]}"
            with store.extend_session(name) as w:
                w.add_warning("diagnose", why)
                w.mark_diagnosed()
            out.append((name, why))
        else:
            out.append((name, f"diagnosed: {len(found)} diagnoses"))
    return out
