"""Verdicts and severities: one order, one set of words, used by the store's SQL, the tables and the reports."""

from __future__ import annotations

import duckdb

from precision_lab.enums import Severity, Verdict, worst_first
from precision_lab.metrics import VERDICT_THRESHOLDS, verdict_for
from precision_lab.store.ranking import rank_case as _rank_case
from precision_lab.store.views import severity_sql
from precision_lab.ui.common import SEVERITIES, SEVERITY_COLORS


def _sorted_by_sql(case: str, values, desc: bool) -> list:
    con = duckdb.connect()
    con.execute("CREATE TABLE t (verdict VARCHAR)")
    con.executemany("INSERT INTO t VALUES (?)", [[v] for v in values])
    return [r[0] for r in con.execute(f"SELECT verdict FROM t ORDER BY {case} {'DESC' if desc else 'ASC'}, verdict")
            .fetchall()]


def test_sql_rank_sorts_as_the_enum_does():
    values = [v.value for v in Verdict]
    want = [v.value for v in worst_first(Verdict)]
    assert _sorted_by_sql(_rank_case("verdict", Verdict), values, desc=True) == want
    assert _sorted_by_sql(_rank_case("verdict", Verdict, worst_first_order=True), values, desc=False) == want
    sev = _rank_case("verdict", Severity, worst_first_order=True)
    assert _sorted_by_sql(sev, ["info", "error", "warn"], desc=False) == ["error", "warn", "info"]


def test_verdicts_of_metrics_are_the_enum_and_the_tables_use_its_words():
    # metrics' own thresholds give each verdict; every one is a Verdict member
    got = {verdict_for(nonfinite_introduced=0, rounding_units=u)[0]
           for u in (0.5, (VERDICT_THRESHOLDS["expected"] + VERDICT_THRESHOLDS["warn"]) / 2,
                     VERDICT_THRESHOLDS["warn"] * 2)}
    got.add(verdict_for(nonfinite_introduced=3, rounding_units=0.5)[0])
    assert got == {v.value for v in Verdict}
    assert SEVERITIES == ("nonfinite", "error", "warn", "ok")
    assert SEVERITY_COLORS["ok"] == Verdict.EXPECTED.colour and Verdict.of_label("ok") is Verdict.EXPECTED
    con = duckdb.connect()
    for v in Verdict:
        got = con.execute(f"SELECT {severity_sql('false', 'v')} FROM (SELECT ? AS v)", [v.value]).fetchone()[0]
        assert got == v.value  # the read model gives the verdict; ui.common.severity_label words it
    nf = con.execute(f"SELECT {severity_sql('true', 'v')} FROM (SELECT ? AS v)", [Verdict.EXPECTED.value]).fetchone()
    assert nf[0] == "nonfinite"
