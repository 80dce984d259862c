"""AppTest: the Timeline page of a long fp16 training run."""

from __future__ import annotations

import pytest
import json
import math

import numpy as np

from precision_lab.ui.common import escape_md
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
    from precision_lab.store import timeline as tl

    store = _store(db)
    run_id = _run_id(store, TIMELINE_SESSION)
    return store, run_id, tl.first_nonfinite_step(store, run_id), svc.run_alerts(store, run_id)


def _arr(v):
    """A plotly JSON array as numpy: numpy arrays travel base64-encoded (``{"dtype", "bdata", "shape"}``)."""
    import base64

    import numpy as np

    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=v["dtype"])
        shape = v.get("shape")
        return a.reshape([int(x) for x in str(shape).split(",")]) if shape else a
    return np.asarray(v, dtype=float)


def _figures(at) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


@pytest.mark.slow
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
    fig = next(f for f in figs if any(d["type"] == "heatmap" for d in f["data"]))
    heat = next(d for d in fig["data"] if d["type"] == "heatmap")
    # one row per summarised module output, in execution order; the column of the first non-finite step exists
    labels = fig["layout"]["yaxis"]["ticktext"]
    xs = list(_arr(heat["x"]).astype(int))
    assert labels[:3] == ["0.forward.0", "1.forward.0", "2.forward.0"] and first in xs
    # the cell of op 2 at step 5 holds its headroom in bits below fp16's max, from the stored summary
    row, col = labels.index("2.forward.0"), xs.index(5)
    absmax = store.sql("SELECT absmax FROM timeline WHERE run_id = ? AND op = '2.forward.0' AND step = 5 "
                       "AND role = 'output'", [run_id]).fetchone()[0]
    assert abs(_arr(heat["z"])[row][col] - math.log2(65504 / absmax)) < 1e-5  # float32 on the wire
    icicle = next(d for f in figs for d in f["data"] if d["type"] == "icicle")
    assert "(model)" in icicle["ids"] and set(icicle["parents"]) >= {"", "(model)"}
    # the loss and gradient-norm curves: the stored per-step values, the first non-finite step marked
    from precision_lab.store import timeline as tl

    steps = {r.step: r for r in tl.step_rows(store, run_id)}
    curves = next(f for f in figs if any(d.get("name") == "gradient norm" for d in f["data"]))
    norm = next(d for d in curves["data"] if d.get("name") == "gradient norm")
    got = dict(zip(_arr(norm["x"]).astype(int), _arr(norm["y"])))
    finite = {s: abs(r.grad_norm) for s, r in steps.items() if r.grad_norm is not None
              and math.isfinite(r.grad_norm)}
    assert finite and all(abs(got[s] - v) <= 1e-6 * v for s, v in finite.items())
    assert any(sh.get("x0") == first for sh in curves["layout"].get("shapes", []))


@pytest.mark.slow
def test_timeline_underflow_view_and_format_in_the_url(ui_db):
    at = open_page("timeline", session=TIMELINE_SESSION, tfmt="fp8_e4m3fn")
    assert at.query_params["tfmt"] == "fp8_e4m3fn"
    at.radio(key="tl_metric").set_value("low").run()
    assert_clean(at)
    heat = next(d for f in _figures(at) for d in f["data"] if d["type"] == "heatmap")
    z = _arr(heat["z"])
    vals = list(z[~np.isnan(z)])
    assert vals and all(0.0 <= v <= 1.0 for v in vals) and max(vals) > 0  # fp8 loses the small values
    assert "share low in fp8_e4m3fn" in json.dumps(heat["colorbar"])


def test_timeline_on_a_session_without_one_says_how_to_record_it(ui_db):
    at = open_page("timeline", session=STAT_SESSION)
    assert "has no timeline" in texts(at) and "every=" in texts(at)


@pytest.mark.slow
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


@pytest.mark.slow
def test_tree_module_opens_op_detail_at_the_first_nonfinite_step(ui_db):
    store, run_id, first, _ = _facts(ui_db)
    at = open_page("timeline", session=TIMELINE_SESSION)
    options = at.selectbox(key="tl_module").options
    # the path to the first failure comes first: the innermost module on it
    assert options[0].startswith("2 ") and "NaN/Inf" in options[0]
    at.selectbox(key="tl_module").set_value("2.forward.0").run()
    at.button(key="tl_open_module").click().run()
    assert_clean(at)
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md("2.forward.0.output.0"))
    rid = int(at.query_params["op"])
    assert store.sql("SELECT step FROM tensors WHERE run_id = ? AND rid = ?", [run_id, rid]).fetchone()[0] == first


@pytest.mark.slow
def test_heatmap_cells_carry_what_a_click_opens(ui_db):
    """Every drawn cell has a clickable point whose customdata names its op and step (the browser test clicks
    one); a cell at a summary step opens the full step before it."""
    from precision_lab.services import timeline as svc
    from precision_lab.ui import timeline as tv

    store, run_id, first, _ = _facts(ui_db)
    at = open_page("timeline", session=TIMELINE_SESSION)
    fig = next(f for f in _figures(at) if any(d["type"] == "heatmap" for d in f["data"]))
    heat = next(d for d in fig["data"] if d["type"] == "heatmap")
    cells = next(d for d in fig["data"] if d.get("name") == "cell")
    z, cd = _arr(heat["z"]), _arr(cells["customdata"])
    assert len(cd) == int((~np.isnan(z)).sum())  # one point per drawn cell
    row = fig["layout"]["yaxis"]["ticktext"].index("1.forward.0")
    point = {"customdata": list(next(c for c in cd if c[0] == row and c[1] == 13))}
    ops = svc.heatmap(store, run_id, metric="headroom", fmt="fp16").ops
    op, step = tv.cell_target(point, ops)
    assert (op, step) == ("1.forward.0", 13)
    rec = svc.record_at(store, run_id, op, step)
    assert rec.step == 10 and rec.name == "1.forward.0.output.0"
    assert tv.cell_target({"customdata": {"0": row, "1": 13, "2": 1.5}}, ops) == ("1.forward.0", 13)  # browser
    assert tv.cell_target({"customdata": None}, ops) is None and tv.cell_target({"customdata": [99, 1]}, ops) is None


@pytest.mark.slow
def test_op_detail_shows_where_the_op_was_called(ui_db):
    """A captured op and an msprobe op (from the dump's stack.json) both name their line of user code."""
    from ui_fixtures import STAT_FIRST_NONFINITE

    store, run_id, first, _ = _facts(ui_db)
    rid = store.sql("SELECT rid FROM tensors WHERE run_id = ? AND op = '2.forward.0' AND role = 'output' "
                    "AND step = 0", [run_id]).fetchone()[0]
    at = open_page("op_detail", session=TIMELINE_SESSION, run=TIMELINE_SESSION, op=str(rid))
    body = texts(at)
    line = next(ln for ln in body.splitlines() if ln.startswith("Called from"))
    assert line.replace("\\", "").startswith("Called from tests/training.py:") and line.endswith(" in train")
    at = open_page("op_detail", session=STAT_SESSION, run="stat_mix_fp16_inner_ovf")
    # the sample's first non-finite op, located by the dump's stack.json
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))
    line = next(ln for ln in texts(at).splitlines() if ln.startswith("Called from"))
    assert line.replace("\\", "").startswith("Called from user/model/model.py:")


def test_a_distributed_runs_ranks_by_steps(tmp_path, monkeypatch):
    """Four ranks, rank 2 non-finite at step 3, the others from step 4 (what the gradient all-reduce spreads):
    the Timeline page draws ranks x steps with each cell the count the rank's summaries gave."""
    from precision_lab.records import RunInfo, StepScalar, TimelineRow
    from precision_lab.store import Store
    from ui_fixtures import serve_db

    db = tmp_path / "ranks.duckdb"
    store = Store(db)
    bad = {(2, 3): 5.0, (0, 4): 7.0, (1, 4): 7.0, (2, 4): 9.0, (3, 4): 7.0}
    with store.new_session("ddp") as w:
        w.add_run(RunInfo(session_id=w.session_id, run_id="ddprun000001", name="ddp", dtype="float16",
                          kind="candidate", parent_run_id=None, fix=None, policy=None, source="t", order="execution"))
        rows, scalars = [], []
        for rank in range(4):
            for step in range(6):
                rows.append(TimelineRow("ddprun000001", len(rows), step, rank, 0, "fc", "Linear", "output", "0",
                                        "forward", "float16", 4, 0, 0, 0, 0, 1.0, 0.5, 1.0))
                scalars.append(StepScalar("ddprun000001", step, rank, "nonfinite_values", bad.get((rank, step), 0.0)))
        w.add_timeline(rows, [], scalars)
    with serve_db(db, monkeypatch):
        at = open_page("timeline", session="ddp")
        assert_clean(at)
        assert "Ranks × steps" in [s.value for s in at.subheader]
        fig = next(f for f in _figures(at) if f["data"][0].get("type") == "heatmap"
                   and f["data"][0].get("y") == ["rank 0", "rank 1", "rank 2", "rank 3"])
        z = _arr(fig["data"][0]["z"])
        for (rank, step), n in bad.items():
            assert z[rank][step] == pytest.approx(math.log10(1 + n))
        assert z.sum() == pytest.approx(sum(math.log10(1 + n) for n in bad.values()))
