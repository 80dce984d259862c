"""Writers that meet each other: two re-runs of one fix at once get two names, and a verify that meets another
process's lock says so (exit 2) instead of passing it off as a verdict on the fix."""

from __future__ import annotations

import threading

import pytest
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.services.rerun import capture_recipe, rerun_session
from precision_lab.store import DatabaseLocked
from precision_lab.store import queries as q


@pytest.fixture
def recipe_session(store):
    return capture_recipe(store, "softmax-fp16-overflow")


def test_two_reruns_of_one_fix_at_once_get_two_names(store, recipe_session):
    got, errors = [], []
    go = threading.Barrier(2)

    def one():
        try:
            go.wait()
            got.append(rerun_session(store, recipe_session, "stable-softmax"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(got) == 2
    runs = q.session_runs(store, store.session(recipe_session)["session_id"])
    names = sorted(r["name"] for r in runs if r["kind"] == "rerun")
    assert names == ["fix: stable-softmax", "fix: stable-softmax (2)"]


def test_verify_that_meets_a_lock_exits_2_with_the_lock_sentence(store, recipe_session, monkeypatch):
    from precision_lab.services import verify

    def locked(*a, **k):
        raise DatabaseLocked(f"database {store.path} is locked by another process (pid 4242: precision-lab "
                             "ingest a/b); waited 5 s")

    monkeypatch.setattr(verify, "rerun_session", locked)
    res = CliRunner().invoke(app, ["verify", "--session", recipe_session, "--db", store.path])
    assert res.exit_code == 2, res.output
    assert "locked by another process" in res.output and "works" not in res.output and "cannot" not in res.output
