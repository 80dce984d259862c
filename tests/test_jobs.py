"""The background re-run pool: bounded concurrency, a bounded queue, finished jobs forgotten."""

from __future__ import annotations

import threading

from precision_lab.services import jobs


class _Store:
    path = "/nowhere/test-jobs.duckdb"


def test_at_most_max_workers_run_at_once_and_the_rest_wait(monkeypatch):
    release = threading.Event()
    lock = threading.Lock()
    running, peak, started = [0], [0], []

    def fake(store, session, fix, progress, parent=None, isolated=False):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(fix)
        release.wait(30)
        with lock:
            running[0] -= 1
        return f"run-{fix}"

    monkeypatch.setattr(jobs, "rerun_session", fake)
    store = _Store()
    js = [jobs.start_rerun(store, "pool", f"fix{i}") for i in range(5)]
    assert jobs.start_rerun(store, "pool", "fix0") is js[0]  # the same request joins the queued or running job
    for _ in range(200):
        if len(started) >= jobs.MAX_WORKERS:
            break
        threading.Event().wait(0.01)
    assert len(started) == jobs.MAX_WORKERS
    assert sum(j.label == "queued" for j in js) == len(js) - jobs.MAX_WORKERS
    assert len(jobs.running_jobs(store, "pool")) == len(js)
    release.set()
    assert all(j.wait(30) for j in js)
    assert peak[0] == jobs.MAX_WORKERS and [j.run_id for j in js] == [f"run-fix{i}" for i in range(5)]
    assert jobs.running_jobs(store, "pool") == []


def test_a_full_queue_refuses_and_finished_jobs_are_forgotten(monkeypatch):
    release = threading.Event()
    started = threading.Semaphore(0)

    def fake(*a, **k):
        started.release()
        release.wait(30)
        return "r"

    monkeypatch.setattr(jobs, "rerun_session", fake)
    monkeypatch.setattr(jobs, "MAX_QUEUED", 2)
    monkeypatch.setattr(jobs, "MAX_FINISHED", 3)
    store = _Store()
    js = [jobs.start_rerun(store, "full", f"f{i}") for i in range(jobs.MAX_WORKERS)]
    for _ in range(jobs.MAX_WORKERS):  # every worker busy
        assert started.acquire(timeout=30)
    js += [jobs.start_rerun(store, "full", f"q{i}") for i in range(2)]  # these wait in the queue
    refused = jobs.start_rerun(store, "full", "one-too-many")
    assert refused.finished and "the server is busy: 2 re-runs are waiting" in refused.error
    release.set()
    assert all(j.wait(30) and j.ok for j in js)
    for i in range(6):  # finished jobs pile up; only the newest MAX_FINISHED are kept
        jobs.start_rerun(store, "full", f"g{i}").wait(30)
    kept = [k for k, j in jobs._JOBS.items() if k[1] == "full" and j.finished]
    assert len(kept) <= 3 + 1


def test_a_job_says_what_it_is_doing_and_for_how_long(monkeypatch):
    job = jobs.RerunJob("s", "stable-softmax")
    assert job.status == "queued"  # not started: no time yet
    job.progress(1, 4, "fix: stable-softmax: model run 2 of 2, fp16")
    job.started = 1000.0
    monkeypatch.setattr(jobs.time, "monotonic", lambda: 1042.7)
    assert job.status == "fix: stable-softmax: model run 2 of 2, fp16 · 42 s"
    monkeypatch.setattr(jobs.time, "monotonic", lambda: 1065.0 + 60)
    assert job.status.endswith(" · 2 min 05 s")
