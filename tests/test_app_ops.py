"""AppTest: the Ops table -- rows, filters, sorting, pages, and opening a row."""

from __future__ import annotations

import pytest

from precision_lab.ui.common import escape_md

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_SESSION, assert_clean, frame_with, link,  # noqa: F401
                         msprobe_nonfinite_count, msprobe_tensor_entries, open_page, ui_db, ui_template)

CAND_JSON = next(STAT_CAND.rglob("dump.json"))


def _caption(at) -> str:
    return next(c.value for c in at.caption if "record(s) match" in c.value)


@pytest.mark.slow
def test_table_has_every_record_and_filters(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert _caption(at) == f"{n} record(s) match; page 1 of {-(-n // 50)}."
    table = frame_with(at, "severity")
    assert len(table) == 50 and list(table["seq"]) == sorted(table["seq"])

    at.toggle(key="problems").set_value(True).run()
    n_bad = msprobe_nonfinite_count(CAND_JSON)
    assert _caption(at).startswith(f"{n_bad} record(s) match")
    table = frame_with(at, "severity")
    assert set(table["severity"]) == {"nonfinite"}
    assert table["op"].iloc[0] == STAT_FIRST_NONFINITE  # execution order: the producer comes first

    at.text_input(key="q").input("fc1").run()
    table = frame_with(at, "severity")
    assert len(table) > 0 and all("fc1" in op for op in table["op"])
    at.multiselect(key="role").set_value(["output"]).run()
    assert set(frame_with(at, "severity")["role"]) == {"output"}


@pytest.mark.slow
def test_sort_and_paging(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    at.selectbox(key="sort").set_value("absmax")
    at.toggle(key="desc").set_value(True).run()
    vals = list(frame_with(at, "severity")["absmax"].dropna())
    assert vals == sorted(vals, reverse=True)
    at.pagination(key="page").set_value(11).run()
    assert_clean(at)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert len(frame_with(at, "severity")) == n - 500
    assert _caption(at).endswith("page 11 of 11.")


@pytest.mark.slow
def test_selecting_a_row_opens_the_op(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    at.toggle(key="problems").set_value(True).run()
    at.session_state["ops_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    assert_clean(at)
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))


@pytest.mark.slow
def test_a_selection_left_past_the_end_of_a_shrunk_table_opens_nothing(ui_db):
    """A row chosen on a full page stays selected while the table shrinks below it (the last, shorter page): the
    page shows that page (no IndexError) and opens no op."""
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert len(frame_with(at, "severity")) == 50 > n - 500
    at.session_state["ops_table"] = {"selection": {"rows": [49], "columns": [], "cells": []}}
    at.pagination(key="page").set_value(11).run()
    assert_clean(at)
    assert at.title[0].value == "Ops"
    assert len(frame_with(at, "severity")) == n - 500
    # a selection inside the table still opens its op
    at.toggle(key="problems").set_value(True)
    at.session_state["ops_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.pagination(key="page").set_value(1).run()
    assert at.title[0].value == "Op detail"
    assert at.subheader[0].value.startswith(escape_md(STAT_FIRST_NONFINITE))


def _filters(at) -> dict:
    return {"roles": at.multiselect(key="role").value, "problems": at.toggle(key="problems").value,
            "pattern": at.text_input(key="q").value, "sort": at.selectbox(key="sort").value,
            "desc": at.toggle(key="desc").value, "page": at.pagination(key="page").value}


@pytest.mark.slow
def test_filters_come_from_the_url(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name, role=["output"], problems="true", q="fc1",
                   sort="absmax", desc="true")
    assert _filters(at) == {"roles": ["output"], "problems": True, "pattern": "fc1", "sort": "absmax",
                            "desc": True, "page": 1}
    table = frame_with(at, "severity")
    assert len(table) > 0 and set(table["severity"]) == {"nonfinite"} and set(table["role"]) == {"output"}
    assert all("fc1" in op for op in table["op"])
    vals = list(table["absmax"].dropna())
    assert vals == sorted(vals, reverse=True)
    # the same filters set by hand give the same table
    by_hand = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    by_hand.multiselect(key="role").set_value(["output"])
    by_hand.toggle(key="problems").set_value(True)
    by_hand.text_input(key="q").input("fc1")
    by_hand.selectbox(key="sort").set_value("absmax")
    by_hand.toggle(key="desc").set_value(True).run()
    assert frame_with(by_hand, "severity").equals(table)
    assert _caption(by_hand) == _caption(at)


def test_problems_only_from_the_url_shows_only_problem_rows(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name, problems="true")
    n_bad = msprobe_nonfinite_count(CAND_JSON)
    assert 0 < n_bad < len(msprobe_tensor_entries(CAND_JSON))
    assert _caption(at) == f"{n_bad} record(s) match; page 1 of {-(-n_bad // 50)}."
    table = frame_with(at, "severity")
    assert set(table["severity"]) == {"nonfinite"} and table["op"].iloc[0] == STAT_FIRST_NONFINITE


@pytest.mark.slow
def test_a_copied_url_opens_the_same_view(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name)
    at.selectbox(key="sort").set_value("absmax")
    at.multiselect(key="role").set_value(["input", "output"])
    at.pagination(key="page").set_value(3).run()
    url = link(at)
    assert url["sort"] == "absmax" and url["page"] == "3" and url["role"] == ["input", "output"]
    assert url["session"] == STAT_SESSION and url["run"] == STAT_CAND.name
    colleague = open_page("ops", **url)
    assert _filters(colleague) == _filters(at)
    assert frame_with(colleague, "severity").equals(frame_with(at, "severity"))
    assert _caption(colleague) == _caption(at) and _caption(at).startswith(f"{_count_roles()} record(s)")


def _count_roles() -> int:
    """Input and output tensors of the forward entries, counted from dump.json itself
    (msprobe names them ``<api>.<n>.forward`` or ``Module.<path>.forward.<n>``)."""
    import json

    data = json.loads(CAND_JSON.read_text())["data"]
    forward = [e for name, e in data.items() if "forward" in name.split(".")[-2:]]
    return sum(len(_tensors(e.get(part))) for e in forward for part in ("input_args", "output"))


def _tensors(x) -> list:
    if isinstance(x, dict):
        if x.get("type") == "torch.Tensor":
            return [x]
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, list):
        return [t for v in x for t in _tensors(v)]
    return []


@pytest.mark.slow
def test_garbage_in_the_url_falls_back_to_the_defaults(ui_db):
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name, sort="absmax; DROP TABLE tensors",
                   desc="maybe", problems="yes please", page="abc", role=["nope"], step=["x"], rank=["-1"])
    assert_clean(at)
    assert _filters(at) == {"roles": [], "problems": False, "pattern": "", "sort": "seq", "desc": False,
                            "page": 1}
    assert at.multiselect(key="step").value == [] and at.multiselect(key="rank").value == []
    n = len(msprobe_tensor_entries(CAND_JSON))
    assert _caption(at) == f"{n} record(s) match; page 1 of {-(-n // 50)}."
    assert not {"sort", "desc", "problems", "page", "role", "step", "rank"} & set(at.query_params)
    for bad in ("0", "-4", "1.5", "9" * 5000):
        at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name, page=bad)
        assert_clean(at)
        assert at.pagination(key="page").value == 1
    # a page past the end shows the last page
    at = open_page("ops", session=STAT_SESSION, run=STAT_CAND.name, page="999")
    assert_clean(at)
    assert _caption(at).endswith(f"page {-(-n // 50)} of {-(-n // 50)}.")
