"""AppTest: the Timeline page of a long fp16 training run."""

from __future__ import annotations

import json
import math

from ui_fixtures import (STAT_SESSION, TIMELINE_SESSION, assert_clean, frame_with, open_page, texts,  # noqa: F401
                         ui_db, ui_template)


def _store(db):
    from precision_lab.store import Store

    return Store(db)


def _run_id(store, session):
    return store.df("SELECT r.run_id FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?",
                    [session]).run_id[0]


def _facts(db) -> tuple:
    """(store, run id, first non-finite step, alerts) of the timeline session, from the service."""
    from precision_lab.services import timeline as svc

    store = _store(db)
    run_id = _run_id(store, TIMELINE_SESSION)
    return store, run_id, svc.first_nonfinite_step(store, run_id), svc.run_alerts(store, run_id)


def _figures(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_timeline_shows_the_first_nonfinite_step_alerts_heatmap_and_tree(ui_db):
    store, run_id, first, alerts = _facts(ui_db)
    at = open_page("timeline", session=TIMELINE_SESSION)
    assert at.title[0].value == "Timeline"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["First non-finite step"] == str(first) and metrics["Alerts"] == str(len(alerts))
    table = frame_with(at, "rule")
    assert list(table["step"]) == [a.step for a in alerts] and table["step"].min() < first
    figs = _figures(at)
    kinds = [d["type"] for f in figs for d in f["data"]]
    assert "heatmap" in kinds and "icicle" in kinds and "scatter" in kinds
    heat = next(d for f in figs for d in f["data"] if d["type"] == "heatmap")
    # one row per summarised module output, in execution order; the column of the first non-finite step exists
    assert heat["y"][:3] == ["0.forward.0", "1.forward.0", "2.forward.0"] and first in heat["x"]
    # the cell of op 2 at step 5 holds its headroom in bits below fp16's max, from the stored summary
    row, col = heat["y"].index("2.forward.0"), heat["x"].index(5)
    absmax = store.sql("SELECT absmax FROM timeline WHERE run_id = ? AND op = '2.forward.0' AND step = 5 "
                       "AND role = 'output'", [run_id]).fetchone()[0]
    assert abs(heat["z"][row][col] - math.log2(65504 / absmax)) < 1e-9
    icicle = next(d for f in figs for d in f["data"] if d["type"] == "icicle")
    assert "(model)" in icicle["ids"] and set(icicle["parents"]) >= {"", "(model)"}


def test_timeline_underflow_view_and_format_in_the_url(ui_db):
    at = open_page("timeline", session=TIMELINE_SESSION, tfmt="fp8_e4m3fn")
    assert at.query_params["tfmt"] == "fp8_e4m3fn"
    at.radio(key="tl_metric").set_value("low").run()
    assert_clean(at)
    heat = next(d for f in _figures(at) for d in f["data"] if d["type"] == "heatmap")
    vals = [v for r in heat["z"] for v in r if v is not None]
    assert vals and all(0.0 <= v <= 1.0 for v in vals) and max(vals) > 0  # fp8 loses the small values
    assert "share low in fp8_e4m3fn" in json.dumps(heat["colorbar"])


def test_timeline_on_a_session_without_one_says_how_to_record_it(ui_db):
    at = open_page("timeline", session=STAT_SESSION)
    assert "has no timeline" in texts(at) and "every=" in texts(at)


def test_overview_lists_the_alerts_and_opens_the_timeline(ui_db):
    store, run_id, first, alerts = _facts(ui_db)
    at = open_page("overview", session=TIMELINE_SESSION)
    body = texts(at)
    assert f"first non-finite value at step {first}" in body and f"{len(alerts)} alert(s)" in body
    assert f"the first at step {min(a.step for a in alerts)}" in body
    table = frame_with(at, "rule")
    assert list(table["message"]) == [a.message for a in alerts[:5]]
    at.button(key=f"timeline_{TIMELINE_SESSION}").click().run()
    assert_clean(at)
    assert at.title[0].value == "Timeline"
