"""The dashboard's view-models, checked against numbers computed another way:
real casts through ml_dtypes/numpy, float64 numpy, and the dump's own JSON."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from precision_lab.origin import OpRef

from precision_lab.formats import FORMATS
from precision_lab.stats import tensor_stats
from precision_lab.store import views
from precision_lab.store.queries import session_runs
from precision_lab.ui import detail, diff, ops, overview
from precision_lab.display import MISSING
from precision_lab.ui.common import escape_md, num_text
from precision_lab.ui.sessions import sessions_table

from ui_fixtures import (STAT_CAND, STAT_FIRST_NONFINITE, STAT_SESSION, TENSOR_SESSION, WIDE_OP,  # noqa: F401
                         msprobe_nonfinite_count, msprobe_tensor_entries, ui_db, ui_template, wide_values)

CAND_JSON = next(STAT_CAND.rglob("dump.json"))

# formats whose ml_dtypes/numpy cast turns an overflow into inf or NaN, so
# the cast itself tells which values overflow
CAST_DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8_e4m3fn": ml_dtypes.float8_e4m3fn,
               "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "fp8_e5m2": ml_dtypes.float8_e5m2,
               "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz}


def cast_counts(x: np.ndarray, dtype) -> dict:
    """overflow / underflow / subnormal counts from a real cast of the finite nonzero values."""
    x = x[np.isfinite(x)].astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        c = x.astype(dtype).astype(np.float64)
    tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
    nz = x != 0
    return {
        "overflow": int((nz & ~np.isfinite(c)).sum()),
        "underflow": int((nz & (c == 0)).sum()),
        "subnormal": int((nz & np.isfinite(c) & (c != 0) & (np.abs(c) < tiny)).sum()),
    }


@pytest.fixture
def db(ui_db):
    from precision_lab.store import Store

    store = Store(ui_db)
    with store.held():  # as a dashboard page run holds it: the views are what a page run asks
        yield store


def _runs(store, session):
    sid = store.session(session).session_id
    runs = {r.kind: r for r in session_runs(store, sid)}
    return sid, runs


def _first_nonfinite_from_json(path) -> str:
    """First entry (dump order) whose inputs are all finite and some output is not."""
    import json

    data = json.loads(path.read_text())["data"]

    def tensors(x):
        if isinstance(x, dict):
            if x.get("type") == "torch.Tensor":
                yield x
                return
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, list):
            for v in x:
                yield from tensors(v)

    def bad(t):
        return not (math.isfinite(t["Max"]) and math.isfinite(t["Min"]))

    for key, entry in data.items():
        ins = list(tensors(entry.get("input_args", []))) + list(tensors(entry.get("input_kwargs", {})))
        outs = list(tensors(entry.get("output", [])))
        if not any(bad(t) for t in ins) and any(bad(t) for t in outs):
            return key
    raise AssertionError("no non-finite producer in the dump")


# ---- histogram and formats ---------------------------------------------------------

def test_binade_counts_match_frexp_of_the_values():
    x = wide_values().ravel()
    got = detail.binade_counts(tensor_stats(x).hist)
    a = np.abs(x[(x != 0) & np.isfinite(x)]).astype(np.float64)
    _, e = np.frexp(a)  # a = m * 2^e with m in [0.5, 1): binade e - 1
    want = np.unique(e - 1, return_counts=True)
    assert got["exp"].tolist() == want[0].tolist()
    assert got["count"].tolist() == want[1].tolist()


@pytest.mark.parametrize("fmt", sorted(CAST_DTYPES))
def test_representability_table_matches_a_real_cast(fmt):
    x = wide_values().ravel()
    table = detail.representability_table(tensor_stats(x), [fmt]).set_index("format")
    want = cast_counts(x, CAST_DTYPES[fmt])
    for k, v in want.items():
        assert int(table.loc[fmt, k]) == v, k
        assert table.loc[fmt, f"{k} %"] == pytest.approx(100.0 * v / x.size)
    assert int(table.loc[fmt, "zero"]) == int((x == 0).sum())


def test_what_if_lists_every_format_but_fp32_with_cast_exact_counts():
    x = wide_values().ravel()
    table = detail.what_if_table(tensor_stats(x)).set_index("format")
    assert list(table.index) == [f for f in FORMATS if f != "fp32"]
    for fmt, dtype in CAST_DTYPES.items():
        assert int(table.loc[fmt, "overflow"]) == cast_counts(x, dtype)["overflow"]
        assert table.loc[fmt, "max finite"] == float(ml_dtypes.finfo(dtype).max)


def test_value_region_agrees_with_fp16_casts():
    f16 = FORMATS["fp16"]
    for v in (65519.0, 65520.0, 1e-5, 1e-8, 3e-8, 2.0 ** -14, -70000.0, 0.5):
        with np.errstate(over="ignore"):
            c = float(np.float16(v))
        if not math.isfinite(c):
            want = "overflow"
        elif c == 0:
            want = "rounds to 0"
        elif abs(c) < float(np.finfo(np.float16).tiny):
            want = "subnormal"
        else:
            want = "normal"
        assert detail.value_region(v, f16) == want, v
    assert detail.value_region(math.inf, f16) == "non-finite"
    assert detail.value_region(0.0, f16) == "zero"


def test_headroom_of_a_stats_only_record(db):
    sid, runs = _runs(db, STAT_SESSION)
    first = overview.first_nonfinite_by_run(db, sid)
    cand_first = next(f.first for f in first if f.run.kind == "candidate")
    ref = views.counterparts(db, runs["candidate"].run_id, cand_first.rid)[0]
    st = detail.load_stats(db, ref.run_id, ref.rid)
    assert st.hist is None
    table = detail.headroom_table(st, ["fp16", "bf16"]).set_index("format")
    # the fp32 reference's Max/Min from its dump.json, independently
    import json

    entry = json.loads(next(STAT_CAND.parent.joinpath("stat_mix_fp32_inner_ovf").rglob("dump.json"))
                       .read_text())["data"][STAT_FIRST_NONFINITE]["output"][0]
    absmax = max(abs(entry["Max"]), abs(entry["Min"]))
    assert table.loc["fp16", "headroom (bits)"] == pytest.approx(math.log2(65504.0 / absmax))
    assert table.loc["fp16", "overflows"] == "yes" and table.loc["bf16", "overflows"] == "no"
    cand = detail.load_stats(db, runs["candidate"].run_id, cand_first.rid)
    assert detail.headroom_table(cand, ["fp16"]).loc[0, "overflows"] == "yes: already inf"
    vals = detail.summary_values_table(st, ["fp16"]).set_index("statistic")
    assert vals.loc["absmax", "fp16"] == "overflow" and vals.loc["Mean", "fp16"] == "normal"


def test_figures_carry_the_format_lines():
    x = wide_values().ravel()
    fig = detail.histogram_figure([("x", tensor_stats(x))], ["fp16", "fp8_e4m3fn"])
    xs = {round(s["x0"], 6) for s in fig.layout.shapes if s["type"] == "line"}
    for fmt in ("fp16", "fp8_e4m3fn"):
        f = FORMATS[fmt]
        assert round(math.log2(f.max), 6) in xs and round(math.log2(f.smallest_normal), 6) in xs
    assert fig.layout.xaxis.title.text.startswith("log2 |x|")
    bars = [t for t in fig.data if t.type == "bar"]
    assert sum(bars[0].y) == int(((x != 0) & np.isfinite(x)).sum())
    summ = detail.summary_figure([("s", tensor_stats(x))], ["fp16"])
    assert summ.layout.xaxis.title.text == "log2 |value|"


# ---- overview ------------------------------------------------------------------------

def test_first_nonfinite_matches_the_dump_json(db):
    sid, _ = _runs(db, STAT_SESSION)
    assert _first_nonfinite_from_json(CAND_JSON) == STAT_FIRST_NONFINITE
    got = {f.run.kind: f.first for f in overview.first_nonfinite_by_run(db, sid)}
    assert got["reference"] is None
    assert got["candidate"].op == STAT_FIRST_NONFINITE
    assert got["candidate"].path[-1].op == STAT_FIRST_NONFINITE


def test_top_offenders_are_ordered_worst_first(db):
    sid, _ = _runs(db, STAT_SESSION)
    top = views.top_offenders(db, sid, n=20)
    assert len(top) == 20 and "nonfinite" not in set(top["verdict"])
    rank = {"error": 0, "warn": 1, "expected": 2}
    # a statistics-only session: ranked by the summaries' error, and no element-wise error anywhere
    assert set(top["basis"]) == {"stats"} and top["max_rel_err"].isna().all()
    keys = [(rank[v], -e) for v, e in zip(top["verdict"], top["summary_rel_err"])]
    assert keys == sorted(keys)
    with_nf = views.top_offenders(db, sid, n=5, include_nonfinite=True)
    assert set(with_nf["verdict"]) == {"nonfinite"}


def test_error_series_buckets_keep_the_worst_value(db):
    sid, runs = _runs(db, STAT_SESSION)
    # a statistics-only session: its error is the summaries' (summary_rel_err), it has no element-wise one
    assert overview.default_error_metric(db, sid) == "summary_rel_err"
    assert views.error_series(db, sid, "max_rel_err", roles=())["value"].isna().all()
    full = views.error_series(db, sid, "summary_rel_err", roles=())
    raw = db.df("SELECT seq, summary_rel_err FROM comparisons WHERE session_id = ? AND verdict IS NOT NULL", [sid])
    assert full.attrs["bucket"] == 1
    assert len(full) == raw["seq"].nunique()
    small = views.error_series(db, sid, "summary_rel_err", roles=(), max_points=10)
    b = small.attrs["bucket"]
    assert b == math.ceil(len(raw) / 10) and len(small) <= math.ceil((raw["seq"].max() + 1) / b)
    fin = raw[np.isfinite(raw["summary_rel_err"].astype(float))]
    want = fin.groupby(fin["seq"] // b)["summary_rel_err"].max()
    got = small.set_index(small["seq"] // b)["value"].dropna()
    assert len(got) > 0 and got.to_dict() == pytest.approx(want.loc[got.index].to_dict())
    fig = overview.error_figure(full, "summary_rel_err", first_nonfinite=[OpRef(STAT_FIRST_NONFINITE, None, 0, 0, 53)])
    assert fig.layout.yaxis.type == "log" and fig.layout.xaxis.title.text == "execution order (seq)"
    assert fig.layout.yaxis.title.text.startswith("summary relative error")
    with pytest.raises(ValueError, match="unknown error metric"):
        views.error_series(db, sid, "bogus")


def test_diagnosis_cards_come_from_the_store(db):
    from precision_lab.records import Diagnosis
    from precision_lab.services.cards import DiagnosisCard, diagnosis_cards

    sid, runs = _runs(db, STAT_SESSION)
    with db.extend_session(STAT_SESSION) as w:
        w.add_diagnosis(Diagnosis(sid, runs["candidate"].run_id, STAT_FIRST_NONFINITE, "overflow",
                                  "output absmax 81078 > fp16 max 65504", ("keep-fp32:blocks.2.fc1", "use-bf16"),
                                  "error", 53))
    before = db.df("SELECT count(*) AS n FROM diagnoses WHERE session_id = ?", [sid]).n[0]
    cards = diagnosis_cards(db, sid)
    assert len(cards) == before
    assert [c for c in cards if c.message == "output absmax 81078 > fp16 max 65504"] == [DiagnosisCard(
        runs["candidate"].name, runs["candidate"].run_id, STAT_FIRST_NONFINITE, "overflow",
        "output absmax 81078 > fp16 max 65504", ("keep-fp32:blocks.2.fc1", "use-bf16"), "error", 53)]


def test_sessions_table_headlines(db):
    t = sessions_table(db).set_index("session")
    assert STAT_FIRST_NONFINITE in t.loc[STAT_SESSION, "first non-finite"]
    assert f"{WIDE_OP}" in t.loc[TENSOR_SESSION, "first non-finite"]
    assert "float16, candidate" in t.loc[STAT_SESSION, "runs"]


# ---- ops table --------------------------------------------------------------------------

@pytest.mark.slow
def test_ops_page_counts_filters_and_pages(db):
    _, runs = _runs(db, STAT_SESSION)
    run_id = runs["candidate"].run_id
    entries = msprobe_tensor_entries(CAND_JSON)
    page = ops.ops_page(db, views.OpsFilter(run_id))
    assert page.total == len(entries) and len(page.rows) == 50 and page.pages == math.ceil(len(entries) / 50)
    assert page.rows["seq"].is_monotonic_increasing
    last = ops.ops_page(db, views.OpsFilter(run_id), page=99)
    assert last.page == page.pages - 1 and len(last.rows) == len(entries) - 50 * (page.pages - 1)
    probs = ops.ops_page(db, views.OpsFilter(run_id, only_problems=True), page_size=1000)
    assert probs.total == msprobe_nonfinite_count(CAND_JSON)
    assert set(probs.rows["severity"]) == {"nonfinite"}
    import json

    data = json.loads(CAND_JSON.read_text())["data"]
    n_linear10 = sum(len(list(msprobe_tensor_entries_of(v))) for k, v in data.items() if "linear.10." in k)
    pat = ops.ops_page(db, views.OpsFilter(run_id, pattern="linear.10."), page_size=1000)
    assert pat.total == n_linear10 and all("linear.10." in n for n in pat.rows["name"])
    glob = ops.ops_page(db, views.OpsFilter(run_id, pattern="Functional.linear.1?.forward.output.*"), page_size=1000)
    import re

    want_ops = sorted(k for k in data if re.fullmatch(r"Functional\.linear\.1.\.forward", k))
    assert len(want_ops) > 1 and sorted(set(glob.rows["op"])) == want_ops
    assert set(glob.rows["role"]) == {"output"}
    srt = ops.ops_page(db, views.OpsFilter(run_id, sort="absmax", descending=True), page_size=600)
    vals = srt.rows["absmax"].dropna().to_numpy()
    assert all(a >= b for a, b in zip(vals, vals[1:])) and math.isinf(vals[0])
    rank = {"nonfinite": 3, "error": 2, "warn": 1}
    sev = ops.ops_page(db, views.OpsFilter(run_id, sort="severity", descending=True), page_size=1000)
    ranks = [rank.get(v, 0) for v in sev.rows["severity"]]
    assert ranks == sorted(ranks, reverse=True) and ranks[0] == 3 and sev.total == len(entries)
    assert sev.rows["seq"].iloc[0] == min(probs.rows["seq"])  # ties in execution order
    roles = ops.ops_page(db, views.OpsFilter(run_id, roles=("param",)), page_size=1000)
    assert roles.total > 0 and set(roles.rows["role"]) == {"param"}
    with pytest.raises(ValueError, match="cannot sort"):
        views.OpsFilter(run_id, sort="name; DROP TABLE tensors")


def msprobe_tensor_entries_of(entry):
    if isinstance(entry, dict):
        if entry.get("type") == "torch.Tensor":
            yield entry
            return
        for v in entry.values():
            yield from msprobe_tensor_entries_of(v)
    elif isinstance(entry, list):
        for v in entry:
            yield from msprobe_tensor_entries_of(v)


def test_name_pattern_escapes_like_wildcards():
    from precision_lab.store.views import name_pattern_sql

    assert name_pattern_sql("a_b%c") == "%a\\_b\\%c%"
    assert name_pattern_sql("blocks.*.fc?") == "blocks.%.fc_"


def test_ops_metrics_match_float64_numpy(db):
    _, runs = _runs(db, TENSOR_SESSION)
    page = ops.ops_page(db, views.OpsFilter(runs["candidate"].run_id, pattern="blocks.1.proj"))
    row = page.rows.iloc[0]
    r = (np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8) * 3).astype(np.float64)
    c = (np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8) * 3).astype(np.float16).astype(np.float64)
    assert row["max_abs_err"] == pytest.approx(np.abs(c - r).max(), rel=1e-12)
    assert row["sqnr_db"] == pytest.approx(10 * np.log10((r * r).sum() / ((c - r) ** 2).sum()), rel=1e-9)
    cos = (r * c).sum() / np.sqrt((r * r).sum() * (c * c).sum())
    assert 1 - row["cosine_deficit"] == pytest.approx(cos, abs=1e-12)
    text = ops.display_frame(page.rows).loc[0, "cosine"]
    assert float(text.split()[0]) == pytest.approx(cos, abs=1e-11) and "1-cos" in text


# ---- detail and diff ------------------------------------------------------------------

def test_metrics_table_shows_both_sides(db):
    _, runs = _runs(db, TENSOR_SESSION)
    rid = db.df("SELECT rid FROM tensors WHERE run_id = ? AND name = ?",
                [runs["candidate"].run_id, f"{WIDE_OP}.output.0"]).rid[0]
    t = detail.metrics_table(db, runs["candidate"].run_id, rid)
    col = f"accumulated vs reference {runs['reference'].name}"
    assert list(t.columns) == [col]
    x = wide_values()
    with np.errstate(over="ignore"):
        introduced = int((np.isfinite(x) & ~np.isfinite(x.astype(np.float16))).sum())
    assert t.loc["verdict", col] == "nonfinite" and t.loc["NaN/Inf introduced", col] == str(introduced)
    back = detail.metrics_table(db, runs["reference"].run_id, rid)
    assert list(back.columns) == [f"candidate {runs['candidate'].name} vs this"]


def test_diff_pair_aligns_and_lists_unmatched(db, tmp_path):
    from precision_lab.services.ingest import ingest

    ref, cand = tmp_path / "r_fp32", tmp_path / "c_fp16"
    ref.mkdir()
    cand.mkdir()
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(ref / "m.a.output.0.npy", a)
    np.save(cand / "m.a.output.0.npy", a.astype(np.float16))
    np.save(cand / "m.extra.output.0.npy", a.astype(np.float16))
    ingest([cand], reference=[ref], session="unmatched", store=db)
    sid, runs = _runs(db, "unmatched")
    pair = views.pair_options(db, sid)[0]
    page = diff.diff_page(db, sid, pair.ref_run_id, pair.cand_run_id)
    assert page.total == 2
    un = diff.diff_page(db, sid, pair.ref_run_id, pair.cand_run_id, show="unmatched")
    assert un.total == 1
    row = un.rows.iloc[0]
    assert row["op"] == "m.extra" and row["match"] == "unmatched_cand"
    assert row["ref absmax"] is None or math.isnan(row["ref absmax"])
    assert row["cand absmax"] == 11.0 and (row["verdict"] is None or row["verdict"] != row["verdict"]
                                           or row["verdict"] is np.nan)


def test_diff_problems_start_at_the_first_nonfinite_op(db):
    sid, runs = _runs(db, STAT_SESSION)
    page = diff.diff_page(db, sid, runs["reference"].run_id, runs["candidate"].run_id, show="problems",
                          page_size=5)
    assert page.total == msprobe_nonfinite_count(CAND_JSON)
    assert page.rows.iloc[0]["op"] == STAT_FIRST_NONFINITE
    assert page.rows.iloc[0]["severity"] == "nonfinite"


def test_a_stats_only_pair_shows_its_summary_errors_apart(db):
    """The msprobe statistics sample: its Diff and Ops rows carry summary_rel_err (the relative change of the
    summaries, recomputed here from the two sides' stored Max, Min and Norm) and no element-wise max_rel_err."""
    sid, runs = _runs(db, STAT_SESSION)
    ref, cand = runs["reference"].run_id, runs["candidate"].run_id
    page = diff.diff_page(db, sid, ref, cand, page_size=1000)
    df = page.rows
    assert page.stats_basis and set(df["basis"].dropna()) == {"stats"}
    cols = list(df.columns)
    assert cols.index("summary_rel_err") == cols.index("max_rel_err") + 1 and "summary_abs_err" in cols
    assert df["max_rel_err"].isna().all() and df["max_abs_err"].isna().all()
    floor = float(np.finfo(np.float16).smallest_normal)
    checked = 0
    for _, row in df[df["match"] == "exact"].iterrows():
        pairs = [(row[f"ref {f}"], row[f"cand {f}"]) for f in ("max", "min", "l2norm")]
        pairs = [(a, b) for a, b in pairs if a is not None and b is not None and np.isfinite(a) and np.isfinite(b)]
        if not pairs or row["verdict"] == "nonfinite":
            continue
        want = max(abs(b - a) / max(abs(a), floor) for a, b in pairs)
        assert row["summary_rel_err"] == pytest.approx(want, rel=1e-9, abs=1e-300), row["op"]
        assert row["summary_abs_err"] == pytest.approx(max(abs(b - a) for a, b in pairs), rel=1e-9, abs=1e-300)
        checked += 1
    assert checked > 20
    # a pair compared element-wise shows no summary columns
    tsid, truns = _runs(db, TENSOR_SESSION)
    tpage = diff.diff_page(db, tsid, truns["reference"].run_id, truns["candidate"].run_id)
    assert not tpage.stats_basis and "summary_rel_err" not in tpage.rows.columns
    assert tpage.rows["max_rel_err"].notna().any()
    # the Ops table: the same errors, sortable by them
    opage = ops.ops_page(db, views.OpsFilter(cand, sort="summary_rel_err", descending=True), page_size=1000)
    assert opage.stats_basis and opage.rows["max_rel_err"].isna().all()
    vals = [v for v in opage.rows["summary_rel_err"] if v is not None and not math.isnan(v)]
    assert len(vals) > 20 and vals == sorted(vals, reverse=True)
    assert list(opage.rows["summary_rel_err"][:len(vals)]) == vals  # records with a value first
    shown = ops.display_frame(opage.rows, summary=opage.stats_basis)
    names = list(shown.columns)
    assert names.index("summary_rel_err") == names.index("max_rel_err") + 1
    assert "summary_rel_err" not in ops.display_frame(opage.rows, summary=False).columns
    # the headline names the summaries' error, not an element-wise one
    assert "summary rel err" in overview.session_headline(db, sid)["worst"]
    # Op detail: the summaries' errors in rows of their own, the element-wise ones missing
    row = df[df["summary_rel_err"].map(lambda v: v is not None and np.isfinite(v))].iloc[0]
    t = detail.metrics_table(db, cand, int(row["cand_rid"]))
    col = f"accumulated vs reference {runs['reference'].name}"
    assert t.loc["summary rel error", col] == num_text(row["summary_rel_err"], 8)
    assert t.loc["summary abs error", col] == num_text(row["summary_abs_err"], 8)
    assert t.loc["max rel error", col] == MISSING and t.loc["basis", col] == "stats"


def test_element_wise_and_summary_errors_are_never_ranked_as_one_number(store):
    """A run compared element-wise for some records and on summary statistics for another: sorted by
    max_rel_err, the element-wise errors come first (by their value), then the summaries' (by theirs), however
    large; the Ops sort, its filtered form and the top offenders agree."""
    from precision_lab.metrics import compare, compare_stats
    from precision_lab.records import TensorRecord

    x = np.linspace(-3.0, 3.0, 64, dtype=np.float32)
    # element-wise at seq 0 and 2 (warn), on summaries at 1 (warn) and 3 (error)
    cands = [(x * k).astype(np.float16) for k in (1.01, 1.02, 1.015, 3.0)]
    with store.new_session("mixed") as w:
        ref = w.add_run(name="fp32", dtype="float32", kind="reference")
        cand = w.add_run(name="fp16", dtype="float16", kind="candidate")
        for i, c in enumerate(cands):
            for run, arr in ((ref, x), (cand, c)):
                w.add_record(TensorRecord(run_id=run, seq=i, op=f"op{i}", op_type="Linear", role="output",
                                          index="0", stats=tensor_stats(arr)))
            by_stats = i % 2 == 1
            cmp = compare_stats(tensor_stats(x), tensor_stats(c)) if by_stats else compare(x, c)
            w.add_comparison(kind="stats" if by_stats else "accumulated", ref_run_id=ref, ref_rid=i,
                             cand_run_id=cand, cand_rid=i, step=0, rank=0, seq=i, op=f"op{i}", role="output",
                             index="0", match="exact", comparison=cmp)
    sid = store.session("mixed").session_id
    rows = store.df("SELECT seq, max_rel_err, summary_rel_err FROM comparisons ORDER BY seq")
    # the summaries moved more than any element-wise error: one number would put them first
    assert rows["summary_rel_err"][3] > rows["summary_rel_err"][1] > rows["max_rel_err"][2] > rows["max_rel_err"][0]
    assert rows["max_rel_err"][[1, 3]].isna().all() and rows["summary_rel_err"][[0, 2]].isna().all()
    want = [2, 0, 3, 1]  # element-wise, largest first; then on summaries, largest first
    for f in (views.OpsFilter(cand, sort="max_rel_err", descending=True),
              views.OpsFilter(cand, sort="max_rel_err", descending=True, roles=("output",))):
        assert list(ops.ops_page(store, f).rows["seq"]) == want
    asc = ops.ops_page(store, views.OpsFilter(cand, sort="max_rel_err")).rows
    assert list(asc["seq"]) == [0, 2, 1, 3]
    assert list(ops.ops_page(store, views.OpsFilter(cand, sort="summary_rel_err", descending=True)).rows["seq"]) \
        == [3, 1, 0, 2]
    # worst verdict first; among the warnings element-wise first (the errors of seq 0 and 2 within a factor 2
    # of each other: one error carried on, the first in order first), then on summaries
    top = views.top_offenders(store, sid, n=10)
    assert list(zip(top["verdict"], top["seq"])) == [("error", 3), ("warn", 0), ("warn", 2), ("warn", 1)]
    # severity still sorts by verdict, worst first
    rank = {"nonfinite": 3, "error": 2, "warn": 1}
    sev = ops.ops_page(store, views.OpsFilter(cand, sort="severity", descending=True)).rows
    ranks = [rank.get(v, 0) for v in sev["severity"]]
    assert ranks == sorted(ranks, reverse=True)


@pytest.mark.slow
def test_nrun_view_has_a_column_group_per_run(db, tmp_path):
    from precision_lab.services.ingest import ingest

    x = np.linspace(-3.0, 3.0, 30, dtype=np.float32)
    folders = {}
    for name, arr in (("base_fp32", x), ("try_fp16", x.astype(np.float16)),
                      ("fix_fp16", (x * 0.5).astype(np.float16))):
        d = tmp_path / name
        d.mkdir()
        np.save(d / "layer.output.0.npy", arr)
        folders[name] = d
    ingest([folders["try_fp16"], folders["fix_fp16"]], reference=[folders["base_fp32"]], session="three",
           store=db)
    sid, _ = _runs(db, "three")
    runs = session_runs(db, sid)
    assert len(runs) == 3
    page = diff.nrun_page(db, sid, [r.run_id for r in runs])
    assert page.rows.attrs["base_run"] == "base_fp32"
    row = page.rows.iloc[0]
    assert row["try_fp16: absmax"] == pytest.approx(float(np.abs(x.astype(np.float16)).max()))
    assert row["fix_fp16: absmax"] == pytest.approx(float(np.abs((x * 0.5).astype(np.float16)).max()))
    assert row["fix_fp16: max_rel_err"] > row["try_fp16: max_rel_err"]
    with pytest.raises(ValueError, match="at least one run"):
        diff.nrun_page(db, sid, [runs[0].run_id], base_run_id=runs[0].run_id)
    probs = diff.nrun_page(db, sid, [r.run_id for r in runs], show="problems")
    assert probs.total == 1 and probs.rows.iloc[0]["fix_fp16: verdict"] == "error"  # halved values
    by_name = {r.name: r.run_id for r in runs}
    assert diff.nrun_page(db, sid, [by_name["base_fp32"], by_name["try_fp16"]], show="problems").total == 0
    assert diff.nrun_page(db, sid, [r.run_id for r in runs], show="unmatched").total == 0

    # a run stored without comparisons is matched by name; its NaN shows as a problem
    from precision_lab.records import TensorRecord

    with db.extend_session("three") as w:
        extra = w.add_run(name="manual", dtype="float16", kind="rerun")
        bad = x.astype(np.float16)
        bad[3] = np.nan
        w.add_record(TensorRecord(extra, 0, "layer", "layer", "output", "0", tensor_stats(bad)))
        w.add_record(TensorRecord(extra, 1, "other", "other", "output", "0", tensor_stats(bad)))
    ids = [r.run_id for r in session_runs(db, sid)]
    page = diff.nrun_page(db, sid, ids)
    row = page.rows.iloc[0]
    assert row["manual: match"] == "name" and bool(row["manual: nonfinite"])
    assert diff.nrun_page(db, sid, [by_name["base_fp32"], extra], show="problems").total == 1
    base_id = by_name["base_fp32"]
    assert diff.nrun_page(db, sid, [base_id, extra], base_run_id=base_id, show="unmatched").total == 0
    assert diff.nrun_page(db, sid, [base_id, extra], base_run_id=extra, show="unmatched").total == 1


def test_escape_md_neutralises_markup():
    # the word joiner after the scheme keeps GFM from linking the bare URL
    assert escape_md("[x](http://evil)") == "\\[x\\]\\(http\\:\u2060//evil\\)"
    assert escape_md("<script>alert(1)</script>") == "\\<script\\>alert\\(1\\)\\</script\\>"
    assert escape_md("1. item") == "1\\. item" and escape_md("- item") == "\\- item"
    assert escape_md("a_b*c") == "a\\_b\\*c"


def test_histogram_axis_stays_near_the_data_and_names_limits_off_it():
    """fp16 data overlaid with bf16 and fp32: their 2^128 max and 2^-126..2^-149 limits would squash the
    histogram into a line; they are named at the axis edges instead, with their binade."""
    import numpy as np

    from precision_lab.stats import tensor_stats
    from precision_lab.ui.detail import histogram_figure

    x = np.random.default_rng(0).standard_normal(4000).astype(np.float16)
    fig = histogram_figure([("x", tensor_stats(x))], ["fp16", "bf16", "fp32"])
    lo, hi = fig.layout.xaxis.range
    assert hi < 40 and lo > -60  # not stretched to 2^128 / 2^-149
    assert lo <= -24 and hi >= 16  # fp16's own max (2^15.99) and smallest subnormal (2^-24) stay on the axis
    names = [a.text for a in fig.layout.annotations]
    assert "bf16 max 2^128 \u2192" in names and "fp32 max 2^128 \u2192" in names
    assert "\u2190 fp32 smallest subnormal 2^-149" in names
    assert not any(n.startswith("fp16") or "fp16 " in n for n in names)


def test_one_error_carried_on_ranks_where_it_first_appears_and_a_named_op_ranks_first(store):
    """Errors within a factor 2 of the largest of their verdict are one error carried on: the first in order
    ranks first, not the largest later op; a larger error apart from them ranks by its size; what a diagnosis
    names (by its place in the order) ranks ahead of all of them; an ``info`` diagnosis names nothing."""
    from precision_lab.metrics import compare
    from precision_lab.records import Diagnosis, TensorRecord

    x = np.linspace(0.5, 3.0, 64, dtype=np.float32)
    ks = (1.006, 1.008, 1.01, 1.0005)  # seq 0..3: 0 and 1 and 2 one error (within 2x), 3 far smaller
    with store.new_session("carried") as w:
        ref = w.add_run(name="fp32", dtype="float32", kind="reference")
        cand = w.add_run(name="fp16", dtype="float16", kind="candidate")
        for i, k in enumerate(ks):
            c = (x * k).astype(np.float16)
            for run, arr in ((ref, x), (cand, c)):
                w.add_record(TensorRecord(run_id=run, seq=i, op=f"op{i}", op_type="Linear", role="output",
                                          index="0", stats=tensor_stats(arr)))
            w.add_comparison(kind="accumulated", ref_run_id=ref, ref_rid=i, cand_run_id=cand, cand_rid=i, step=0,
                             rank=0, seq=i, op=f"op{i}", role="output", index="0", match="exact",
                             comparison=compare(x, c))
    sid = store.session("carried").session_id
    got = store.df("SELECT seq, verdict, rounding_units FROM comparisons ORDER BY seq")
    ru = list(got["rounding_units"])
    assert len(set(got["verdict"][:3])) == 1 and max(ru[:3]) < 2 * min(ru[:3]) and ru[2] > ru[1] > ru[0]
    top = views.top_offenders(store, sid, n=10)
    assert list(top["seq"])[:3] == [0, 1, 2]  # not 2 (the largest) first
    # a diagnosis naming op3's call (by seq, under its module's name) puts it first; an info one does not
    with store.extend_session("carried") as w:
        w.add_diagnosis(Diagnosis("", cand, "layer3", "precision-loss", "m", (), "warn", 3))
        w.add_diagnosis(Diagnosis("", cand, "op2", "fix-verified", "m", (), "info", 2))
    assert list(views.top_offenders(store, sid, n=10)["seq"]) == [3, 0, 1, 2]


def test_a_named_op_with_nothing_to_compare_with_is_the_first_row_when_non_finite_counts(store):
    """The op a diagnosis names holds NaN/inf but the reference has no record of it (a quantiser's own reciprocal):
    with non-finite rows asked for it is still the first row, of kind ``uncompared``, in Top offenders and in the
    report's table; without them it is left out like every non-finite row."""
    from precision_lab.metrics import compare
    from precision_lab.records import Diagnosis, TensorRecord
    from precision_lab.services.report import build_report, render_text

    x = np.linspace(0.5, 3.0, 16, dtype=np.float32)
    bad = x.copy()
    bad[3] = np.inf
    with store.new_session("lone") as w:
        ref = w.add_run(name="fp32", dtype="float32", kind="reference")
        cand = w.add_run(name="fp16", dtype="float16", kind="candidate")
        w.add_record(TensorRecord(run_id=cand, seq=0, op="q.reciprocal.0", op_type="reciprocal", role="output",
                                  index="0", stats=tensor_stats(bad.astype(np.float16))))
        for run, arr in ((ref, x), (cand, bad.astype(np.float16))):
            w.add_record(TensorRecord(run_id=run, seq=1, op="fc.linear.0", op_type="linear", role="output",
                                      index="0", stats=tensor_stats(arr)))
        w.add_comparison(kind="accumulated", ref_run_id=ref, ref_rid=0, cand_run_id=cand, cand_rid=1, step=0,
                         rank=0, seq=1, op="fc.linear.0", role="output", index="0", match="exact",
                         comparison=compare(x, bad.astype(np.float16)))
        w.add_diagnosis(Diagnosis("", cand, "q.reciprocal.0", "division", "1/0", (), "error", 0))
    sid = store.session("lone").session_id
    got = store.df("SELECT rid, op FROM tensors WHERE run_id = ? ORDER BY rid", [cand])
    assert list(zip(got["rid"], got["op"])) == [(0, "q.reciprocal.0"), (1, "fc.linear.0")]
    top = views.top_offenders(store, sid, n=5, include_nonfinite=True)
    assert list(zip(top["op"], top["kind"], top["verdict"])) == [("q.reciprocal.0", "uncompared", "nonfinite"),
                                                                ("fc.linear.0", "accumulated", "nonfinite")]
    assert views.top_offenders(store, sid, n=5).empty
    rep = build_report(store, "lone")
    assert [w.op for w in rep.worst_comparisons] == ["q.reciprocal.0", "fc.linear.0"]
    table = render_text(rep).split("Worst 2 comparisons:")[1].splitlines()
    assert table[3].split()[1] == "q.reciprocal.0" and "uncompared" in table[3]


def test_problems_only_leaves_out_what_was_written_on_purpose(store):
    """A healthy run whose mask holds -inf: "Problems only" shows none of its records; a failing run: its NaN
    records, not the mask that a NaN-free reading would have excused anyway."""
    from conftest import add_masked_softmax

    with store.new_session("probs") as w:
        runs = {}
        for name, out in (("healthy", [0.5, 1.0]), ("failing", [np.nan, 1.0])):
            runs[name] = w.add_run(name=name, dtype="float16", kind="candidate")
            add_masked_softmax(w, runs[name], out)

    def shown(run):
        failed, intended = ops.intended_nonfinite(store, runs[run])
        f = views.OpsFilter(runs[run], only_problems=True, intended=intended, failed=failed)
        return failed, intended, list(zip(ops.ops_page(store, f).rows["op"], ops.ops_page(store, f).rows["role"]))

    assert shown("healthy") == (False, ("attn.masked_fill.0",), [])
    failed, intended, rows = shown("failing")
    assert failed and ("attn.masked_fill.0", "output") not in rows and ("attn.softmax.0", "output") in rows
    # without the context every record holding NaN/Inf is listed, as before
    assert len(ops.ops_page(store, views.OpsFilter(runs["healthy"], only_problems=True)).rows) == 2
    # the Ops page's own call gives the run's context to "Problems only"
    assert ops.filtered_page(store, runs["healthy"], only_problems=True).total == 0
    got = ops.filtered_page(store, runs["failing"], only_problems=True, roles=("output",)).rows
    assert list(zip(got["op"], got["role"])) == [r for r in rows if r[1] == "output"]


def test_the_op_pickers_name_records_a_link_may_give(db):
    """``record_named`` takes a record id as a link or picker gives it (text) and refuses what names no record;
    ``op_choices`` labels each matching record once, the one asked for included."""
    _, runs = _runs(db, STAT_SESSION)
    run_id = runs["candidate"].run_id
    first = views.find_records(db, run_id, limit=3)
    rid = first[0].rid
    assert detail.record_named(db, run_id, f" {rid} ").name == first[0].name
    assert detail.record_named(db, run_id, "12abc") is None
    assert detail.record_named(db, run_id, 10 ** 9) is None
    last = views.find_records(db, run_id, limit=10 ** 6)[-1]
    choices = detail.op_choices(db, run_id, first[0].name, include_rid=last.rid)
    assert choices.options[0] == last.rid and rid in choices.options
    assert choices.label(rid) == f"{first[0].name}  (seq {first[0].seq})"
    assert detail.step_choices(db, run_id) == []  # a dump of one step: no step to choose
