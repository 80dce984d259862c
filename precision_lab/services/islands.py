"""The fp32 island search: the smallest set of modules to keep in fp32 for a session's run to meet a tolerance
(no NaN/Inf, an output SQNR), found by growing an island from where the failure starts and pruning it; every
run tried is stored in the session (kind ``rerun``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..fixes.catalogue import apply_fixes
from ..metrics import compare
from ..ops import innermost_module
from ..readers.base import first_line
from ..store import queries as q
from ..store.rows import SessionRow
from .diagnose import diagnose_session
from .origins import first_nonfinite
from .rerun import (Progress, RerunError, _isolate, _module_names, _plain_output, _reference_rids, _resolve_parent,
                    _run_model, _runs, _tick, _unique_run_name, _write, session_recipe)
from .sessions import run_policy

__all__ = ["bisect_fp32_islands", "BisectResult", "Attempt", "Tolerance", "parse_tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """A run passes when it has no NaN/Inf (unless allowed) and its output SQNR is at least ``min_sqnr_db``."""

    min_sqnr_db: Optional[float] = None
    allow_nonfinite: bool = False

    def describe(self) -> str:
        parts = [] if self.allow_nonfinite else ["no NaN/Inf"]
        if self.min_sqnr_db is not None:
            parts.append(f"output SQNR >= {self.min_sqnr_db:g} dB")
        return " and ".join(parts) or "anything"


def parse_tolerance(text: str) -> Tolerance:
    """``"30"`` or ``"sqnr>=30"`` (dB, no NaN/Inf), ``"nonfinite"`` (only no NaN/Inf), ``"sqnr>=30,allow-nonfinite"``."""
    tol = Tolerance()
    for part in (p.strip().lower() for p in str(text).split(",") if p.strip()):
        if part in ("nonfinite", "finite", "no-nonfinite"):
            continue
        if part == "allow-nonfinite":
            tol = Tolerance(tol.min_sqnr_db, True)
            continue
        num = part
        for prefix in ("sqnr>=", "sqnr=", "sqnr"):
            if num.startswith(prefix):
                num = num[len(prefix):]
                break
        num = num.removesuffix("db").strip()
        try:
            v = float(num)
        except ValueError:
            raise RerunError(f"tolerance {text!r}: cannot read {part!r}; write e.g. 30, sqnr>=30, nonfinite "
                             "or sqnr>=30,allow-nonfinite") from None
        if not math.isfinite(v):
            raise RerunError(f"tolerance {text!r}: SQNR bound must be a finite number of dB")
        tol = Tolerance(v, tol.allow_nonfinite)
    return tol


@dataclass
class Attempt:
    run_id: str
    modules: tuple[str, ...]
    fix: str
    nonfinite: int
    sqnr_db: Optional[float]
    passed: bool


@dataclass
class BisectResult:
    modules: list[str]
    passed: bool
    tolerance: Tolerance
    attempts: list[Attempt] = field(default_factory=list)
    message: str = ""
    notes: list[str] = field(default_factory=list)
    """Islands the model could not run with, each with why."""

    @property
    def fix(self) -> str:
        return "+".join(f"keep-fp32:{m}" for m in self.modules)

    @property
    def final_run_id(self) -> Optional[str]:
        ok = [a for a in self.attempts if a.passed and list(a.modules) == self.modules]
        return ok[-1].run_id if ok else None


def _output_quality(ref_out, out) -> tuple[int, Optional[float]]:
    import torch  # deferred: see rerun._forward

    if not (isinstance(ref_out, torch.Tensor) and isinstance(out, torch.Tensor)):
        return 0, None
    nonfinite = int((~torch.isfinite(out)).sum())
    c = compare(ref_out, out)
    # a broken output has no SQNR: the SQNR of its finite values would rank it above a working one
    return nonfinite, None if c.nonfinite_introduced else c.sqnr_db


def _run_nonfinite(store, run_id: str) -> int:
    """The run's forward records holding NaN/Inf when any of them is unexpected (``origin``), else 0: a mask's
    intended -inf never fails an island."""
    if first_nonfinite(store, run_id) is None:
        return 0
    return q.count_records(store, run_id, nonfinite=True, direction="forward")


def _ranked_modules(store, run_id: str, names: Sequence[str]) -> list[str]:
    """Modules to try keeping in fp32, best first: the module where the failure started (the first non-finite
    producer's), then the modules around it outward (an island that holds the value's whole path), then by local
    error."""

    ranked: list[str] = []
    fn = first_nonfinite(store, run_id)
    if fn is not None:
        m = innermost_module(fn.op, names)
        while m:
            if m not in ranked:
                ranked.append(m)
            m = innermost_module(m.rpartition(".")[0], names) if "." in m else ""
    for op in q.ops_by_local_error(store, run_id):
        m = innermost_module(op, names)
        if m and m not in ranked:
            ranked.append(m)
    return ranked


def _tolerance_of(tolerance: Tolerance | str | float | None, recipe) -> Tolerance:
    """``bisect_fp32_islands``' tolerance as a ``Tolerance``: the recipe's ``tolerance_db`` when none is given."""
    if tolerance is None:
        return Tolerance(recipe.tolerance_db)
    if isinstance(tolerance, Tolerance):
        return tolerance
    if isinstance(tolerance, (int, float)):
        return Tolerance(float(tolerance))
    return parse_tolerance(tolerance)


class _Search:
    """One island search: the runs it started from, each island tried (``attempt``) and judged once."""

    def __init__(self, store, info: SessionRow, recipe, tol: Tolerance, *, max_runs: int, parent: Optional[str],
                 progress: Progress, isolated: bool):
        self.store, self.info, self.recipe, self.tol = store, info, recipe, tol
        self.max_runs, self.progress, self.isolated = max_runs, progress, isolated
        runs = _runs(store, info.session_id)
        self.ref_run = next((r for r in runs if r.kind == "reference"), None)
        if self.ref_run is None:
            raise RerunError(f"session {info.name!r} has no fp32 reference run")
        self.par = _resolve_parent(runs, parent, info.name)
        self.base = run_policy(self.par) or recipe.default_policy
        self.names = _isolate(_module_names, recipe, isolated=isolated)
        self.ref = _run_model(recipe, run_policy(self.ref_run), isolated=isolated, run_name=self.ref_run.name,
                              kind="reference", local_error=False)
        self.ref_rids = _reference_rids(store, self.ref_run.run_id)
        self.result = BisectResult([], False, tol)
        self.tried: dict[tuple, Attempt] = {}

    def judge(self, run_id: str, island: tuple[str, ...], label: str, output) -> Attempt:
        tol = self.tol
        nf_out, sqnr = _output_quality(self.ref.output, output)
        nf = _run_nonfinite(self.store, run_id)
        ok = (tol.allow_nonfinite or (nf == 0 and nf_out == 0)) and (
            tol.min_sqnr_db is None or (sqnr is not None and sqnr >= tol.min_sqnr_db))
        return self.record(Attempt(run_id, island, label, nf, sqnr, ok))

    def record(self, a: Attempt) -> Attempt:
        self.tried[a.modules] = a
        self.result.attempts.append(a)
        return a

    def attempt(self, island: tuple[str, ...]) -> Attempt:
        if island in self.tried:
            return self.tried[island]
        recipe, isolated, max_runs = self.recipe, self.isolated, self.max_runs
        if not island:
            # the starting point is the parent run itself, already stored
            return self.judge(self.par.run_id, (), "", _isolate(_plain_output, recipe, self.base, isolated=isolated))
        if len(self.result.attempts) > max_runs:
            raise _Budget()
        label = "+".join(f"keep-fp32:{m}" for m in island)
        policy = apply_fixes(self.base, label)
        name = _unique_run_name(_runs(self.store, self.info.session_id), f"bisect: {label}")
        _tick(self.progress, len(self.tried), max_runs, f"model run {len(self.tried)} of at most {max_runs}: {name}")
        try:
            run = _run_model(recipe, policy, isolated=isolated, run_name=name, kind="rerun", local_error=True)
        except (RuntimeError, TypeError) as e:
            # the model cannot run with this island (an fp32 output meeting fp16 in a matmul of the model's own
            # code): a failed try, said once; the search goes on from the last run that ran
            self.result.notes.append(f"{label}: the model does not run with it ({first_line(str(e))})")
            return self.record(Attempt("", island, label, -1, None, False))
        with self.store.extend_session(self.info.name) as w:
            run_id, _ = _write(w, run, ref=self.ref, ref_run_id=self.ref_run.run_id, ref_rids=self.ref_rids,
                               parent_run_id=self.par.run_id, fix=label, kind="rerun", name=f"bisect: {label}")
        return self.judge(run_id, island, label, run.output)

    def grow_and_prune(self) -> list[str]:
        """Grow the island from where each failing run's failure starts until a run passes, then drop each module
        whose removal still passes; the island reached (``result.passed`` says whether it passes)."""
        result = self.result
        island: list[str] = []
        try:
            a = self.attempt(())
            ran = a
            while not a.passed:
                ran = a if a.run_id else ran
                nxt = next((m for m in _ranked_modules(self.store, ran.run_id, self.names) if m not in island
                            and not any(m.startswith(i + ".") for i in island)), None)
                if nxt is None:
                    result.message = (f"no further module to keep in fp32: {self.tol.describe()} is not reachable "
                                      "with fp32 islands alone")
                    break
                island.append(nxt)
                a = self.attempt(tuple(island))
            if a.passed:
                for m in list(island):
                    trial = tuple(x for x in island if x != m)
                    if self.attempt(trial).passed:
                        island = list(trial)
                result.passed = True
        except _Budget:
            result.message = f"stopped after {self.max_runs} runs without meeting {self.tol.describe()}"
        return island


def bisect_fp32_islands(store, session: str, *, tolerance: Tolerance | str | float | None = None,
                        max_runs: int = 16, parent: Optional[str] = None, progress: Progress = None,
                        isolated: bool = False) -> BisectResult:
    """Find a small set of modules to keep in fp32 so the run meets ``tolerance``.

    Greedy growth, then pruning: start from the parent run (default the
    session's candidate); while the run fails, keep in fp32 the module of the
    first non-finite producer (or, when everything is finite, the module with
    the worst local error) and run again; once it passes, drop each island
    module whose removal still passes.  Every tried run is stored in the
    session (kind ``rerun``, parent = the starting run, fix = the island
    tried).  Default tolerance: no NaN/Inf and the recipe's
    ``tolerance_db``.  ``max_runs`` bounds the new runs.  With ``isolated``
    every model run happens in a worker process (see ``rerun_session``).
    """
    info, recipe = session_recipe(store, session)
    tol = _tolerance_of(tolerance, recipe)
    if max_runs < 1:
        raise RerunError("max_runs must be at least 1")
    search = _Search(store, info, recipe, tol, max_runs=max_runs, parent=parent, progress=progress, isolated=isolated)
    result = search.result
    island = search.grow_and_prune()
    result.modules = island
    if result.notes and not result.passed:
        result.message += "; " + "; ".join(result.notes)
    if result.passed:
        result.message = (f"keeping {len(island)} module(s) in fp32 meets {tol.describe()}: "
                          + (", ".join(island) if island else "(none needed)"))

    diagnose_session(store, info.name)
    _tick(progress, max_runs, max_runs, "done")
    return result


class _Budget(Exception):
    pass
