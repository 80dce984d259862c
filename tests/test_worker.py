"""Dashboard re-runs run the user's model in a worker process: the server only writes what comes back, and a
model that kills its process ends that job with a sentence while the server goes on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from precision_lab.fixes.recipes import MODELS_ENV, RECIPES, entry_point_recipe, register_recipe
from precision_lab.services import jobs, worker
from precision_lab.services.report import first_nonfinite
from precision_lab.services.rerun import capture_recipe
from precision_lab.store import Store, close_all
from precision_lab.store import queries as q

pytestmark = pytest.mark.slow  # each job runs the model in a worker process

MODEL = str(Path(__file__).parent / "models" / "worker_probe.py")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("PL_PROBE_PIDS", str(pids))
    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:build,{MODEL}:build_crashing,{MODEL}:inputs")
    worker.shutdown()  # workers spawned from here on see this environment
    yield pids
    worker.shutdown()
    for name in [n for n in RECIPES if n.startswith("model:")]:
        RECIPES.unregister(name)
    close_all()


def _session(store, build: str) -> str:
    recipe = register_recipe(entry_point_recipe(f"{MODEL}:{build}", f"{MODEL}:inputs"), replace=True)
    return capture_recipe(store, recipe, local_error=False, session=build)


def _runs(store, name):
    return q.session_runs(store, store.session(name).session_id)


def test_a_dashboard_rerun_runs_the_model_in_another_process_and_fixes_it(probe, tmp_path):
    store = Store(tmp_path / "w.duckdb")
    name = _session(store, "build")
    cand = next(r for r in _runs(store, name) if r.kind == "candidate")
    assert first_nonfinite(store, cand.run_id) is not None  # fp16 overflows in `up`
    # the model's output holds inf: it has no SQNR, and no earlier op's SQNR stands in for it
    last = q.last_accumulated_output(store, cand.run_id)
    assert last.op == "forward.0" and last.sqnr_db is None
    here = {int(p) for p in probe.read_text().split()}
    assert here == {os.getpid()}

    job = jobs.start_rerun(store, name, "use-bf16")
    assert job.wait(300) and job.ok, job.error
    there = {int(p) for p in probe.read_text().split()} - here
    assert there and os.getpid() not in there  # both forward passes of the re-run were built elsewhere
    rerun = next(r for r in _runs(store, name) if r.run_id == job.run_id)
    assert rerun.kind == "rerun" and rerun.fix == "use-bf16"
    assert first_nonfinite(store, job.run_id) is None
    n = store.sql("SELECT count(*) FROM comparisons WHERE cand_run_id = ? AND kind = 'accumulated'",
                  [job.run_id]).fetchone()[0]
    m = store.sql("SELECT count(*) FROM tensors WHERE run_id = ?", [job.run_id]).fetchone()[0]
    assert n > 0 and m > 0


def test_a_model_that_kills_its_worker_ends_the_job_with_a_sentence(probe, tmp_path):
    store = Store(tmp_path / "c.duckdb")
    name = _session(store, "build_crashing")
    before = len(_runs(store, name))
    job = jobs.start_rerun(store, name, "use-bf16")
    assert job.wait(300) and not job.ok
    assert "worker process" in job.error and "ended abruptly" in job.error and "nothing of it was stored" in job.error
    assert len(_runs(store, name)) == before  # no half run
    # the server goes on: the next re-run gets a fresh worker
    other = _session(store, "build")
    job2 = jobs.start_rerun(store, other, "use-bf16")
    assert job2.wait(300) and job2.ok, job2.error
    assert first_nonfinite(store, job2.run_id) is None


def test_an_error_in_the_users_model_comes_back_as_its_own_sentence(probe, tmp_path, monkeypatch):
    store = Store(tmp_path / "e.duckdb")
    name = _session(store, "build")
    monkeypatch.setenv(MODELS_ENV, f"{MODEL}:inputs")  # the server no longer allows the model
    job = jobs.start_rerun(store, name, "use-bf16")
    assert job.wait(300) and not job.ok
    assert "never run on their own" in job.error and "Traceback" not in job.error
