"""Re-runs in the background, for the dashboard's "Re-run with fix" button.

``start_rerun(store, session, fix)`` queues ``rerun_session`` for a small
pool of daemon worker threads (``MAX_WORKERS``) and returns a ``RerunJob``
the page polls (``fraction``, ``label``, ``finished``, then ``run_id`` or
``error``).  A second request for the same session and fix while one is
queued or running returns that job instead of starting another; more than
``MAX_QUEUED`` waiting jobs are refused with a sentence; finished jobs are
forgotten beyond the newest ``MAX_FINISHED``.  The model itself runs in a
worker process (``services.worker``): a crash in a user's model ends that
job with a sentence, not the server.  A worker thread writes through its
own cursor of the shared Store (the Store gives each thread one); nothing
here touches Streamlit.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from .islands import bisect_fp32_islands
from .rerun import RerunError, rerun_session, session_recipe
from ..fixes.catalogue import FixError, fix_label, parse_fix, split_specs
from .cards import DiagnosisCard
from .verify import Verifications, untried, verification

__all__ = ["RerunJob", "RerunAction", "start_rerun", "start_grow", "start_verify", "running_jobs", "rerun_actions", "rerun_blocker", "MAX_WORKERS", "MAX_QUEUED",
           "MAX_FINISHED"]

MAX_WORKERS = 2  # re-runs at once: each holds a model and its activations in memory
MAX_QUEUED = 16  # waiting re-runs before new ones are refused
MAX_FINISHED = 64  # finished jobs remembered (their result is in the database anyway)

_JOBS: dict[tuple, "RerunJob"] = {}  # insertion order: oldest first
_LOCK = threading.Lock()
_QUEUE: "queue.Queue[tuple[RerunJob, Callable[[], None]]]" = queue.Queue()
_WORKERS: list[threading.Thread] = []


@dataclass
class RerunJob:
    session: str
    fix: str
    parent: Optional[str] = None
    done: int = 0
    total: int = 1
    label: str = "queued"
    run_id: Optional[str] = None
    error: Optional[str] = None
    finished: bool = False
    started: Optional[float] = None  # time.monotonic() when a worker took it
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def status(self) -> str:
        """What the job is doing, in a line: the step it is at (which model run of how many) and how long it has
        run (``fix: stable-softmax: model run 2 of 2, fp16 · 1 min 05 s``)."""
        if self.started is None:
            return self.label
        took = int(max(0.0, time.monotonic() - self.started))
        return f"{self.label} · " + (f"{took // 60} min {took % 60:02d} s" if took >= 60 else f"{took} s")

    @property
    def fraction(self) -> float:
        return 1.0 if self.finished else (max(0.0, min(1.0, self.done / self.total)) if self.total else 0.0)

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None and self.run_id is not None

    def progress(self, done: int, total: int, label: str) -> None:
        self.done, self.total, self.label = done, total, label

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the job ends (tests, scripts); True when it has."""
        self._done.wait(timeout)
        return self.finished

    def _finish(self) -> None:
        self.finished = True
        self._done.set()


def _key(store, session: str, fix: str, parent: Optional[str]) -> tuple:
    return (getattr(store, "path", id(store)), session, fix, parent)


def _worker() -> None:
    while True:
        job, work = _QUEUE.get()
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - a worker never dies with a job
            job.error = job.error or f"{type(e).__name__}: {e}"
        finally:
            job._finish()


def _forget_finished() -> None:
    """Drop the oldest finished jobs beyond ``MAX_FINISHED`` (caller holds ``_LOCK``)."""
    done = [k for k, j in _JOBS.items() if j.finished]
    for k in done[:max(0, len(done) - MAX_FINISHED)]:
        del _JOBS[k]


def _start(store, session: str, fix: str, parent: Optional[str], run: Callable[["RerunJob"], None]) -> RerunJob:
    """Queue ``run(job)`` for the worker pool as the job (session, fix, parent); a request for one queued or
    running joins it."""
    key = _key(store, session, fix, parent)
    with _LOCK:
        job = _JOBS.get(key)
        if job is not None and not job.finished:
            return job
        _forget_finished()
        job = RerunJob(session, fix, parent)
        waiting = _QUEUE.qsize()  # jobs no worker has taken yet
        if waiting >= MAX_QUEUED:
            job.error = (f"the server is busy: {waiting} re-runs are waiting; try again when one of them has "
                         "finished")
            job._finish()
            return job
        _JOBS.pop(key, None)
        _JOBS[key] = job
        while len(_WORKERS) < MAX_WORKERS:
            t = threading.Thread(target=_worker, name=f"precision-lab rerun worker {len(_WORKERS)}", daemon=True)
            t.start()
            _WORKERS.append(t)

    def work() -> None:
        job.label = "starting"
        job.started = time.monotonic()
        try:
            run(job)
        except Exception as e:  # reported to the page as a sentence
            msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
            job.error = msg.strip() or type(e).__name__

    _QUEUE.put((job, work))
    return job


def start_rerun(store, session: str, fix: str, *, parent: Optional[str] = None) -> RerunJob:
    """Queue re-running ``session`` under ``fix`` (a spec, ``+`` joins several) for the worker pool."""

    def run(job: RerunJob) -> None:
        job.run_id = rerun_session(store, session, fix, job.progress, parent=parent, isolated=True)

    return _start(store, session, fix, parent, run)


GROW = "grow an fp32 island"  # the job's fix label while it searches


def start_grow(store, session: str, *, tolerance=None) -> RerunJob:
    """Queue growing an fp32 island along the data flow (``bisect_fp32_islands``, every model run in a worker
    process); the job's ``run_id`` is the island's run, its ``error`` says why none was found."""

    def run(job: RerunJob) -> None:
        res = bisect_fp32_islands(store, session, tolerance=tolerance, progress=job.progress, isolated=True)
        if res.passed and res.modules:
            job.fix, job.run_id = res.fix, res.final_run_id
        else:
            job.error = res.message or "no fp32 island was needed"

    return _start(store, session, GROW, None, run)


def running_jobs(store, session: str) -> list[RerunJob]:
    """Jobs of a session that have not finished yet."""
    path = getattr(store, "path", id(store))
    with _LOCK:
        return [j for k, j in _JOBS.items() if k[0] == path and k[1] == session and not j.finished]


def rerun_blocker(store, session: str) -> Optional[str]:
    """Why this server cannot re-run a session (a sentence), or None when it can: a dump holds no model, and a
    user's model is run again only when this server allows its entry point."""
    try:
        session_recipe(store, session)
    except RerunError as e:
        return str(e)
    return None


@dataclass(frozen=True, slots=True)
class RerunAction:
    """What a diagnosis card offers for one fix it proposes: the button's ``label``, the ``fix`` spec, ``reason``
    (the catalogue's one-line reasons of the fix's parts, joined) and ``parent`` (the run the diagnosis is about).
    ``running``: the ``RerunJob`` making it now, from this tab or any other (the button says so and makes no second
    one).  ``existing``: the run this fix already made from the same parent (a re-run is deterministic: the page
    opens that run instead of making a copy), with ``works`` (the re-run holds no unexpected NaN/Inf),
    ``sqnr_db`` (its output against fp32) and ``first_nonfinite``; the label says which (a fix known to leave
    the run non-finite is never offered as a cure)."""

    label: str
    fix: str
    reason: str
    parent: Optional[str]
    existing: Optional[str] = None
    works: Optional[bool] = None
    sqnr_db: Optional[float] = None
    first_nonfinite: Optional[str] = None
    running: Optional[RerunJob] = None


def rerun_actions(store, session: str, cards: list[DiagnosisCard], *, made: Optional[Verifications] = None
                  ) -> tuple[Optional[str], list[list[RerunAction]]]:
    """What the diagnosis cards offer: ``(blocker, actions per card)``.

    ``blocker`` is ``rerun_blocker``'s sentence (then no card offers anything), else None.  Each card offers a
    ``RerunAction`` per proposed fix whose spec parses.  The session is looked up once for all cards.
    """
    blocker = rerun_blocker(store, session) if any(c.fixes for c in cards) else None
    if blocker is not None or not cards:
        return blocker, [[] for _ in cards]
    if made is None:  # ``verification(store, session)``, when the caller has it already
        made = verification(store, session)
    # a re-run queued or running, from any tab or user of this server, offers no second button
    running = {(j.fix, j.parent): j for j in running_jobs(store, session)}
    out = []
    for card in cards:
        actions = []
        for f in card.fixes if card.rule != "fix-verified" else ():
            try:
                specs = split_specs(f)
                reason = " / ".join(parse_fix(s).reason for s in specs)
            except FixError:
                continue
            tried = made.get(card.run_id, fix_label(specs))
            job = running.get((f, card.run_id))
            if job is not None:
                actions.append(RerunAction(f"Re-running with {f}: {job.status}", f, reason, card.run_id,
                                           running=job))
            elif tried is not None:
                label = f"Open {tried.run}: {tried.outcome()}"
                actions.append(RerunAction(label, f, reason, card.run_id, tried.run, tried.works, tried.sqnr_db,
                                           tried.first_nonfinite))
            else:
                actions.append(RerunAction(f"Re-run with {f}", f, reason, card.run_id))
        out.append(actions)
    return blocker, out


def start_verify(store, session: str, *, top: int = 3) -> list[RerunJob]:
    """Queue a re-run of each of the session's first ``top`` suggested fixes not tried yet (the verdicts are
    then read from the re-runs: ``verify.verification``)."""
    return [start_rerun(store, session, s.fix, parent=s.parent) for s in untried(store, session, top=top)]
