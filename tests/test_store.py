"""The DuckDB store: schema from the records, atomic sessions, round trips."""

import dataclasses
import json
import math

import numpy as np
import pytest

from precision_lab.metrics import Comparison, compare
from precision_lab.records import Diagnosis, RunInfo, TensorRecord
from precision_lab.stats import TensorStats, tensor_stats
from precision_lab.store import SCHEMA_VERSION, SessionNotFound, Store, close_all, tensor_columns


def _rec(run_id, seq, op, arr, role="output"):
    return TensorRecord(run_id=run_id, seq=seq, op=op, op_type="linear", role=role, index="0",
                        stats=tensor_stats(arr))


def test_columns_derive_from_dataclasses():
    cols = {n for n, _ in tensor_columns()}
    for f in dataclasses.fields(TensorStats):
        if f.name != "hist":
            assert f.name in cols
    for f in dataclasses.fields(TensorRecord):
        if f.name not in ("stats", "tensor"):
            assert f.name in cols


def test_session_round_trip(store):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(1000) * 100).astype(np.float32)
    with store.new_session("s1", source="test") as w:
        run = w.add_run(name="fp32", dtype="float32", kind="reference")
        rid = w.add_record(_rec(run, 0, "fc1", a))
        w.add_diagnosis(Diagnosis(session_id="", run_id=run, op="fc1", rule="r", message="m", fixes=("use-bf16",)))
    info = store.session("s1")
    runs = store.runs(info.session_id)
    assert list(runs["name"]) == ["fp32"]
    st = store.record_stats(run, rid)
    exp = a.astype(np.float64)
    assert st.max == exp.max() and st.min == exp.min()
    assert st.l2norm == pytest.approx(np.sqrt(np.sum(exp * exp)), rel=1e-12)
    assert st.shape == (1000,)
    # histogram survives the sparse storage exactly
    assert np.array_equal(st.hist, tensor_stats(a).hist)
    assert st.representability("fp16") == tensor_stats(a).representability("fp16")
    d = store.df("SELECT fixes FROM diagnoses")
    assert json.loads(d["fixes"][0]) == ["use-bf16"]
    # read back once, as a tuple, wherever diagnoses are read
    from precision_lab.store import queries as q

    (row,) = q.session_diagnoses(store, store.df("SELECT session_id FROM diagnoses")["session_id"][0])
    assert row.fixes == ("use-bf16",)


def test_records_are_stored_as_they_were_added_however_the_caller_changes_them_after(store):
    rng = np.random.default_rng(1)
    arrays = [(rng.standard_normal(64) * 10.0 ** k).astype(np.float32) for k in range(-3, 4)]
    arrays[2][5] = np.inf
    with store.new_session("as-added") as w:
        run = w.add_run(name="r", dtype="float32", kind="reference")
        recs = [_rec(run, i, f"op{i}", a) for i, a in enumerate(arrays)]
        recs[3] = dataclasses.replace(recs[3], stats=dataclasses.replace(recs[3].stats, hist=None))
        rids = w.add_records(recs[:4]) + [w.add_record(r) for r in recs[4:]]
        for r in recs:  # an ingest drops a record's histogram and renames nothing, but a caller may rebind anything
            r.op, r.stats = "changed", dataclasses.replace(r.stats, hist=None, max=0.0)
    assert rids == list(range(len(arrays)))
    rows = store.df("SELECT rid, op, max, nonfinite, has_hist, shape FROM tensors ORDER BY rid")
    assert list(rows["op"]) == [f"op{i}" for i in range(len(arrays))]
    # independent: float64 numpy of each array (Max is the largest finite value)
    assert list(rows["max"]) == [float(np.max(a[np.isfinite(a)].astype(np.float64))) for a in arrays]
    assert list(rows["nonfinite"]) == [bool(not np.isfinite(a).all()) for a in arrays]
    assert list(rows["has_hist"]) == [i != 3 for i in range(len(arrays))]
    assert set(rows["shape"]) == {"[64]"}
    for i, a in enumerate(arrays):
        got = store.histogram(run, rids[i])
        if i == 3:
            assert got is None
        else:  # the sparse histogram decodes to the exact counts of |a| over the edges
            from precision_lab.stats import HIST_EDGES, N_BINS

            m = np.abs(a.astype(np.float64))
            m = m[np.isfinite(m) & (m > 0)]
            want = np.bincount(np.searchsorted(HIST_EDGES, m, side="right") - 1, minlength=N_BINS)
            assert np.array_equal(got, want)


def test_records_are_made_into_rows_in_bounded_batches(store, monkeypatch):
    from precision_lab.store.session_writer import SessionWriter

    monkeypatch.setattr(SessionWriter, "RECORD_BATCH", 3)  # two full batches plus a remainder
    arrays = [np.full(5, 2.0 ** i, np.float32) for i in range(7)]
    with store.new_session("batched") as w:
        run = w.add_run(name="r", dtype="float32", kind="reference")
        for i, a in enumerate(arrays):
            w.add_record(_rec(run, i, f"op{i}", a))
            # rows are made once 3 records wait, never more held back
            assert w.cur.execute("SELECT count(*) FROM tensors").fetchall()[0][0] == (i + 1) // 3 * 3
    rows = store.df("SELECT rid, max FROM tensors ORDER BY rid")
    assert list(rows["rid"]) == list(range(7)) and list(rows["max"]) == [2.0 ** i for i in range(7)]
    assert store.df("SELECT count(*) AS n FROM histograms")["n"][0] == 7


def test_stored_fixes_decode_to_a_tuple_whatever_was_written():
    from precision_lab.records import Diagnosis

    d = Diagnosis("s", "r", "op", "rule", "m", ("use-bf16", "scaling:row"))
    assert Diagnosis.decode_fixes(d.fixes_json()) == d.fixes
    assert Diagnosis.decode_fixes(None) == () and Diagnosis.decode_fixes("[]") == ()
    assert Diagnosis.decode_fixes("use-bf16") == ("use-bf16",)  # not JSON: one fix as written
    assert Diagnosis.decode_fixes('"use-bf16"') == ("use-bf16",)  # JSON, not a list


def test_failed_write_leaves_nothing(store):
    with pytest.raises(RuntimeError):
        with store.new_session("broken") as w:
            run = w.add_run(name="x")
            for i in range(30):
                w.add_record(_rec(run, i, f"op{i}", np.ones(4, np.float32)))
            w.flush()
            raise RuntimeError("reader failed halfway")
    for t in ("sessions", "runs", "tensors", "histograms"):
        assert store.df(f"SELECT count(*) AS n FROM {t}")["n"][0] == 0, t


def test_names_are_unique_and_rename_delete(store):
    for _ in range(2):
        with store.new_session("dup") as w:
            w.add_run(name="r")
    names = sorted(store.sessions()["name"])
    assert names == ["dup", "dup-2"]
    with pytest.raises(ValueError, match="already exists"):
        store.rename_session("dup-2", "dup")
    store.rename_session("dup-2", "other")
    store.delete_session("other")
    assert list(store.sessions()["name"]) == ["dup"]
    with pytest.raises(SessionNotFound, match="no session named 'nope'.*dup"):
        store.session("nope")


def test_comparison_columns_store_infinite_sqnr(store):
    ref = np.arange(10, dtype=np.float32)
    cmp = compare(ref, ref.copy())
    assert cmp.sqnr_db == math.inf
    with store.new_session("c") as w:
        r = w.add_run(name="ref", kind="reference")
        c = w.add_run(name="cand")
        w.add_comparison(kind="accumulated", ref_run_id=r, ref_rid=0, cand_run_id=c, cand_rid=0, step=0, rank=0,
                         seq=0, op="x", role="output", index="0", match="exact", comparison=cmp)
        w.add_comparison(kind="accumulated", ref_run_id=r, ref_rid=1, cand_run_id=c, cand_rid=None, step=0,
                         rank=0, seq=1, op="y", role="output", index="0", match="unmatched_ref", comparison=None)
    df = store.df("SELECT * FROM comparisons ORDER BY seq")
    assert df["sqnr_db"][0] == math.inf
    assert df["verdict"][1] is None or (isinstance(df["verdict"][1], float) and math.isnan(df["verdict"][1]))


def test_schema_version_and_reopen(tmp_path):
    p = tmp_path / "x.duckdb"
    s = Store(p)
    assert s.schema_version() == SCHEMA_VERSION
    with s.new_session("keep") as w:
        w.add_run(name="r")
    close_all()
    s2 = Store(p)
    assert list(s2.sessions()["name"]) == ["keep"]
    s2.sql("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    close_all()
    with pytest.raises(RuntimeError, match="schema version 999"):
        Store(p)
    close_all()


def test_default_path_honours_env(tmp_path, monkeypatch):
    from precision_lab.store import default_db_path

    monkeypatch.setenv("PRECISION_LAB_DB", str(tmp_path / "here.duckdb"))
    assert default_db_path() == tmp_path / "here.duckdb"
    monkeypatch.delenv("PRECISION_LAB_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_db_path() == tmp_path / "data" / "precision-lab" / "precision_lab.duckdb"


@pytest.mark.slow
def test_threads_get_their_own_cursor(store):
    import threading

    errors = []

    def work(i):
        try:
            with store.new_session(f"t{i}") as w:
                run = w.add_run(name="r")
                for j in range(20):
                    w.add_record(_rec(run, j, f"op{j}", np.full(8, i, np.float32)))
            store.df("SELECT count(*) FROM tensors")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors
    df = store.df("SELECT s.name, count(*) AS n, min(t.max) AS lo, max(t.max) AS hi FROM tensors t "
                  "JOIN runs r USING (run_id) JOIN sessions s USING (session_id) GROUP BY s.name ORDER BY s.name")
    assert len(df) == 8 and set(df["n"]) == {20}
    # no record was written under another thread's session
    assert all(df["lo"] == df["hi"])


def test_free_name_picks_the_first_unused_suffix():
    from precision_lab.records import free_name

    assert free_name("a", set()) == "a"
    assert free_name("a", {"a", "a-2", "a-4"}) == "a-3"
    assert free_name("fix: x", {"fix: x"}, "{base} ({i})") == "fix: x (2)"


def test_warnings_are_written_in_batches_within_the_transaction(store, monkeypatch):
    from precision_lab.store import SessionWriter

    monkeypatch.setattr(SessionWriter, "BATCH", 3)  # several full batches plus a remainder
    with store.new_session("warned") as w:
        rid = w.add_run(name="fp16", dtype="float16", kind="candidate")
        for i in range(7):
            w.add_warning(f"dump/f{i}.json", f"statistic Max is 'N/A' ({i})", run_id=rid if i % 2 else None)
        sid = w.session_id
    got = store.df("SELECT run_id, file, message FROM warnings WHERE session_id = ? ORDER BY file", [sid])
    assert list(got["file"]) == [f"dump/f{i}.json" for i in range(7)]
    assert list(got["message"]) == [f"statistic Max is 'N/A' ({i})" for i in range(7)]
    assert [r if isinstance(r, str) else None for r in got["run_id"]] == [rid if i % 2 else None for i in range(7)]

    with pytest.raises(RuntimeError):
        with store.new_session("failed") as w:
            w.add_warning("dump/x.json", "never stored")
            raise RuntimeError("boom")
    assert store.df("SELECT count(*) AS n FROM warnings WHERE message = 'never stored'")["n"][0] == 0


def test_one_switch_rule_for_settings():
    from precision_lab.config import ConfigError, load_config, parse_bool

    for text, want in [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("0", False), ("False", False),
                       ("no", False), ("off", False), ("", False)]:
        assert parse_bool(text) is want
    for bad in ("2", "enabled", "y"):
        with pytest.raises(ValueError):
            parse_bool(bad)
    assert load_config(env={"PRECISION_LAB_READ_ONLY": ""}).read_only is False
    assert load_config(env={"PRECISION_LAB_READ_ONLY": "On"}).read_only is True
    with pytest.raises(ConfigError):
        load_config(env={"PRECISION_LAB_READ_ONLY": "maybe"})


def test_server_defaults_are_the_limits_own_defaults():
    from precision_lab.config import ServerConfig
    from precision_lab.readers.safeio import ReadLimits
    from precision_lab.safezip import ZipLimits

    cfg = ServerConfig()
    assert ZipLimits.from_config(cfg) == ZipLimits()
    assert ReadLimits.from_config(cfg) == ReadLimits()
    assert (cfg.zip_max_total_mb << 20, cfg.max_tensor_mb << 20) == (ZipLimits().max_total_bytes,
                                                                      ReadLimits().max_tensor_bytes)


def test_a_version_1_database_gains_signed_inf_counts_and_parents(tmp_path):
    p = tmp_path / "old.duckdb"
    s = Store(p)
    with s.new_session("old") as w:
        rid = w.add_run(name="r")
        w.add_record(_rec(rid, 0, "a", np.array([1.0, -np.inf], np.float32)))
    s.sql('ALTER TABLE tensors DROP COLUMN "neg_inf_count"')
    s.sql('ALTER TABLE tensors DROP COLUMN "parent"')
    s.sql("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    close_all()
    s2 = Store(p)
    assert s2.schema_version() == SCHEMA_VERSION
    with s2.new_session("new") as w:
        rid2 = w.add_run(name="r")
        w.add_record(_rec(rid2, 0, "a", np.array([-np.inf, -np.inf, np.inf], np.float32)))
    got = s2.sql("SELECT s.name, t.inf_count, t.neg_inf_count FROM tensors t JOIN runs r USING (run_id) "
                 "JOIN sessions s USING (session_id) ORDER BY s.name").fetchall()
    assert got[0][0] == "new" and (got[0][1], got[0][2]) == (3, 2)
    assert got[1][0] == "old" and got[1][1] == 1 and (got[1][2] is None or math.isnan(got[1][2]))
    assert s2.sql("SELECT count(*) FROM tensors WHERE parent IS NULL").fetchone()[0] == 2
    close_all()


def test_a_version_4_database_moves_summary_errors_out_of_the_element_wise_columns(tmp_path):
    """Before schema 5 a statistics-only comparison kept its summaries' errors in max_abs_err/max_rel_err;
    the migration moves them to summary_abs_err/summary_rel_err and leaves element-wise rows alone."""
    from precision_lab.metrics import compare_stats
    from precision_lab.store import move_summary_errors_sql

    p = tmp_path / "v4.duckdb"
    s = Store(p)
    ref = np.linspace(-3.0, 3.0, 64).astype(np.float32)
    cand = (ref * 1.01).astype(np.float16)
    by_stats = compare_stats(tensor_stats(ref), tensor_stats(cand))
    by_tensor = compare(ref, cand)
    with s.new_session("old") as w:
        r = w.add_run(name="ref", kind="reference")
        c = w.add_run(name="cand")
        for seq, (kind, cmp) in enumerate((("stats", by_stats), ("accumulated", by_tensor))):
            w.add_comparison(kind=kind, ref_run_id=r, ref_rid=seq, cand_run_id=c, cand_rid=seq, step=0, rank=0,
                             seq=seq, op=f"op{seq}", role="output", index="0", match="exact", comparison=cmp)
        w.add_comparison(kind="stats", ref_run_id=r, ref_rid=None, cand_run_id=c, cand_rid=2, step=0, rank=0,
                         seq=2, op="op2", role="output", index="0", match="unmatched_cand", comparison=None)
    # the database as schema 4 wrote it: no summary columns, the summaries' errors in the element-wise ones
    s.sql("UPDATE comparisons SET max_abs_err = summary_abs_err, max_rel_err = summary_rel_err WHERE basis = 'stats'")
    s.sql('ALTER TABLE comparisons DROP COLUMN "summary_abs_err"')
    s.sql('ALTER TABLE comparisons DROP COLUMN "summary_rel_err"')
    s.sql("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    old = s.df("SELECT seq, max_abs_err, max_rel_err FROM comparisons WHERE seq = 0")
    assert old["max_rel_err"][0] == by_stats.summary_rel_err  # the old, mixed meaning
    close_all()

    s2 = Store(p)
    assert s2.schema_version() == SCHEMA_VERSION >= 5
    cols = "seq, basis, max_abs_err, max_rel_err, summary_abs_err, summary_rel_err, verdict, reason, sqnr_db"
    got = {row[0]: row for row in s2.sql(f"SELECT {cols} FROM comparisons ORDER BY seq").fetchall()}
    assert got[0][1:] == ("stats", None, None, by_stats.summary_abs_err, by_stats.summary_rel_err,
                          by_stats.verdict, by_stats.reason, None)
    assert got[1][1:] == ("tensor", by_tensor.max_abs_err, by_tensor.max_rel_err, None, None, by_tensor.verdict,
                          by_tensor.reason, by_tensor.sqnr_db)
    assert got[2][1:] == (None,) * 8  # an unmatched record has no comparison: nothing to move
    # moving twice changes nothing (a migration interrupted before the version was written runs again)
    s2.sql(move_summary_errors_sql())
    assert {row[0]: row for row in s2.sql(f"SELECT {cols} FROM comparisons ORDER BY seq").fetchall()} == got
    close_all()


def test_a_staged_session_gets_a_free_name_when_another_writer_takes_its_name_meanwhile(tmp_path):
    """A new session is written apart from the file and inserted at the end: a name taken in between is made
    unique (``w.name`` says which), or refused with nothing written when renaming is not allowed."""
    db = tmp_path / "n.duckdb"
    s, other = Store(db), Store(db, staged=False)
    with s.new_session("x", source="a") as w:
        w.add_run(name="r")
        with other.new_session("x", source="b") as w2:  # committed while the first is still being written
            w2.add_run(name="r")
    assert w2.name == "x" and w.name != "x"
    got = {r["name"]: r["source"] for r in s.sessions().to_dict("records")}
    assert got == {"x": "b", w.name: "a"}
    assert len(s.runs(s.session(w.name).session_id)) == 1
    with pytest.raises(ValueError, match="already exists"):
        with s.new_session("x", exist_ok_rename=False):
            raise AssertionError("a taken name is refused before the work")
    with pytest.raises(ValueError, match="already exists"):
        with s.new_session("y", exist_ok_rename=False) as w3:
            w3.add_run(name="r")
            with other.new_session("y"):
                pass
    assert sorted(s.sessions()["name"]) == sorted(["x", w.name, "y"])
    assert s.sql("SELECT count(*) FROM runs").fetchone()[0] == 2


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_session_staged_in_memory_is_written_whole_or_not_at_all(tmp_path, in_memory):
    """``stage_in_memory`` (a capture's records, in memory already) stages without any folder or file, and keeps
    the file's promise: a session appears whole, and one that fails while being written leaves nothing."""
    from precision_lab.scratch import scratch_root

    db = tmp_path / "m.duckdb"
    s = Store(db)
    folders = []
    with s.new_session("whole", stage_in_memory=in_memory) as w:
        run = w.add_run(name="r")
        folders = sorted(p.name for p in scratch_root().glob("stage-*"))
    assert bool(folders) != in_memory  # a file's staging folder exists during the write; memory's does not
    assert w.name == "whole" and list(s.runs(s.session("whole").session_id)["run_id"]) == [run]
    with pytest.raises(RuntimeError, match="cut off"):
        with s.new_session("broken", stage_in_memory=in_memory) as w:
            w.add_run(name="r")
            raise RuntimeError("cut off")
    assert list(s.sessions()["name"]) == ["whole"] and s.sql("SELECT count(*) FROM runs").fetchone()[0] == 1


def test_runs_made_in_the_same_second_are_listed_in_the_order_they_were_added(store):
    """``created`` is kept to the second: two re-runs made in it keep the order they were added in everywhere runs
    are listed (never their random ids' order), and the Diff cards list the later one first."""
    from precision_lab.store import views
    from precision_lab.store import queries as q
    from precision_lab.ui.diff import rerun_cards

    same = "2026-01-01 00:00:00"
    with store.new_session("s") as w:
        base = w.add_run(run_id="m-base", name="base", kind="candidate", created=same)
        w.add_run(run_id="z-first", name="first fix", kind="rerun", parent_run_id=base, fix="use-bf16", created=same)
    with store.extend_session("s") as w:  # a later transaction, the same second
        w.add_run(run_id="a-second", name="second fix", kind="rerun", parent_run_id=base, fix="keep-fp32:x",
                  created=same)
    sid = store.session("s").session_id
    added = ["base", "first fix", "second fix"]
    assert [r.name for r in q.session_runs(store, sid)] == added
    assert store.runs(sid).name.tolist() == added
    assert views.runs_table(store, sid).run.tolist() == added
    assert [r.name for r in views.all_runs(store) if r.session_id == sid] == added
    assert [c.run for c in rerun_cards(store, sid)] == ["second fix", "first fix"]  # newest first


def test_a_fixed_run_whose_nan_inf_are_all_intended_counts_none_on_its_card(store):
    """The before/after card counts forward records with NaN/Inf only in a run where they reach a failure: the
    fixed run still holds its mask's -inf (written on purpose, its output finite) and counts 0; the run before it,
    whose output is NaN, counts every one."""
    from conftest import add_masked_softmax
    from precision_lab.ui.diff import rerun_cards

    with store.new_session("masks") as w:
        base = w.add_run(name="fp16", dtype="float16", kind="candidate")
        fixed = w.add_run(name="fixed", dtype="float16", kind="rerun", parent_run_id=base, fix="stable-softmax")
        add_masked_softmax(w, base, [np.nan, 1.0])
        add_masked_softmax(w, fixed, [0.5, 1.0])
    card = rerun_cards(store, store.session("masks").session_id)[0]
    assert (card.nonfinite_before, card.nonfinite_after) == (3, 0)
    assert card.first_after is None and card.first_before is not None
