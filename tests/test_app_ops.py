"""AppTest: the Ops table -- rows, filters, sorting, pages, and opening a row."""

from __future__ import annotations

from precision_lab.ui.common import escape_md

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_SESSION, assert_clean, frame_with,  # noqa: F401
                         msprobe_nonfinite_count, msprobe_tensor_entries, open_page, ui_db, ui_template)

CAND_JSON = next(STAT_CAND.rglob("dump.json"))


def _caption(at) -> str:
    return next(c.value for c in at.caption if "record(s) match" in c.value)


def test_table_has_every_record_and_filters(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert _caption(at) == f"{n} record(s) match; page 1 of {-(-n // 50)}."
    table = frame_with(at, "severity")
    assert len(table) == 50 and list(table["seq"]) == sorted(table["seq"])

    at.toggle(key="f_problems").set_value(True).run()
    n_bad = msprobe_nonfinite_count(CAND_JSON)
    assert _caption(at).startswith(f"{n_bad} record(s) match")
    table = frame_with(at, "severity")
    assert set(table["severity"]) == {"nonfinite"}
    assert table["op"].iloc[0] == STAT_FIRST_NONFINITE  # execution order: the producer comes first

    at.text_input(key="f_pattern").input("fc1").run()
    table = frame_with(at, "severity")
    assert len(table) > 0 and all("fc1" in op for op in table["op"])
    at.multiselect(key="f_roles").set_value(["output"]).run()
    assert set(frame_with(at, "severity")["role"]) == {"output"}


def test_sort_and_paging(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    at.selectbox(key="f_sort").set_value("absmax")
    at.toggle(key="f_desc").set_value(True).run()
    vals = list(frame_with(at, "severity")["absmax"].dropna())
    assert vals == sorted(vals, reverse=True)
    at.number_input(key="f_page").set_value(11).run()
    assert_clean(at)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert len(frame_with(at, "severity")) == n - 500
    assert _caption(at).endswith("page 11 of 11.")


def test_selecting_a_row_opens_the_op(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    at.toggle(key="f_problems").set_value(True).run()
    at.session_state["ops_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))
