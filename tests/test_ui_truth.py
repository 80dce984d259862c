"""The dashboard shows what the data hold: Inf counted in absmax and headroom,
one spelling for NaN / inf / missing, verdicts that never call a far-off
element "expected", and "not found" instead of another session or op.

Every expected value is computed here independently, with numpy float64 and
real casts, from the arrays written to the dump.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from precision_lab.formats import FORMATS
from precision_lab.stats import tensor_stats
from precision_lab.ui import detail
from precision_lab.display import MISSING
from precision_lab.ui.common import num_text, text_columns

from ui_fixtures import (STAT_CAND, STAT_SESSION, assert_clean, frames, open_page, serve_db,  # noqa: F401
                         ui_db, ui_template)

SESSION = "truth"
INF_OP = "blk.ovf.output.0"
SCALAR_OP = "blk.scalar.output.0"
NEAR0_OP = "blk.near0.output.0"
FP16_U = 2.0 ** -11  # fp16 unit roundoff, written out rather than taken from the code under test


def _arrays() -> dict[str, np.ndarray]:
    """fp32 reference values per tensor name."""
    rng = np.random.default_rng(7)
    ovf = rng.uniform(-100.0, 100.0, size=64).astype(np.float32)
    ovf[:3] = [5544.0, 70000.0, -70000.0]  # two values beyond fp16's max: Inf in the fp16 run
    near0 = rng.standard_normal(4096).astype(np.float32)
    near0[5] = 1e-3
    return {INF_OP: ovf, SCALAR_OP: np.array(1e5, dtype=np.float32), NEAR0_OP: near0}


def _candidate(name: str, ref: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        c = ref.astype(np.float16)
    if name == NEAR0_OP:
        c = c.copy()
        # one element 200x off its tiny reference value, and 0.2 off in a tensor of RMS 1: 410 fp16 unit
        # roundoffs of the tensor's scale, more than any rounding of values of that size leaves
        c[5] = np.float16(1e-3 + 0.2)
    return c


@pytest.fixture(scope="module")
def truth_template(tmp_path_factory):
    from precision_lab.services.ingest import ingest
    from precision_lab.store import Store, close_all

    root = tmp_path_factory.mktemp("truth")
    ref_dir, cand_dir = root / "ref_fp32", root / "cand_fp16"
    ref_dir.mkdir()
    cand_dir.mkdir()
    for name, x in _arrays().items():
        np.save(ref_dir / f"{name}.npy", x)
        np.save(cand_dir / f"{name}.npy", _candidate(name, x))
    db = root / "template.duckdb"
    store = Store(db)
    with store.held():  # the file opened once for the reads of the ingest, not once per read
        ingest([cand_dir], reference=[ref_dir], session=SESSION, store=store)
    close_all()
    return db


@pytest.fixture
def truth_db(truth_template, tmp_path, monkeypatch):
    db = tmp_path / "app.duckdb"
    shutil.copy(truth_template, db)
    with serve_db(db, monkeypatch):
        yield db


def _rid(db, kind: str, name: str) -> int:
    from precision_lab.store import Store

    return int(Store(db).df("""SELECT t.rid FROM tensors t JOIN runs r USING (run_id)
                               WHERE r.kind = ? AND t.name = ?""", [kind, name]).rid[0])


def _cand_run(db) -> str:
    from precision_lab.store import Store

    return str(Store(db).df("SELECT name FROM runs WHERE kind = 'candidate'").name[0])


def _bad_cells(at) -> list[tuple]:
    """Cells a table widget would print as "None", "NaN" or "Infinity": None, NaN and inf
    that were not turned into text."""
    out = []
    for i, f in enumerate(frames(at)):
        for col in f.columns:
            for v in f[col]:
                if v is None or (isinstance(v, float) and not math.isfinite(v)) or \
                        str(v) in ("None", "Infinity", "-Infinity", "NaN", "<NA>"):
                    out.append((i, col, v))
    return out


# ---- (a) Inf counts in absmax, headroom and "overflows" ------------------------------

def test_headroom_counts_inf_as_numpy_does():
    x = np.array([1.0, 5544.0, np.inf, -np.inf, 3.0], dtype=np.float32)
    table = detail.headroom_table(tensor_stats(x), ["fp16", "bf16"]).set_index("format")
    truth = float(np.max(np.abs(x.astype(np.float64))))  # inf
    assert math.isinf(truth)
    for fmt in ("fp16", "bf16"):
        assert table.loc[fmt, "absmax"] == truth
        assert table.loc[fmt, "headroom (bits)"] == -math.inf
        assert str(table.loc[fmt, "overflows"]).startswith("yes")
    # without the Inf the finite absmax and the real cast decide
    y = x[np.isfinite(x)]
    t2 = detail.headroom_table(tensor_stats(y), ["fp16"]).set_index("format")
    assert t2.loc["fp16", "absmax"] == float(np.max(np.abs(y.astype(np.float64))))
    assert t2.loc["fp16", "headroom (bits)"] == pytest.approx(math.log2(65504.0 / 5544.0))
    assert t2.loc["fp16", "overflows"] == ("yes" if np.isinf(y.astype(np.float16)).any() else "no")


def test_stats_table_of_a_scalar_inf_is_not_nan():
    x = np.array(np.inf, dtype=np.float32)
    table = detail.stats_table([("x", tensor_stats(x))])["x"]
    assert table["absmax"] == num_text(float(np.abs(x.astype(np.float64))))  # "inf"
    assert table["absmax"] == "inf"
    for f in ("min", "max"):
        assert table[f] != "nan" and table[f] == "inf"


@pytest.mark.parametrize("values", [[1.0, 5544.0, np.inf, -np.inf, 3.0], [1.0, np.inf, 2.0], [-np.inf, 4.0],
                                    [-np.inf], [np.nan, np.inf], [1.5, -2.5]])
def test_stats_table_extremes_are_numpys_over_the_non_nan_values(values):
    x = np.array(values, dtype=np.float32)
    table = detail.stats_table([("x", tensor_stats(x))])["x"]
    assert table["min"] == num_text(float(np.nanmin(x.astype(np.float64))))
    assert table["max"] == num_text(float(np.nanmax(x.astype(np.float64))))


def test_stats_table_of_only_nan_says_no_finite_value():
    table = detail.stats_table([("x", tensor_stats(np.array([np.nan, np.nan], np.float32)))])["x"]
    assert "no finite value" in table["min"] and "no finite value" in table["max"]


@pytest.mark.slow
def test_op_detail_of_a_tensor_holding_inf(truth_db):
    rid = _rid(truth_db, "candidate", INF_OP)
    at = open_page("op_detail", session=SESSION, run=_cand_run(truth_db), op=str(rid), fmt="fp16")
    cast = _arrays()[INF_OP].astype(np.float64)
    with np.errstate(over="ignore"):
        cand = cast.astype(np.float16).astype(np.float64)
    assert int(np.isinf(cand).sum()) == 2
    head = next(f for f in frames(at) if "headroom (bits)" in f.columns)
    assert head.loc[0, "absmax"] == num_text(float(np.max(np.abs(cand)))) == "inf"
    assert head.loc[0, "headroom (bits)"] == "-inf"
    assert head.loc[0, "overflows"].startswith("yes")
    stats = next(f for f in frames(at) if "inf_count" in f.index)
    col = stats.columns[0]
    assert stats.loc["absmax", col] == "inf" and stats.loc["inf_count", col] == "2"
    # the signs are counted: the extremes are numpy's over every non-NaN value
    assert stats.loc["max", col] == num_text(float(np.nanmax(cand)))
    assert stats.loc["min", col] == num_text(float(np.nanmin(cand)))


@pytest.mark.slow
def test_op_detail_of_a_scalar_inf(truth_db):
    rid = _rid(truth_db, "candidate", SCALAR_OP)
    at = open_page("op_detail", session=SESSION, run=_cand_run(truth_db), op=str(rid), fmt="fp16")
    with np.errstate(over="ignore"):
        assert np.isinf(np.float64(np.float16(_arrays()[SCALAR_OP])))
    stats = next(f for f in frames(at) if "inf_count" in f.index)
    col = stats.columns[0]
    assert stats.loc["absmax", col] == "inf"
    assert all(stats.loc[f, col] != "nan" for f in ("min", "max", "absmax"))


# ---- (b) one spelling: nan, inf, -inf, missing ----------------------------------------

def test_num_text_spells_every_case_once():
    import pandas as pd

    assert [num_text(v) for v in (None, float("nan"), np.float32("inf"), -math.inf, pd.NA)] == \
        [MISSING, "nan", "inf", "-inf", MISSING]
    df = pd.DataFrame({"a": pd.Series([None, float("nan"), math.inf, 1.5], dtype=object), "b": list("wxyz")})
    out = text_columns(df)
    assert list(out["a"]) == [MISSING, "nan", "inf", "1.5"] and list(out["b"]) == list("wxyz")


@pytest.mark.slow
def test_tables_never_print_none_or_infinity(truth_db):
    run = _cand_run(truth_db)
    for at in (open_page("ops", session=SESSION, run=run), open_page("diff", session=SESSION),
               open_page("overview", session=SESSION)):
        assert frames(at)
        assert not _bad_cells(at)


@pytest.mark.slow
def test_summary_only_session_shows_missing_not_none(ui_db):
    # msprobe statistics carry no elements: SQNR and rounding units were never computed
    for at in (open_page("overview", session=STAT_SESSION), open_page("ops", session=STAT_SESSION, run=STAT_CAND.name),
               open_page("diff", session=STAT_SESSION)):
        assert frames(at) and not _bad_cells(at)
    at = open_page("overview", session=STAT_SESSION)
    top = next(f for f in frames(at) if "rounding_units" in f.columns)
    assert set(top["sqnr_db"]) == {MISSING} and set(top["rounding_units"]) == {MISSING}


def test_ops_table_numbers_match_numpy(truth_db):
    at = open_page("ops", session=SESSION, run=_cand_run(truth_db))
    table = next(f for f in frames(at) if "max_rel_err" in f.columns).set_index("op")
    with np.errstate(over="ignore"):
        ovf = _arrays()[INF_OP].astype(np.float16).astype(np.float64)
    row = table.loc[table.index.str.contains("ovf")].iloc[0]
    assert row["absmax"] == num_text(float(np.max(np.abs(ovf)))) == "inf"
    assert row["inf"] == str(int(np.isinf(ovf).sum()))
    r = _arrays()[NEAR0_OP].astype(np.float64)
    c = _candidate(NEAR0_OP, _arrays()[NEAR0_OP]).astype(np.float64)
    want = float(np.max(np.abs(c - r) / np.maximum(np.abs(r), 2.0 ** -14)))
    near = table.loc[table.index.str.contains("near0")].iloc[0]
    assert float(near["max_rel_err"]) == pytest.approx(want, rel=1e-3)


# ---- (c) a far-off element is never "expected" ----------------------------------------

def test_verdict_of_a_far_off_element_is_not_expected(truth_db):
    from precision_lab.store import Store

    r = _arrays()[NEAR0_OP].astype(np.float64)
    c = _candidate(NEAR0_OP, _arrays()[NEAR0_OP]).astype(np.float64)
    rel = np.abs(c - r) / np.maximum(np.abs(r), 2.0 ** -14)
    rms_units = math.sqrt(np.mean((c - r) ** 2)) / math.sqrt(np.mean(r ** 2)) / FP16_U
    assert rms_units < 8 and rel.max() > 10  # the RMS alone would call it rounding
    scaled = np.abs(c - r) / np.maximum(np.abs(r), math.sqrt(np.mean(r ** 2)))
    assert scaled.max() / FP16_U > 64  # and so would a near-zero element judged against the tensor's scale
    got = Store(truth_db).df("""SELECT c.verdict, c.reason, c.max_rel_err FROM comparisons c
                                JOIN tensors t ON t.run_id = c.cand_run_id AND t.rid = c.cand_rid
                                WHERE t.name = ? AND c.kind = 'accumulated'""", [NEAR0_OP])
    assert float(got.max_rel_err[0]) == pytest.approx(float(rel.max()), rel=1e-6)
    assert got.verdict[0] != "expected" and "one element" in got.reason[0]


@pytest.mark.parametrize("bad_rel", [1.9, 15.25, 0.2])
def test_compare_withdraws_expected_for_large_relative_errors(bad_rel):
    from precision_lab.metrics import compare

    rng = np.random.default_rng(3)
    r = rng.standard_normal(8192).astype(np.float32)
    r[0] = 0.5
    c = r.astype(np.float16)
    c[0] = np.float16(0.5 * (1 + bad_rel))
    r64, c64 = r.astype(np.float64), c.astype(np.float64)
    worst = float(np.max(np.abs(c64 - r64) / np.maximum(np.abs(r64), 2.0 ** -14)))
    assert worst == pytest.approx(bad_rel, rel=1e-2)
    got = compare(r, c)
    assert got.max_rel_err == pytest.approx(worst)
    assert got.verdict != "expected"


def test_plain_rounding_stays_expected():
    from precision_lab.metrics import compare

    for dtype, fmt in ((np.float16, "fp16"), (None, "bf16")):
        r = np.random.default_rng(5).standard_normal(8192).astype(np.float32)
        if dtype is None:
            import ml_dtypes

            c = r.astype(ml_dtypes.bfloat16).astype(np.float32)
        else:
            c = r.astype(dtype)
        worst = np.max(np.abs(c.astype(np.float64) - r) / np.maximum(np.abs(r), FORMATS[fmt].smallest_normal))
        assert worst <= FORMATS[fmt].eps / 2 * (1 + 1e-9)  # one correctly rounded cast
        assert compare(r, c, cand_format=fmt).verdict == "expected"


# ---- (d) unknown session or op: say so, open nothing else -------------------------------

@pytest.mark.slow
def test_unknown_session_says_not_found(truth_db):
    for page in ("overview", "ops", "diff", "op_detail"):
        at = open_page(page, session="nope")
        assert_clean(at)
        assert any("no session named nope" in w.value.replace("\\", "") for w in at.warning), page
        assert not at.dataframe and not at.get("plotly_chart"), page


@pytest.mark.parametrize("op", ["abc", "999999", "-1"])
def test_unknown_op_says_not_found(truth_db, op):
    at = open_page("op_detail", session=SESSION, run=_cand_run(truth_db), op=op)
    assert_clean(at)
    assert any(f"has no op {op}" in w.value.replace("\\", "") for w in at.warning)
    assert not at.subheader and not at.dataframe and not at.get("plotly_chart")


@pytest.mark.slow
def test_known_op_still_opens(truth_db):
    rid = _rid(truth_db, "candidate", NEAR0_OP)
    at = open_page("op_detail", session=SESSION, run=_cand_run(truth_db), op=str(rid))
    assert not at.warning
    assert at.subheader[0].value.replace("\\", "") == NEAR0_OP
