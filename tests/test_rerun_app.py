"""The dashboard's "Re-run with fix" button on a diagnosis card (AppTest)."""

import pytest

from precision_lab.services.rerun import capture_recipe
from precision_lab.services.report import first_nonfinite

from ui_fixtures import assert_clean, open_page, serve_db, texts


@pytest.fixture
def recipe_db(tmp_path, monkeypatch):
    from precision_lab.store import Store

    db = tmp_path / "app.duckdb"
    store = Store(db)
    name = capture_recipe(store, "softmax-fp16-overflow")
    with serve_db(db, monkeypatch):
        yield store, name


@pytest.mark.slow
def test_rerun_button_runs_the_fix_and_opens_the_n_run_diff(recipe_db):
    store, name = recipe_db
    sid = store.session(name).session_id
    cand = store.sql("SELECT run_id FROM runs WHERE session_id = ? AND kind = 'candidate'", [sid]).fetchone()[0]
    at = open_page("overview", session=name)
    body = texts(at)
    assert "exp\\(\\) overflows fp16" in body  # the message outside its `quoted` names is escaped
    button = at.button(key="rerun_0_0")
    assert "stable" in button.label and "softmax" in button.label
    button.click().run()
    assert_clean(at)
    job = at.session_state["_pl_rerun"]
    assert job.wait(300) and job.error is None, job.error
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Diff"
    assert at.radio(key="view").value == "runs"
    # it lands on the op the fix was for: where the candidate first went non-finite
    landing = first_nonfinite(store, cand).op
    assert at.text_input(key="q").value == landing and at.query_params["q"] == landing
    runs = store.df("SELECT run_id, name, kind, parent_run_id, fix FROM runs WHERE session_id = ?", [sid])
    new = runs[runs.kind == "rerun"].iloc[0]
    assert new.run_id == job.run_id and new.parent_run_id == cand and new.fix == "stable-softmax"
    assert first_nonfinite(store, job.run_id) is None
    table = next(d.value for d in at.dataframe if any(str(new["name"]) in str(c) for c in d.value.columns))
    assert len(table) > 0


def test_read_only_server_offers_no_rerun(recipe_db, monkeypatch):
    _, name = recipe_db
    monkeypatch.setenv("PRECISION_LAB_READ_ONLY", "1")
    at = open_page("overview", session=name)
    assert not [b for b in at.button if b.key and b.key.startswith("rerun_")]


@pytest.mark.slow
def test_a_fix_already_run_opens_that_run_instead_of_a_copy(recipe_db):
    from precision_lab.services.rerun import rerun_session

    store, name = recipe_db
    sid = store.session(name).session_id
    rerun_session(store, name, "stable-softmax")
    at = open_page("overview", session=name)
    assert_clean(at)
    button = at.button(key="rerun_0_0")
    assert button.label.replace("\\", "").startswith("Open fix: stable-softmax: works, output SQNR ")
    button.click().run()
    assert_clean(at)
    assert at.title[0].value == "Diff"
    n = store.sql("SELECT count(*) FROM runs WHERE session_id = ? AND kind = 'rerun'", [sid]).fetchone()[0]
    assert n == 1  # no "fix: stable-softmax (2)"


@pytest.mark.slow
def test_diff_shows_the_re_run_before_and_after(recipe_db):
    from precision_lab.services.rerun import rerun_session

    store, name = recipe_db
    sid = store.session(name).session_id
    rerun_session(store, name, "stable-softmax")

    def nonfinite(kind):
        return store.sql("SELECT count(*) FROM tensors t JOIN runs r USING (run_id) WHERE r.session_id = ? AND "
                         "r.kind = ? AND t.nonfinite AND t.direction = 'forward'", [sid, kind]).fetchone()[0]

    before, after = nonfinite("candidate"), nonfinite("rerun")
    assert before > 0 and after == 0
    at = open_page("diff", session=name)
    assert_clean(at)
    metrics = {m.label: m for m in at.metric}
    m = metrics["forward records with unexpected NaN/Inf"]
    assert "backward" in m.help  # says which count, beside the Runs table's
    assert int(m.value) == after and int(float(str(m.delta))) == after - before
    assert metrics["first non-finite op"].value == "none"
    assert "stable-softmax" in texts(at)


@pytest.mark.slow
def test_a_re_run_whose_output_holds_nan_is_never_credited_with_the_sqnr_of_its_finite_values(recipe_db):
    import numpy as np
    import torch

    from precision_lab.fixes.recipes import get_recipe
    from precision_lab.services.rerun import rerun_session

    store, name = recipe_db
    sid = store.session(name).session_id
    # independent: the candidate's output (fp16 softmax overflow) holds NaN, and the SQNR of its finite values is high
    model, inputs = get_recipe("softmax-fp16-overflow").build()
    with torch.no_grad():
        ref = model(inputs).double().numpy()
        low = model.half()(inputs.half()).double().numpy()
    finite = np.isfinite(low)
    assert 0 < (~finite).sum() < low.size
    finite_sqnr = 10 * np.log10((ref[finite] ** 2).sum() / ((low[finite] - ref[finite]) ** 2).sum())
    assert finite_sqnr > 40
    rerun_session(store, name, "keep-fp32:attn.o_proj")  # leaves the overflow where it is
    rerun_session(store, name, "use-bf16")  # a finite output
    at = open_page("diff", session=name)
    assert_clean(at)
    sqnr = [m for m in at.metric if m.label == "output SQNR vs fp32 (dB)"]
    fixes = [m.value.split("re-run with `")[1].rstrip("`") for m in at.markdown if "re-run with `" in m.value]
    # one card per re-run, newest first (even when both were made in the same second)
    assert len(sqnr) == 2 and fixes == ["use-bf16", "keep-fp32:attn.o_proj"]
    cards = dict(zip(fixes, sqnr))
    bf16, broken = cards["use-bf16"], cards["keep-fp32:attn.o_proj"]
    assert broken.value == "NaN/Inf" and broken.delta in (None, "")
    assert f"{finite_sqnr:.1f}" not in broken.help and "NaN/Inf in its output" in broken.help
    # the finite run is not shown as worse than the broken one it fixes
    assert float(bf16.value) > 0 and bf16.delta in (None, "") and "NaN/Inf in its output" in bf16.help
    # the fix is shown as code, as typed: no markdown escape inside the code span (it would be printed)
    assert any("re-run with `keep-fp32:attn.o_proj`" in m.value for m in at.markdown)


@pytest.mark.slow
def test_verify_button_tries_the_suggestions_and_the_cards_say_which_work(recipe_db):
    from precision_lab.services.verify import suggestions, verification

    store, name = recipe_db
    want = suggestions(store, name, top=3)
    at = open_page("overview", session=name)
    at.button(key="verify_fixes").click().run()
    assert_clean(at)
    jobs = at.session_state["_pl_verify"]
    assert [j.fix for j in jobs] == [s.fix for s in want]
    assert all(j.wait(300) and j.error is None for j in jobs)
    at.run()
    assert_clean(at)
    got = verification(store, name)
    labels = [b.label.replace("\\", "") for b in at.button if b.key and b.key.startswith("rerun_0_")]
    for s in want:
        v = got.get(s.parent, s.label)
        assert v.works and first_nonfinite(store, v.run_id) is None
        assert any(lab.startswith(f"Open fix: {s.label}: works, output SQNR {v.sqnr_db:.1f} dB")
                   for lab in labels), labels
    assert not [b for b in at.button if b.key == "verify_fixes"]  # nothing left to verify


@pytest.mark.slow
def test_overview_asks_for_the_fixes_verification_once_per_session_version(recipe_db, monkeypatch):
    """Which suggested fixes were verified (a query per re-run) is a view of the session like the others: a
    second run of the page reuses it, a new re-run computes it again."""
    from precision_lab.services import verify

    store, name = recipe_db
    calls = []
    real = verify.verification

    def counting(store, session):
        calls.append(session)
        return real(store, session)

    monkeypatch.setattr(verify, "verification", counting)
    at = open_page("overview", session=name)
    assert_clean(at)
    first = len(calls)
    assert first >= 1
    at.run()
    assert_clean(at)
    assert len(calls) == first
    from precision_lab.services.rerun import rerun_session

    rerun_session(store, name, ["stable-softmax"])  # a re-run adds a run: the session's version changes
    at.run()
    assert_clean(at)
    assert len(calls) > first


def test_a_rerun_in_progress_shows_in_every_tab_and_offers_no_second_one(recipe_db, monkeypatch):
    import threading

    from precision_lab.services import jobs

    store, name = recipe_db
    sid = store.session(name).session_id
    cand = store.sql("SELECT run_id FROM runs WHERE session_id = ? AND kind = 'candidate'", [sid]).fetchone()[0]
    release, started = threading.Event(), threading.Event()

    def held(store, session, fix, progress, parent=None, isolated=False):
        progress(1, 4, "fix: stable-softmax: model run 2 of 2")
        started.set()
        release.wait(60)
        return "run-x"

    monkeypatch.setattr(jobs, "rerun_session", held)
    job = jobs.start_rerun(store, name, "stable-softmax", parent=cand)  # clicked in another tab
    try:
        assert started.wait(30)
        at = open_page("overview", session=name)  # this tab never clicked
        assert_clean(at)
        button = at.button(key="rerun_0_0")
        assert button.disabled and button.label.startswith("Re-running with stable-softmax"), button.label
        bars = [p for p in at.get("progress") if "started in another tab" in str(p.proto.text)]
        assert bars and "model run 2 of 2" in str(bars[0].proto.text)
        assert "_pl_rerun" not in at.session_state
    finally:
        release.set()
        assert job.wait(30)
    at = open_page("overview", session=name)
    assert not at.button(key="rerun_0_0").disabled  # over: the button is back (the fake made no run)
