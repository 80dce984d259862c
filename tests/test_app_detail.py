"""AppTest: Op detail -- histogram overlays whose counts follow the chosen formats,
the summary-only overlay, metrics, and the view's state in the URL."""

from __future__ import annotations

import pytest

from precision_lab.ui.common import escape_md

import math

import ml_dtypes
import numpy as np

from precision_lab.formats import FORMATS

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_SESSION, TENSOR_SESSION, WIDE_OP,  # noqa: F401
                         assert_clean, frame_with, frames, open_page, texts, ui_db, ui_template, wide_values)


def _rid(db, session, kind, name):
    from precision_lab.store import Store

    s = Store(db)
    return int(s.df("""SELECT t.rid FROM tensors t JOIN runs r USING (run_id) JOIN sessions s USING (session_id)
                       WHERE s.name = ? AND r.kind = ? AND t.name = ?""", [session, kind, name]).rid[0])


def _run_name(kind):
    return {"reference": "wide_fp32", "candidate": "wide_fp16"}[kind]


def _cast_counts(x, dtype):
    with np.errstate(over="ignore", invalid="ignore"):
        c = x.astype(dtype).astype(np.float64)
    tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
    nz = x != 0
    return {"overflow": int((nz & ~np.isfinite(c)).sum()), "underflow": int((nz & (c == 0)).sum()),
            "subnormal": int((nz & np.isfinite(c) & (c != 0) & (np.abs(c) < tiny)).sum())}


def _repr_table(at):
    # the first representability table is this record's
    return next(f for f in frames(at) if "overflow %" in f.columns).set_index("format")


@pytest.mark.slow
def test_format_choice_changes_the_overlay_counts(ui_db):
    rid = _rid(ui_db, TENSOR_SESSION, "reference", f"{WIDE_OP}.output.0")
    at = open_page("op_detail", session=TENSOR_SESSION, run=_run_name("reference"), op=str(rid), fmt="fp16")
    assert at.subheader[0].value == escape_md(f"{WIDE_OP}.output.0")
    x = wide_values().ravel()
    table = _repr_table(at)
    assert list(table.index) == ["fp16"]
    for k, v in _cast_counts(x, np.float16).items():
        assert int(table.loc["fp16", k]) == v, k
    assert all(v > 0 for v in _cast_counts(x, np.float16).values())  # the fixture exercises every region

    at.multiselect(key="pick_formats@op_detail").set_value(["fp8_e4m3fn", "bf16"]).run()
    assert_clean(at)
    table = _repr_table(at)
    assert list(table.index) == ["fp8_e4m3fn", "bf16"]
    for fmt, dtype in (("fp8_e4m3fn", ml_dtypes.float8_e4m3fn), ("bf16", ml_dtypes.bfloat16)):
        for k, v in _cast_counts(x, dtype).items():
            assert int(table.loc[fmt, k]) == v, (fmt, k)
    assert at.query_params["fmt"] == ["fp8_e4m3fn", "bf16"]  # shareable
    fig = at.get("plotly_chart")[0].proto.spec
    assert "fp8_e4m3fn" in fig and "log2 |x|" in fig


@pytest.mark.slow
def test_fp32_record_shows_what_if_for_every_format(ui_db):
    rid = _rid(ui_db, TENSOR_SESSION, "reference", f"{WIDE_OP}.output.0")
    at = open_page("op_detail", session=TENSOR_SESSION, run=_run_name("reference"), op=str(rid))
    what_if = next(f for f in frames(at) if "smallest normal" in f.columns).set_index("format")
    assert list(what_if.index) == [f for f in FORMATS if f != "fp32"]
    x = wide_values().ravel()
    assert int(what_if.loc["fp8_e5m2", "overflow"]) == _cast_counts(x, ml_dtypes.float8_e5m2)["overflow"]
    # the reference is compared with its candidate: both histograms, both tables
    assert sum("overflow %" in f.columns and "smallest normal" not in f.columns for f in frames(at)) == 2


@pytest.mark.slow
def test_candidate_metrics_and_side_by_side_stats(ui_db):
    rid = _rid(ui_db, TENSOR_SESSION, "candidate", "blocks.1.proj.output.0")
    at = open_page("op_detail", session=TENSOR_SESSION, run=_run_name("candidate"), op=str(rid), fmt="fp16")
    metrics = next(f for f in frames(at) if "accumulated vs reference wide_fp32" in f.columns)
    col = metrics["accumulated vs reference wide_fp32"]
    r = np.linspace(-1.0, 1.0, 64, dtype=np.float32) * np.float32(3)
    c = r.astype(np.float16).astype(np.float64)
    r = r.astype(np.float64)
    cos = (r * c).sum() / math.sqrt((r * r).sum() * (c * c).sum())
    assert float(col["cosine"].split()[0]) == np.float64(cos).round(12) or \
        abs(float(col["cosine"].split()[0]) - cos) < 1e-11
    sqnr = 10 * math.log10((r * r).sum() / ((c - r) ** 2).sum())
    assert abs(float(col["SQNR (dB)"]) - sqnr) < 1e-5
    stats = next(f for f in frames(at) if "wide_fp16 (this)" in f.columns)
    assert stats.loc["dtype", "wide_fp16 (this)"] == "float16"
    assert stats.loc["dtype", "wide_fp32 (reference)"] == "float32"


@pytest.mark.slow
def test_stats_only_record_gets_the_summary_overlay(ui_db):
    at = open_page("op_detail", session=STAT_SESSION, run=STAT_CAND.name, fmt="fp16")
    # no op in the URL: the run's first non-finite producer is shown
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))
    body = texts(at)
    assert "Summary statistics against the format limits" in body
    heads = [f for f in frames(at) if "headroom (bits)" in f.columns]
    assert len(heads) == 1  # one full-width table, every record's rows in it: no column cut off beside another
    head = heads[0]
    assert list(head.columns) == ["record", "format", "max finite", "absmax", "headroom (bits)", "overflows",
                                  "min |x| > 0", "footroom (bits)", "underflows"]
    this = head[head["record"].str.endswith("(this)")].reset_index(drop=True)
    ref = head[head["record"].str.endswith("(reference)")].reset_index(drop=True)
    assert this.loc[0, "overflows"] == "yes: already inf"  # this fp16 record
    assert this.loc[0, "headroom (bits)"] == "-inf"
    assert ref.loc[0, "overflows"] == "yes" and float(ref.loc[0, "headroom (bits)"]) < 0  # the fp32 ref
    # what a statistics-only record does not hold reads as unknown, like its counts: never "nan"
    stats = frame_with(at, f"{STAT_CAND.name} (this)")
    assert stats.loc["nan_count"].iloc[0] == "—"
    assert "nan" not in set(stats.iloc[:, 0]) and stats.loc["std"].iloc[0] == "—"
    assert not any("overflow %" in f.columns for f in frames(at))  # no histogram, no invented counts
    import json

    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert spec["layout"]["xaxis"]["title"]["text"] == "log2 |value|"
    names = [t.get("name", "") for t in spec["data"]]
    assert f"{STAT_CAND.name} (this): NaN/Inf" in names  # the infinite Max/Min drawn as crosses


@pytest.mark.slow
def test_norm_artefact_is_explained(ui_db):
    from precision_lab.services.report import norm_artefacts
    from precision_lab.store import Store

    s = Store(ui_db)
    arts = norm_artefacts(s, s.session(STAT_SESSION).session_id)
    assert arts, "the fp16 sample holds records whose fp16 Norm overflowed"
    a = arts[0]
    at = open_page("op_detail", session=STAT_SESSION, run=a.run, op=str(a.rid))
    shown = " ".join(i.value for i in at.info).replace("\\", "")
    assert "not a non-finite tensor" in shown and "norm-arithmetic artefact" in shown


@pytest.mark.slow
def test_op_picker_filter(ui_db):
    at = open_page("op_detail", session=STAT_SESSION, run=STAT_CAND.name)
    assert_clean(at)
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))  # no op asked: the first producer
    at.text_input(key="op_find").input("fc2").run()
    opts = at.selectbox(key="pick_op@op_detail").options
    assert len(opts) > 1 and all("fc2" in o or STAT_FIRST_NONFINITE in o for o in opts)


@pytest.mark.slow
def test_opened_without_an_op_it_lands_on_the_first_failure_and_a_step_can_be_chosen(ui_db):
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store

    from ui_fixtures import TIMELINE_SESSION

    store = Store(ui_db)
    run_id, run = store.sql("SELECT r.run_id, r.name FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?",
                            [TIMELINE_SESSION]).fetchone()
    first = first_nonfinite(store, run_id)
    steps = [r[0] for r in store.sql("SELECT DISTINCT step FROM tensors WHERE run_id = ? ORDER BY step",
                                     [run_id]).fetchall()]
    first_step = store.sql("SELECT step FROM tensors WHERE run_id = ? AND rid = ?", [run_id, first.rid]).fetchone()[0]
    assert len(steps) > 2 and first_step != steps[0]  # the failure is far down a long run's records
    at = open_page("op_detail", session=TIMELINE_SESSION)
    assert_clean(at)
    assert at.subheader[0].value.startswith(escape_md(first.op))
    assert f"step {first_step}" in texts(at)
    step = at.selectbox(key="pick_step@op_detail")
    assert step.value == first_step and list(step.options) == [str(s) for s in steps]
    # another step: its ops, each labelled with the step
    other = steps[0]
    step.set_value(other).run()
    assert_clean(at)
    want = store.sql("SELECT count(*) FROM tensors WHERE run_id = ? AND step = ?", [run_id, other]).fetchone()[0]
    opts = at.selectbox(key="pick_op@op_detail").options
    assert len(opts) == min(want, 200) and all(f"(step {other}, seq " in o for o in opts)
    assert f"step {other}" in texts(at)
    # a link to an op (a row selected on the Ops page) opens that op's step, whatever step was chosen last
    at.query_params.clear()  # the navigation menu opens a page without the last one's URL parameters
    at.switch_page("pages/ops.py").run()
    at.text_input(key="q").input(f"{first.op}.output").run()
    assert_clean(at)
    rows = frame_with(at, "step")
    row = int(np.flatnonzero(rows["step"].astype(int).to_numpy() == first_step)[0])  # the failing step's row
    at.session_state["ops_table"] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md(first.op))
    assert at.selectbox(key="pick_step@op_detail").value == first_step


@pytest.mark.slow
def test_an_op_chosen_in_one_run_is_not_opened_by_its_record_number_in_another(ui_db):
    """A record number means nothing in another run: Op detail on another session's run (the session picker
    changed) opens that run's first failure, never the record that happens to carry the number last chosen."""
    from precision_lab.services.report import first_nonfinite
    from precision_lab.store import Store

    from ui_fixtures import TIMELINE_SESSION

    store = Store(ui_db)
    run_id = store.sql("SELECT r.run_id FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?",
                       [TIMELINE_SESSION]).fetchone()[0]
    first = first_nonfinite(store, run_id)
    rid = _rid(ui_db, TENSOR_SESSION, "candidate", f"{WIDE_OP}.output.0")
    same_number = store.sql("SELECT name FROM tensors WHERE run_id = ? AND rid = ?", [run_id, rid]).fetchone()[0]
    assert not same_number.startswith(first.op)  # the number names another op in the other run
    at = open_page("op_detail", session=TENSOR_SESSION, run=_run_name("candidate"), op=str(rid))
    assert at.subheader[0].value == escape_md(f"{WIDE_OP}.output.0")
    at.selectbox(key="pick_session@op_detail").set_value(TIMELINE_SESSION).run()
    assert_clean(at)
    assert at.subheader[0].value.startswith(escape_md(first.op)), at.subheader[0].value
    assert at.query_params["op"] == str(first.rid)
    # and back: the first run's own first failure, not the number chosen in the other run
    at.selectbox(key="pick_session@op_detail").set_value(TENSOR_SESSION).run()
    assert_clean(at)
    cand = store.sql("""SELECT r.run_id FROM runs r JOIN sessions s USING (session_id) WHERE s.name = ?
                        AND r.kind = 'candidate'""", [TENSOR_SESSION]).fetchone()[0]
    assert at.subheader[0].value.startswith(escape_md(first_nonfinite(store, cand).op)), at.subheader[0].value
