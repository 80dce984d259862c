"""Run recipes under policies, re-run a session under a fix, search fp32 islands.

Every session made here is a small ledger: an fp32 ``reference`` run, the
``candidate`` under the recipe's failing policy, and ``rerun`` runs whose
``parent_run_id`` is the run they edit and whose ``fix`` is the fix spec
that made them.  Each candidate or re-run is compared op by op with the
reference (``accumulated``, element-wise) and each op with its own fp32
recomputation (``local``); diagnoses are refreshed after every write.

``rerun_session`` is what the dashboard's "Re-run with fix" button calls. It
is safe to call from a background thread: it uses the calling thread's
store cursor, writes in one transaction, and runs models one at a time
(a recipe seeds torch's global random generator while it builds).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Optional

from ..fixes.catalogue import apply_fixes, fix_label, split_specs
from ..fixes.policy import PrecisionPolicy, call_model, first_tensor
from ..fixes.recipes import (BUILD_LOCK, MODEL_PREFIX, MODELS_ENV, RECIPES_ENV, Recipe, RecipeError, RecipeNotFound,
                             allowed_models, get_recipe)
from ..paths import replay_kit_path
from ..records import RunInfo, free_name
from ..store import queries as q
from ..store.rows import SessionRow
from .diagnose import diagnose_session
from .pairing import Item, compare_runs
from .sessions import recipe_name, run_policy
from .worker import WorkerCrashed, run_in_worker

__all__ = ["RerunError", "capture_recipe", "rerun_session", "session_recipe", "replay_kit"]

Progress = Optional[Callable[[int, int, str], None]]

# building a recipe reseeds torch's global generator and a capture pushes a
# function mode: one model run at a time per process (re-entrant: a run builds)
_RUN_LOCK = BUILD_LOCK


class RerunError(ValueError):
    """A session cannot be re-run; the message says why and what to do instead."""


# ---- running a recipe under capture -----------------------------------------------------

@dataclass
class _Run:
    cap: object  # live.Capture
    output: object  # the model's output tensor
    tensors: dict  # (step, rank, name) -> kept tensor


def _forward(recipe: Recipe, policy: Optional[PrecisionPolicy], *, run_name: str, kind: str,
             local_error: bool, kit: Optional[str] = None) -> _Run:
    """Run ``recipe`` under ``policy`` with every tensor kept; ``kit``: the path of a replay kit, whose steps are
    replayed from their kept state instead of training the recipe from its start."""
    import torch  # deferred: importing the re-run use case (dashboard, CLI help) must not load torch

    pair = _pairing_capture()
    Capture, CaptureOptions = pair.Capture, pair.CaptureOptions
    backward = recipe.loss_fn is not None
    opts = CaptureOptions(local_error=local_error, keep_tensors=("*",), backward=backward)
    with _RUN_LOCK:
        model, inputs = recipe.build()
        if kit is not None:
            cap, out = pair.replay_capture(model, kit, policy, loss_fn=recipe.loss_fn, optimizer_fn=recipe.optimizer_fn,
                                           run_name=run_name, kind=kind, source=f"replay:{recipe.name}", options=opts)
        else:
            cap = Capture(model, run=run_name, dtype_policy=policy, options=opts, write=False, kind=kind,
                          source=f"recipe:{recipe.name}")
            with torch.set_grad_enabled(backward):
                out = pair.run_steps(cap, inputs, recipe.loss_fn, recipe.seed, recipe.optimizer_fn, recipe.steps)
    tensors = {}
    for rec in cap.records:
        if rec.tensor is not None:
            tensors[(rec.step, rec.rank, rec.name)] = rec.tensor
        rec.tensor = None  # activations are compared now, not stored
    for name, mod in cap.model.named_modules():
        err = getattr(mod, "calibration_error", None)
        if err:
            cap.warnings.append((name, f"histogram calibration failed: {err}"))
    out = first_tensor(out)
    return _Run(cap.detached(), out.detach() if out is not None else None, tensors)


def _named(fn_name: str, recipe_name: str, *args, **kwargs):
    """``fn(recipe, *args, **kwargs)`` for one of this module's model-running functions, the recipe found by
    name: what a worker process runs."""
    return _IN_WORKER[fn_name](get_recipe(recipe_name), *args, **kwargs)


def _isolate(fn, recipe: Recipe, *args, isolated: bool, **kwargs):
    """``fn(recipe, *args, **kwargs)`` here, or in a worker process when ``isolated`` (the recipe is found there
    by name, under this process's recipe and model settings): every call that runs a user's model goes
    through here."""
    if not isolated:
        return fn(recipe, *args, **kwargs)
    # the worker runs what this process may run: $PRECISION_LAB_MODELS and, on a local dashboard, the user's list
    env = {RECIPES_ENV: os.environ.get(RECIPES_ENV), MODELS_ENV: ",".join(sorted(allowed_models())) or None}
    try:
        return run_in_worker(_named, fn.__name__, recipe.name, *args, env=env,
                             what=f"the model of {recipe.name!r}", **kwargs)
    except WorkerCrashed as e:
        raise RerunError(str(e)) from None


def _run_model(recipe: Recipe, policy: Optional[PrecisionPolicy], *, isolated: bool, **kwargs) -> _Run:
    """``_forward``, here or in a worker process (``_isolate``)."""
    return _isolate(_forward, recipe, policy, isolated=isolated, **kwargs)


def _write(w, run: _Run, *, ref: Optional[_Run], ref_run_id: Optional[str], ref_rids: Optional[dict],
           parent_run_id: Optional[str] = None, fix: Optional[str] = None, kind: Optional[str] = None,
           progress: Progress = None, name: Optional[str] = None) -> tuple[str, dict]:
    """Add a captured run (records, local comparisons, warnings) and its accumulated comparisons; ``name``: the
    name it is given, made free among the session's runs inside this transaction."""
    judged_run_dtype = _pairing_capture().judged_run_dtype
    cap = run.cap
    if name is not None:
        cap.run = w.free_run_name(name)
    rids = cap.write_run(w)
    run_id = cap.run_id
    if parent_run_id is not None or fix is not None or kind is not None:
        w.set_run_lineage(run_id, parent_run_id=parent_run_id, fix=fix, kind=kind)
    by_name = {(r.step, r.rank, r.name): rid for r, rid in zip(cap.records, rids)}
    if ref is not None and ref_rids is not None:
        ref_items = []
        for rec in ref.cap.records:
            key = (rec.step, rec.rank, rec.name)
            if key in ref_rids:
                ref_items.append(Item(ref_rids[key], _with_tensor(rec, ref.tensors.get(key)), True))
        cand_items = [Item(rid, _with_tensor(rec, run.tensors.get((rec.step, rec.rank, rec.name))), True)
                      for rec, rid in zip(cap.records, rids)]
        compare_runs(w, ref_items, cand_items, ref_run_id=ref_run_id, cand_run_id=run_id,
                     run_dtype=judged_run_dtype(cap.policy, cap.dominant_dtype()), progress=progress)
    return run_id, by_name


def _with_tensor(rec, tensor):
    return dataclasses.replace(rec, tensor=tensor)


def _pairing_capture():
    """``services.capture`` (capture_pair, PairOptions, Capture, CaptureOptions): it imports torch at its top."""
    from . import capture  # deferred: listing sessions and queueing re-runs must not load torch

    return capture


def _tick(progress: Progress, done: int, total: int, label: str) -> None:
    if progress is not None:
        progress(done, total, label)


def capture_recipe(store, recipe, *, policy: Optional[PrecisionPolicy] = None, fixes=(), session: Optional[str] = None,
                   progress: Progress = None, local_error: bool = True) -> str:
    """Capture a recipe's fp32 reference and its candidate in a new session; returns the session name.

    The candidate runs under ``policy`` (default: the recipe's failing
    ``default_policy``) edited by ``fixes``.  This is what ``precision-lab
    capture --recipe`` does (through ``precision_lab.capture_pair``), and the
    new session is diagnosed.
    """
    pairing = _pairing_capture()
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    base = policy or recipe.default_policy
    specs = split_specs(fixes)
    cand_policy = apply_fixes(base, specs) if specs else base
    label = fix_label(specs) if specs else None
    _tick(progress, 0, 2, f"capture {recipe.name}: fp32 reference and {cand_policy.describe()}")
    cand_name = f"candidate ({cand_policy.name})" + (f" + {label}" if label else "")
    pair = pairing.PairOptions(reference_name="fp32 reference", candidate_name=cand_name, seed=recipe.seed,
                               loss_fn=recipe.loss_fn, optimizer_fn=recipe.optimizer_fn, steps=recipe.steps,
                               local_error=local_error, source=f"recipe:{recipe.name}", recipe=recipe.name)
    with _RUN_LOCK:
        name = pairing.capture_pair(recipe.build_model, recipe.inputs(), cand_policy, store=store, pair=pair,
                                    name=session or recipe.name)
    _tick(progress, 2, 2, "done")
    return name


def session_recipe(store, session: str) -> tuple[dict, Recipe]:
    """A session and the recipe it was made from; RerunError for dump-only sessions."""
    info = store.session(session)
    name = recipe_name(store, info)
    if not name:
        raise RerunError(
            f"session {info.name!r} holds dumps, not a model: re-running needs the model. Capture it with "
            "`precision-lab capture --model FILE.py:FUNCTION --inputs FILE.py:FUNCTION` (or --recipe NAME), or "
            "replay single ops from a tensor-mode dump (precision_lab.services.replay.replay_op)")
    try:
        return info, get_recipe(name)
    except RecipeNotFound as e:
        if name.startswith(MODEL_PREFIX):
            raise RerunError(f"session {info.name!r}: {e}") from None
        raise RerunError(f"session {info.name!r} was made from recipe {name!r}, which this server does not "
                         f"have ({e}); register it with PRECISION_LAB_RECIPES") from None
    except RecipeError as e:  # an allowed entry point that no longer imports
        raise RerunError(f"session {info.name!r}: {e}") from None


def _runs(store, sid: str) -> list[RunInfo]:
    return q.session_runs(store, sid)


def _resolve_parent(runs: list[RunInfo], parent: Optional[str], session: str) -> RunInfo:
    if parent is not None:
        hit = [r for r in runs if parent in (r.run_id, r.name)]
        if not hit:
            raise RerunError(f"session {session!r} has no run {parent!r} (runs: {', '.join(r.name for r in runs)})")
        if hit[0].kind == "reference":
            raise RerunError(f"run {parent!r} is the fp32 reference; re-run a low-precision run")
        return hit[0]
    cands = [r for r in runs if r.kind == "candidate"] or [r for r in runs if r.kind != "reference"]
    if not cands:
        raise RerunError(f"session {session!r} has no low-precision run to re-run")
    return cands[0]


def _reference_rids(store, ref_run_id: str) -> dict:
    return q.record_ids_by_name(store, ref_run_id).by_name


def _unique_run_name(runs: list[RunInfo], base: str) -> str:
    return free_name(base, {r.name for r in runs}, "{base} ({i})")


def rerun_session(store, session: str, fixes, progress: Progress = None, *, parent: Optional[str] = None,
                  diagnose: bool = True, isolated: bool = False) -> str:
    """Re-run a recipe session under ``fixes``; returns the new run's id.

    ``fixes``: a spec (``"scale-fp32"``, ``"scale-fp32+amax-floor:1e-12"``)
    or a list of specs, applied to the policy of ``parent`` (a run name or
    id; default the session's candidate).  The new run (kind ``rerun``)
    records ``parent`` and the fix, is compared with the session's fp32
    reference, and the session's diagnoses are refreshed.  ``progress(done,
    total, label)`` is called as it goes.  With ``isolated`` the model runs
    in a worker process (``services.worker``) and this process only writes:
    the dashboard's re-runs, where a crash in the user's model must not take
    the server with it.  Raises ``RerunError`` (dump-only session, unknown
    run, a worker that died), ``FixError`` (bad or inapplicable fix) or
    ``PolicyError`` (a pattern that names no module).
    """
    specs = split_specs(fixes)
    if not specs:
        raise RerunError("a re-run needs at least one fix (e.g. scale-fp32, keep-fp32:<module>)")
    info, recipe = session_recipe(store, session)
    kit = replay_kit(store, info)
    if kit is not None:
        return _rerun_replay(store, info, recipe, kit, specs, progress, parent=parent, diagnose=diagnose,
                             isolated=isolated)
    runs = _runs(store, info.session_id)
    ref_run = next((r for r in runs if r.kind == "reference"), None)
    if ref_run is None:
        if "capture" in info.notes:  # a training job's own capture
            raise RerunError(
                f"session {info.name!r} has no fp32 reference run to compare a re-run with, and its capture kept "
                "no replay kit: pass capture(..., optimizer=opt, recipe=...) with "
                "CaptureOptions(every=N, keep_last=K) so the steps before a failure are kept and replayed")
        raise RerunError(f"session {info.name!r} has no fp32 reference run to compare a re-run with")
    par = _resolve_parent(runs, parent, info.name)
    label = fix_label(specs)
    policy = apply_fixes(run_policy(par) or recipe.default_policy, specs)
    _check_policy(recipe, policy)
    name = _unique_run_name(runs, f"fix: {label}")
    _tick(progress, 0, 4, f"{name}: model run 1 of 2, the fp32 reference")
    ref = _run_model(recipe, run_policy(ref_run), isolated=isolated, run_name=ref_run.name,
                     kind="reference", local_error=False)
    _tick(progress, 1, 4, f"{name}: model run 2 of 2, {policy.describe()}")
    cand = _run_model(recipe, policy, isolated=isolated, run_name=name, kind="rerun", local_error=True)
    _tick(progress, 2, 4, f"{name}: comparing with the fp32 reference")
    ref_rids = _reference_rids(store, ref_run.run_id)
    with store.extend_session(info.name) as w:
        run_id, _ = _write(w, cand, ref=ref, ref_run_id=ref_run.run_id, ref_rids=ref_rids,
                           parent_run_id=par.run_id, fix=label, kind="rerun", name=f"fix: {label}")
    _tick(progress, 3, 4, f"{name}: diagnosing")
    if diagnose:
        diagnose_session(store, info.name)
    _tick(progress, 4, 4, f"{name}: done")
    return run_id


# ---- a training run's failing steps, replayed from the state the capture kept ---------------------

def replay_kit(store, info: SessionRow) -> Optional[str]:
    """The path of the replay kit a session's capture kept (``live.replaykit``), None where it kept none.  The
    path is made from the database's and the captured run's, never read from the session."""
    note = info.notes.get("replay")
    if not isinstance(note, dict) or not isinstance(note.get("run_id"), str):
        return None
    runs = {r.run_id for r in _runs(store, info.session_id)}
    if note["run_id"] not in runs:  # an imported session's runs have new ids: its kit stayed where it was made
        return None
    try:
        path = replay_kit_path(store.path, note["run_id"])
    except ValueError:
        return None
    return str(path) if path is not None and path.is_file() else None


REPLAY_SOURCE = "replay:"


def _rerun_replay(store, info: SessionRow, recipe: Recipe, kit: str, specs: list, progress: Progress, *,
                  parent: Optional[str], diagnose: bool, isolated: bool) -> str:
    """``rerun_session`` for a session whose capture kept a replay kit: the kept steps are replayed in fp32 (the
    reference, stored with the first re-run) and under the fix, from the state the first of them started from;
    the fix edits the configuration the capture saw the job run in (its autocast and GradScaler)."""
    if recipe.loss_fn is None or recipe.optimizer_fn is None:
        raise RerunError(f"session {info.name!r}: recipe {recipe.name!r} has no loss_fn and optimizer_fn, "
                         "and replaying training steps needs both")
    runs = _runs(store, info.session_id)
    replayed = [r for r in runs if (r.source or "").startswith(REPLAY_SOURCE)]
    captured = next((r for r in runs if r not in replayed), None)
    par = _resolve_parent(runs, parent, info.name) if parent is not None else captured
    base = run_policy(par) if par is not None else None
    if base is None:
        raise RerunError(f"session {info.name!r}: its capture saw the model run as it is (no torch.autocast, "
                         "no policy), so no fix of a low-precision configuration applies; capture inside the "
                         "job's torch.autocast")
    policy = apply_fixes(base, specs)
    _check_policy(recipe, policy)
    note = info.notes["replay"]
    span = f"steps {note['from_step']}-{note['failed_step']}" if note["failed_step"] != note["from_step"] \
        else f"step {note['failed_step']}"
    ref_run = next((r for r in replayed if r.kind == "reference"), None)
    label = fix_label(specs)
    name = _unique_run_name(runs, f"fix: {label}")
    _tick(progress, 0, 4, f"{name}: replaying {span} in fp32, the reference")
    ref = _run_model(recipe, None, isolated=isolated, run_name=ref_run.name if ref_run else f"fp32 replay ({span})",
                     kind="reference", local_error=False, kit=kit)
    _tick(progress, 1, 4, f"{name}: replaying {span} under {policy.describe()}")
    cand = _run_model(recipe, policy, isolated=isolated, run_name=name, kind="rerun", local_error=True, kit=kit)
    _tick(progress, 2, 4, f"{name}: comparing with the fp32 reference")
    with store.extend_session(info.name) as w:
        # read again inside the write: a re-run from another tab may have stored the reference meanwhile
        ref_run = next((r for r in _runs(store, info.session_id) if r.kind == "reference"
                        and (r.source or "").startswith(REPLAY_SOURCE)), None)
        if ref_run is None:
            ref_run_id, ref_rids = _write(w, ref, ref=None, ref_run_id=None, ref_rids=None, kind="reference",
                                          name=ref.cap.run)
        else:
            ref_run_id, ref_rids = ref_run.run_id, _reference_rids(store, ref_run.run_id)
        run_id, _ = _write(w, cand, ref=ref, ref_run_id=ref_run_id, ref_rids=ref_rids, parent_run_id=par.run_id,
                           fix=label, kind="rerun", name=f"fix: {label}")
    _tick(progress, 3, 4, f"{name}: diagnosing")
    if diagnose:
        diagnose_session(store, info.name)
    _tick(progress, 4, 4, f"{name}: done")
    return run_id


def _check_policy(recipe: Recipe, policy: PrecisionPolicy) -> None:
    """Fail before any run when a fix names a module the recipe's model does not have."""
    with _RUN_LOCK:
        model, _ = recipe.build()
    policy.prepare(model)


def _plain_output(recipe: Recipe, policy: PrecisionPolicy):
    """The model's output under ``policy``, without capture."""
    import torch  # deferred: see _forward

    with _RUN_LOCK:
        model, inputs = recipe.build()
    policy.prepare(model)
    x = policy.prepare_inputs(inputs)
    with torch.no_grad():
        return first_tensor(call_model(model, x))


def _module_names(recipe: Recipe) -> list[str]:
    with _RUN_LOCK:
        model, _ = recipe.build()
    return [n for n, _ in model.named_modules() if n]


# the functions that run a user's model, by name, for _named in a worker process
_IN_WORKER = {f.__name__: f for f in (_forward, _plain_output, _module_names)}

