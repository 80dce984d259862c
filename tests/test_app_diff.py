"""AppTest: the Diff page, pair and N-run modes."""

from __future__ import annotations

from precision_lab.ui.common import escape_md

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_REF, STAT_SESSION, assert_clean,  # noqa: F401
                         frame_with, msprobe_nonfinite_count, msprobe_tensor_entries, open_page, ui_db, ui_template)

CAND_JSON = next(STAT_CAND.rglob("dump.json"))


def test_pair_diff_rows_and_problems(ui_db):
    at = open_page("diff", session=STAT_SESSION)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert any(c.value.startswith(f"{n} row(s)") for c in at.caption)
    table = frame_with(at, "ref absmax")
    assert {"ref absmax", "cand absmax", "max_rel_err", "verdict", "match"} <= set(table.columns)
    assert set(table["match"]) == {"exact"}
    at.selectbox(key="diff_show").set_value("problems").run()
    assert_clean(at)
    assert any(c.value.startswith(f"{msprobe_nonfinite_count(CAND_JSON)} row(s)") for c in at.caption)
    table = frame_with(at, "ref absmax")
    assert table["op"].iloc[0] == STAT_FIRST_NONFINITE
    assert table["ref absmax"].iloc[0] < 1e6 and table["cand absmax"].iloc[0] == float("inf")
    at.session_state["diff_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert at.title[0].value == "Op detail" and at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))


def test_nrun_mode_has_a_column_group_per_run(ui_db):
    at = open_page("diff", session=STAT_SESSION)
    at.radio(key="diff_mode").set_value("runs").run()
    assert_clean(at)
    table = frame_with(at, f"{STAT_CAND.name}: absmax")
    assert f"{STAT_REF.name}: absmax" in table.columns and f"{STAT_CAND.name}: verdict" in table.columns
    assert len(table) == 50
