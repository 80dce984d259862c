"""AppTest: the Diff page, pair and N-run modes."""

from __future__ import annotations

import pytest

from precision_lab.ui.common import escape_md

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_REF, STAT_SESSION, assert_clean,  # noqa: F401
                         frame_with, link, msprobe_nonfinite_count, msprobe_tensor_entries, open_page, ui_db, ui_template)

CAND_JSON = next(STAT_CAND.rglob("dump.json"))


@pytest.mark.slow
def test_pair_diff_rows_and_problems(ui_db):
    at = open_page("diff", session=STAT_SESSION)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert any(c.value.startswith(f"{n} row(s)") for c in at.caption)
    table = frame_with(at, "ref absmax")
    assert {"ref absmax", "cand absmax", "max_rel_err", "verdict", "match"} <= set(table.columns)
    assert set(table["match"]) == {"exact"}
    at.selectbox(key="show").set_value("problems").run()
    assert_clean(at)
    assert any(c.value.startswith(f"{msprobe_nonfinite_count(CAND_JSON)} row(s)") for c in at.caption)
    table = frame_with(at, "ref absmax")
    assert table["op"].iloc[0] == STAT_FIRST_NONFINITE
    assert float(table["ref absmax"].iloc[0]) < 1e6 and table["cand absmax"].iloc[0] == "inf"
    at.session_state["diff_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert at.title[0].value == "Op detail" and at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))


@pytest.mark.slow
def test_nrun_mode_has_a_column_group_per_run(ui_db):
    at = open_page("diff", session=STAT_SESSION)
    at.radio(key="view").set_value("runs").run()
    assert_clean(at)
    table = frame_with(at, f"{STAT_CAND.name}: absmax")
    assert f"{STAT_REF.name}: absmax" in table.columns and f"{STAT_CAND.name}: verdict" in table.columns
    assert len(table) == 50


def _settings(at) -> dict:
    out = {"view": at.radio(key="view").value, "show": at.selectbox(key="show").value,
           "pattern": at.text_input(key="q").value, "page": at.pagination(key="page").value}
    if out["view"] == "pair":
        out["pair"] = at.selectbox(key="pair").value
    return out


def _rows_caption(at) -> str:
    return next(c.value for c in at.caption if "row(s)" in c.value)


@pytest.mark.slow
def test_settings_come_from_the_url(ui_db):
    pair = f"{STAT_CAND.name} vs {STAT_REF.name}"
    at = open_page("diff", session=STAT_SESSION, view="pair", pair=pair, show="problems")
    assert _settings(at) == {"view": "pair", "show": "problems", "pattern": "", "page": 1, "pair": pair}
    n_bad = msprobe_nonfinite_count(CAND_JSON)
    assert _rows_caption(at) == f"{n_bad} row(s); page 1 of {-(-n_bad // 50)}."
    table = frame_with(at, "ref absmax")
    assert table["op"].iloc[0] == STAT_FIRST_NONFINITE
    assert all(v in ("inf", "nan") or float(v) > 6e4 for v in table["cand absmax"])  # overflowed fp16

    # a name pattern and a later page, as a colleague's link would carry them
    at = open_page("diff", session=STAT_SESSION, q="forward", page="2")
    assert _settings(at)["pattern"] == "forward" and _settings(at)["page"] == 2
    table = frame_with(at, "ref absmax")
    assert len(table) > 0 and all("forward" in op for op in table["op"])
    assert _rows_caption(at).split("; ")[1].startswith("page 2 of ")


@pytest.mark.slow
def test_runs_view_from_the_url_and_the_url_follows_the_widgets(ui_db):
    at = open_page("diff", session=STAT_SESSION, view="runs")
    assert_clean(at)
    assert at.radio(key="view").value == "runs"
    assert f"{STAT_CAND.name}: absmax" in frame_with(at, f"{STAT_REF.name}: absmax").columns

    at = open_page("diff", session=STAT_SESSION)
    assert not {"view", "show", "q", "page", "pair"} & set(at.query_params)  # defaults stay out of the link
    at.selectbox(key="show").set_value("problems")
    at.text_input(key="q").input("linear").run()
    url = link(at)
    assert url["show"] == "problems" and url["q"] == "linear" and url["session"] == STAT_SESSION
    colleague = open_page("diff", **url)
    assert _settings(colleague) == _settings(at)
    assert frame_with(colleague, "ref absmax").equals(frame_with(at, "ref absmax"))


@pytest.mark.slow
def test_garbage_in_the_url_falls_back_to_the_defaults(ui_db):
    at = open_page("diff", session=STAT_SESSION, view="everything", pair="nope vs nothing", show="<b>x</b>",
                   page="-3")
    assert_clean(at)
    pair = f"{STAT_CAND.name} vs {STAT_REF.name}"
    assert _settings(at) == {"view": "pair", "show": "all", "pattern": "", "page": 1, "pair": pair}
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert _rows_caption(at) == f"{n} row(s); page 1 of {-(-n // 50)}."
    assert not {"view", "show", "page", "pair"} & set(at.query_params)
    at = open_page("diff", session=STAT_SESSION, page="1e9")
    assert_clean(at)
    assert _settings(at)["page"] == 1


def test_pair_diff_puts_the_decision_before_the_statistics(ui_db):
    at = open_page("diff", session=STAT_SESSION)
    cols = list(frame_with(at, "ref absmax").columns)
    first_stat = min(i for i, c in enumerate(cols) if c.startswith(("ref ", "cand ")))
    # a statistics-only pair: the summaries' error right beside the (empty) element-wise one
    for decisive in ("op", "verdict", "max_rel_err", "summary_rel_err", "sqnr_db", "reason"):
        assert cols.index(decisive) < first_stat, (decisive, cols)
    assert cols.index("summary_rel_err") == cols.index("max_rel_err") + 1


@pytest.mark.slow
def test_data_mode_pairs_two_runs_by_their_data_and_names_the_first_divergent_pair(ui_db):
    at = open_page("diff", session=STAT_SESSION, view="data")
    assert_clean(at)
    table = frame_with(at, "how")
    assert {"ref", "cand", "how", "confidence", "out_error", "expected", "sqnr_db", "max_rel_err", "cosine"} <= set(
        table.columns)
    assert set(table["how"]) <= {"name", "anchor", "data-flow", "fused N:1"} and len(table) > 10
    # the fp16 run's overflow: its first op with a value the fp32 run does not have, while its inputs agree
    assert at.error and at.error[0].value.startswith(
        escape_md(f"First divergent pair: {STAT_FIRST_NONFINITE}"))


@pytest.mark.slow
def test_data_mode_takes_its_candidate_from_another_session(ui_db):
    """The reference from this session, the candidate from any other the visitor may list: the same fp32 dump
    ingested again into a session of its own pairs call for call and diverges nowhere."""
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store

    from precision_lab.store import queries as q

    store = Store(ui_db)
    ingest(STAT_REF, store=store, session="fp32-again")
    other = store.session("fp32-again").session_id
    ref_run = next(r.run_id for r in q.session_runs(store, store.session(STAT_SESSION).session_id)
                   if r.dtype == "float32")
    at = open_page("diff", session=STAT_SESSION, view="data")
    at.selectbox(key="data_session").set_value(other).run()  # by value: the options show session names
    assert_clean(at)
    cand = at.selectbox(key="data_cand")
    assert len(cand.options) == 1  # the other session's one run
    at.selectbox(key="data_ref").set_value(ref_run).run()
    assert_clean(at)
    assert at.success and at.success[0].value.startswith("No pair diverges"), [e.value for e in at.error]
    table = frame_with(at, "how")
    assert len(table) > 10 and set(table["diverges"]) == {False}
