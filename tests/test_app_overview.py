"""AppTest: the Overview page."""

from __future__ import annotations

import pytest

from precision_lab.ui.common import escape_md

from ui_fixtures import (STAT_FIRST_NONFINITE, STAT_SESSION, TENSOR_SESSION, WIDE_OP, assert_clean,  # noqa: F401
                         frame_with, open_page, texts, ui_db, ui_template)


def _values(v):
    """A plotly JSON array as a list: numpy arrays travel base64-encoded (``{"dtype", "bdata"}``)."""
    import base64

    import numpy as np

    if isinstance(v, dict) and "bdata" in v:
        return list(np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"]))
    return list(v)


def _store(db):
    from precision_lab.store import Store

    return Store(db)


@pytest.mark.slow
def test_overview_names_the_first_nonfinite_producer_and_its_path(ui_db):
    at = open_page("overview", session=STAT_SESSION)
    body = texts(at)
    assert escape_md(STAT_FIRST_NONFINITE) in body
    assert "every recorded value is finite" in body  # the fp32 reference
    path = frame_with(at, "NaN/Inf in outputs")
    assert path["op"].iloc[-1] == STAT_FIRST_NONFINITE
    assert list(path["NaN/Inf in outputs"]) == [False] * (len(path) - 1) + [True]
    assert path["seq"].is_monotonic_increasing
    runs = frame_with(at, "nonfinite_records")
    assert sorted(runs["kind"]) == ["candidate", "reference"]
    assert at.get("plotly_chart"), "error-vs-order plot missing"


@pytest.mark.slow
def test_top_offenders_table_and_open_buttons(ui_db):
    at = open_page("overview", session=STAT_SESSION)
    top = frame_with(at, "rounding_units")
    assert 0 < len(top) <= 10 and "nonfinite" not in set(top["verdict"])
    store = _store(ui_db)
    cand = store.df("SELECT r.run_id, r.name FROM runs r JOIN sessions s USING (session_id) "
                    "WHERE s.name = ? AND r.kind = 'candidate'", [STAT_SESSION]).iloc[0]
    at.button(key=f"open_first_{cand['run_id']}").click().run()
    assert_clean(at)
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))
    assert at.query_params["run"] == cand["name"]


@pytest.mark.slow
def test_diagnosis_cards_render_as_text(ui_db):
    from precision_lab.records import Diagnosis

    store = _store(ui_db)
    sid = store.session(TENSOR_SESSION).session_id
    run_id = store.df("SELECT run_id FROM runs WHERE session_id = ? AND kind = 'candidate'", [sid]).run_id[0]
    with store.extend_session(TENSOR_SESSION) as w:
        w.add_diagnosis(Diagnosis(sid, run_id, WIDE_OP, "fp16-overflow",
                                  "[click](http://x) absmax 1042329 > fp16 max 65504", ("use-bf16",), "error", 1))
    at = open_page("overview", session=TENSOR_SESSION)
    body = texts(at)
    assert escape_md("[click](http://x) absmax 1042329 > fp16 max 65504") in body  # shown literally
    assert "Proposed fixes: " + escape_md("use-bf16") in body  # fix names are escaped like every name
    assert escape_md(WIDE_OP) in body


@pytest.mark.slow
def test_session_comes_from_the_url_and_metric_switch(ui_db):
    at = open_page("overview", session=TENSOR_SESSION)
    assert TENSOR_SESSION in at.title[0].value.replace("\\", "")
    at.radio(key="err_metric").set_value("sqnr_db").run()
    assert_clean(at)
    fig = next(c for c in at.get("plotly_chart") if c.proto.id.endswith("err_plot"))
    assert "SQNR" in fig.proto.spec


@pytest.mark.slow
def test_a_statistics_only_session_draws_its_summaries_error(ui_db):
    """No element-wise error in a statistics-only session: the error plot opens on the summaries' relative
    error, labelled so, and the top offenders show it in a column of its own."""
    at = open_page("overview", session=STAT_SESSION)
    assert at.radio(key="err_metric").value == "summary_rel_err"
    fig = next(c for c in at.get("plotly_chart") if c.proto.id.endswith("err_plot"))
    assert "summary relative error" in fig.proto.spec
    top = frame_with(at, "rounding_units")
    assert list(top.columns).index("summary_rel_err") == list(top.columns).index("max_rel_err") + 1
    at.radio(key="err_metric").set_value("max_rel_err").run()
    assert_clean(at)
    assert "summary statistics only" in texts(at) and "Choose summary rel error" in texts(at)
    # an element-wise session opens on max_rel_err, without the summary column
    at = open_page("overview", session=TENSOR_SESSION)
    assert at.radio(key="err_metric").value == "max_rel_err"
    assert "summary_rel_err" not in frame_with(at, "rounding_units").columns


def test_unknown_session_in_url_says_so_and_opens_nothing(ui_db):
    at = open_page("overview", session="no-such-session")
    assert_clean(at)
    shown = " ".join(w.value for w in at.warning).replace("\\", "")
    assert "no session named no-such-session" in shown
    assert at.query_params["session"] == ["no-such-session"] or at.query_params["session"] == "no-such-session"
    assert not at.dataframe and not at.get("plotly_chart")  # no other session's data


@pytest.mark.slow
def test_a_dump_session_says_why_its_fixes_have_no_re_run_button(ui_db):
    at = open_page("overview", session=STAT_SESSION)
    body = texts(at)
    assert "Proposed fixes" in body
    assert "No re-run button" in body and "holds dumps, not a model" in body and "capture --model" in body
    # the command is shown as code, its backticks not printed (an escaped backtick is shown as one)
    why = next(c.value for c in at.caption if c.value.startswith("No re-run button"))
    assert "`precision-lab capture --model FILE.py:FUNCTION --inputs FILE.py:FUNCTION`" in why and "\\`" not in why
    assert not [b for b in at.button if b.label.startswith("Re-run with")]


@pytest.mark.slow
def test_warnings_and_an_unknown_order_are_on_the_overview(tmp_path, monkeypatch):
    import os

    import numpy as np

    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import order_notes
    from precision_lab.store import Store
    from precision_lab.store.queries import session_runs
    from ui_fixtures import serve_db

    d = tmp_path / "dump"
    d.mkdir()
    np.save(d / "b.output.0.npy", np.array([1.0, np.inf], np.float16))  # no links between ops: order by name
    np.save(d / "a.output.0.npy", np.array([1.0, 2.0], np.float16))
    (d / "notes.txt").write_text("not a tensor")
    for f in d.iterdir():  # equal file times: they say nothing about the order
        os.utime(f, ns=(1_700_000_000_000_000_000,) * 2)
    db = tmp_path / "w.duckdb"
    store = Store(db)
    name = ingest(d, store=store, session="unordered")
    sid = store.session(name).session_id
    note = order_notes(store, sid).get(session_runs(store, sid)[0].run_id)  # what ingest recorded for the run
    assert "no order list" in note and "fewest non-finite" in note
    store.close()
    with serve_db(db, monkeypatch):
        at = open_page("overview", session=name)
        body = texts(at)
        assert escape_md(f"Order used for dump: {note}.") in body  # the order used and which parts are certain
        assert "first by name" not in body
        warns = frame_with(at, "message")
        assert list(warns["file"]) == ["notes.txt"] and "unsupported file type" in warns["message"][0]
        assert str(tmp_path) not in " ".join(warns["file"])  # no server path


@pytest.mark.slow
def test_overview_tree_outlines_the_path_to_the_first_producer(ui_db):
    """The msprobe sample: the failing functional op sits in block 2's fc1 by the dump's construct.json; the
    tree outlines (model) -> blocks -> 2 -> fc1, and its module opens on Op detail."""
    import json
    import math

    store = _store(ui_db)
    at = open_page("overview", session=STAT_SESSION)
    tree = next(json.loads(c.proto.spec) for c in at.get("plotly_chart") if '"icicle"' in c.proto.spec)
    ice = tree["data"][0]
    ids, widths = ice["ids"], ice["marker"]["line"]["width"]
    outlined = [i for i, w in zip(ids, widths) if w > 1]
    parent = store.sql("SELECT parent FROM tensors WHERE op = ? AND parent IS NOT NULL LIMIT 1",
                       [STAT_FIRST_NONFINITE]).fetchone()[0]
    assert parent.startswith("Module.blocks.2.")
    module = parent.split(".", 1)[1].rsplit(".", 3)[0]  # Module.<path>.<Class>.forward.0 -> <path>
    want = ["(model)"] + [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)]
    assert outlined == want
    # a node's colour is its worst headroom below fp16's max, recomputed from the stored absmax
    cand = store.sql("SELECT r.run_id FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ? "
                     "AND r.kind = 'candidate'", [STAT_SESSION]).fetchone()[0]
    absmax = store.sql("SELECT max(absmax) FROM tensors WHERE run_id = ? AND direction = 'forward' AND "
                       "role = 'output' AND (op LIKE 'Module.blocks.0.%' OR parent LIKE 'Module.blocks.0.%')",
                       [cand]).fetchone()[0]
    colour = ice["marker"]["colors"][ids.index("blocks.0")]
    assert abs(colour - math.log2(65504 / absmax)) < 1e-9
    # the innermost module on the path is offered first and opens at its own call
    first_module = at.selectbox(key="ov_module").value
    assert first_module.startswith(f"Module.{module}.") and first_module.endswith(".forward.0")
    at.button(key="ov_open_module").click().run()
    assert_clean(at)
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md(first_module))


@pytest.mark.slow
def test_overview_view_models_are_cached_until_the_session_changes(ui_db, monkeypatch):
    """A second run of the page (any click) reuses the session's view-models; a new run or a changed
    diagnosis computes them again."""
    from precision_lab.records import Diagnosis
    from precision_lab.ui import overview as ov

    calls = []
    real = ov.offenders_table

    def counting(store, sid, **kw):
        calls.append(kw["local"])
        return real(store, sid, **kw)

    monkeypatch.setattr(ov, "offenders_table", counting)
    at = open_page("overview", session=STAT_SESSION)
    first = len(calls)
    assert first == 2  # accumulated and local tabs
    top = frame_with(at, "rounding_units")
    at.run()
    assert_clean(at)
    assert len(calls) == first and frame_with(at, "rounding_units").equals(top)  # cached, same table

    store = _store(ui_db)
    with store.extend_session(STAT_SESSION) as w:  # a diagnosis rewritten (as after a re-run's diagnose)
        w.add_diagnosis(Diagnosis("", "", "x.op", "manual", "a new finding", (), "info", 0))
    at.run()
    assert_clean(at)
    assert len(calls) == 2 * first
    assert "a new finding" in " ".join(e.value for e in at.markdown)
    with store.extend_session(STAT_SESSION) as w:  # a run added
        w.add_run(name="fp16-again", dtype="float16", kind="candidate")
    at.run()
    assert_clean(at)
    assert len(calls) == 3 * first
    assert "fp16-again" in set(frame_with(at, "nonfinite_records")["run"])


@pytest.mark.slow
def test_a_training_capture_with_no_model_is_not_offered_an_island_it_cannot_grow(ui_db):
    from precision_lab.services.jobs import rerun_blocker
    from precision_lab.services.report import first_nonfinite

    from ui_fixtures import TIMELINE_SESSION

    store = _store(ui_db)
    run_id = store.df("SELECT r.run_id FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?",
                      [TIMELINE_SESSION]).run_id[0]
    assert first_nonfinite(store, run_id) is not None  # the run went non-finite: a grow would be tempting
    assert rerun_blocker(store, TIMELINE_SESSION)  # but no model is stored to run again
    at = open_page("overview", session=TIMELINE_SESSION)
    assert not [b for b in at.button if b.key == "grow_island"]


@pytest.mark.slow
def test_error_along_the_run_plots_a_generic_dump_whose_records_are_free_tensors(tmp_path, monkeypatch):
    import json

    import numpy as np

    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store
    from ui_fixtures import serve_db

    rng = np.random.default_rng(3)
    want = {}
    for d in ("ref", "cand"):
        (tmp_path / d).mkdir()
    for name in ("embed", "hidden", "logits"):  # names that say no op or role: records of role "tensor"
        x = rng.standard_normal(64).astype(np.float32) * 100
        np.save(tmp_path / "ref" / f"{name}.npy", x)
        np.save(tmp_path / "cand" / f"{name}.npy", x.astype(np.float16))
        want[name] = float(np.abs(x.astype(np.float16).astype(np.float64) - x.astype(np.float64)).max())
    db = tmp_path / "g.duckdb"
    store = Store(db)
    name = ingest(tmp_path / "cand", reference=tmp_path / "ref", store=store, session="generic")
    roles = {r[0] for r in store.sql("SELECT DISTINCT role FROM tensors").fetchall()}
    assert roles == {"tensor"}
    with serve_db(db, monkeypatch):
        at = open_page("overview", session=name)
        assert "No comparisons to plot" not in texts(at)
        at.radio(key="err_metric").set_value("max_abs_err").run()
        assert_clean(at)
        fig = json.loads(next(c for c in at.get("plotly_chart") if c.proto.id.endswith("err_plot")).proto.spec)
        traces = [tr for tr in fig["data"] if tr.get("customdata")]
        got = sorted(float(y) for tr in traces for y in _values(tr["y"]))
        assert got == [pytest.approx(v, rel=1e-6) for v in sorted(want.values())]
