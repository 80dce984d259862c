"""Files someone else made: a database file handed over is opened as data, never as code; a file that is not a
database, or is cut short, is one sentence; names from files cannot drive the terminal."""

from __future__ import annotations

import sqlite3

import duckdb
import pytest
from typer.testing import CliRunner

from precision_lab.cli import app
from precision_lab.display import visible
from precision_lab.store import ForeignDatabase, Store

runner = CliRunner()


def _secret(tmp_path):
    p = tmp_path / "secret.txt"
    p.write_text("the-secret-content-42")
    return p


def _one_sentence(res, *needles):
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("code, held", [
    ("CREATE VIEW sessions AS SELECT content AS name FROM read_text('{secret}')", "views (sessions)"),
    ("CREATE MACRO leak() AS TABLE SELECT * FROM read_text('{secret}')", "macros (leak)"),
])
def test_a_database_holding_views_or_macros_is_refused_unread(tmp_path, code, held):
    secret = _secret(tmp_path)
    db = tmp_path / "given.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE meta (key VARCHAR, value VARCHAR); INSERT INTO meta VALUES ('schema_version', '7')")
    con.execute(code.format(secret=secret))
    con.close()
    with pytest.raises(ForeignDatabase, match="was not made by Precision Lab"):
        Store(db)
    for cmd in (["db", "--db", str(db)], ["report", "--db", str(db), "--session", "x"]):
        res = runner.invoke(app, cmd)
        line = _one_sentence(res, str(db), held)
        assert "the-secret-content-42" not in res.output, line


def test_another_programs_tables_are_refused(tmp_path):
    db = tmp_path / "other.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE customers (name VARCHAR)")
    con.close()
    _one_sentence(runner.invoke(app, ["db", "--db", str(db)]), "another program's tables (customers)")


def test_the_stores_own_connection_reads_no_other_file(tmp_path, store):
    secret = _secret(tmp_path)
    for q in (f"SELECT * FROM read_text('{secret}')", f"SELECT * FROM glob('{tmp_path}/*')",
              f"SELECT * FROM read_csv('{secret}')"):
        with pytest.raises(duckdb.Error, match="disabled by configuration"):
            store.sql(q).fetchall()
    with pytest.raises(duckdb.Error):
        store.sql("INSTALL sqlite").fetchall()


def test_a_sqlite_file_is_named_not_loaded(tmp_path):
    db = tmp_path / "given.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    _one_sentence(runner.invoke(app, ["db", "--db", str(db)]), "not a DuckDB database file (it is a SQLite database)")


def test_a_database_cut_short_is_one_sentence(tmp_path):
    db = tmp_path / "cut.duckdb"
    s = Store(db)
    with s.new_session("big") as w:  # enough rows to span several blocks
        from precision_lab.records import RunInfo

        w.add_run(RunInfo(session_id=w.session_id, run_id="r1", name="r", dtype="float16", kind="candidate",
                          parent_run_id=None, fix=None, policy=None, source="t", order="execution"))
        for i in range(3000):
            w.add_warning("w", "x" * 200 + str(i), run_id="r1")
    s.close()
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])
    for cmd in (["db", "--db", str(db)], ["report", "--db", str(db), "--session", "big"]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert "error: " in res.output


def test_names_from_files_cannot_drive_the_terminal(store):
    evil = "run\x1b]0;owned\x07\x1b[2J\u202e"
    with store.new_session(evil):
        pass
    res = runner.invoke(app, ["db", "--db", store.path])
    assert res.exit_code == 0 and "\x1b" not in res.output and "\x07" not in res.output
    assert "\u202e" not in res.output and visible(evil) in res.output
    assert visible("a\nb\tc") == "a\nb\tc"  # layout characters of a message stay


# ---- a run's order: the word is checked where it is read, and a stored word that names none still renders -----

def test_a_shard_manifest_giving_a_run_any_order_is_refused(tmp_path):
    import json

    import torch

    import precision_lab

    shards = tmp_path / "shards"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with precision_lab.capture(model, run="r", shard_dir=shards) as cap:
        cap.model(torch.randn(2, 4))
    m = json.loads((shards / "manifest.json").read_text())
    m["runs"][0]["order"] = "bogus\x1b[31m"
    (shards / "manifest.json").write_text(json.dumps(m))
    res = runner.invoke(app, ["ingest", str(shards), "--db", str(tmp_path / "x.duckdb")])
    line = _one_sentence(res, "manifest.json", "\"order\"", "not one of execution, data, mtime, name")
    assert "\x1b" not in line


def test_an_archive_giving_a_run_any_order_is_refused(store, tmp_path):
    import pyarrow as pa

    from precision_lab.services.share import ShareError, export_bytes, import_session
    from test_share import make_session, with_table

    make_session(store, "demo")
    archive = export_bytes(store, "demo")

    def bogus(t):
        i = t.column_names.index("order")
        return t.set_column(i, "order", pa.array(["bogus"] * t.num_rows, pa.string()))

    from precision_lab.store import SCHEMA_VERSION

    other_store = Store(tmp_path / "other.duckdb")
    with pytest.raises(ShareError, match="gives a run the order 'bogus'"):
        import_session(other_store, with_table(archive, "runs", bogus, SCHEMA_VERSION))
    assert other_store.df("SELECT * FROM sessions").empty


def test_a_stored_order_naming_none_still_lists_reports_and_deletes(store):
    from precision_lab.services.report import build_report, render_text
    from test_share import make_session

    make_session(store, "demo")
    store.sql("UPDATE runs SET \"order\" = 'bogus'").fetchall()  # what an older version could store
    rep = build_report(store, "demo")
    assert {r.order for r in rep.runs} == {"bogus"} and "order unknown" in render_text(rep)
    res = runner.invoke(app, ["db", "--db", store.path])
    assert res.exit_code == 0 and "demo" in res.output
    res = runner.invoke(app, ["delete", "--session", "demo", "--db", store.path])
    assert res.exit_code == 0 and "deleted session 'demo'" in res.output, res.output
    assert store.df("SELECT * FROM runs").empty and store.df("SELECT * FROM tensors").empty
    _one_sentence(runner.invoke(app, ["delete", "--session", "demo", "--db", store.path]), "no session named 'demo'")


@pytest.mark.parametrize("column, values", [("max", ["x", "y"]), ("nan_count", [0.5, 1.5]), ("op", [1, 2])])
def test_a_shard_column_of_another_type_is_refused_before_the_insert(tmp_path, column, values):
    import glob

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    import precision_lab

    shards = tmp_path / "shards"
    with precision_lab.capture(torch.nn.Sequential(torch.nn.Linear(4, 4)), run="r", shard_dir=shards) as cap:
        cap.model(torch.randn(2, 4))
    f = sorted(glob.glob(str(shards / "**" / "*.parquet"), recursive=True))[0]
    t = pq.read_table(f)
    t = t.set_column(t.column_names.index(column), column, pa.array((values * t.num_rows)[: t.num_rows]))
    pq.write_table(t, f)
    db = tmp_path / "x.duckdb"
    res = runner.invoke(app, ["ingest", str(shards), "--db", str(db)])
    _one_sentence(res, "step0.parquet", f"column {column} holds")
    assert Store(db).df("SELECT * FROM sessions").empty  # nothing half-stored


# ---- archives: bounded before a value is decoded, refusals of bounded length -----------------------------

def _archive_with(archive: bytes, table: str, t, rows: int, **write) -> bytes:
    """The archive with ``table`` replaced by ``t``, its manifest saying ``rows``."""
    from test_share import with_table

    return with_table(archive, table, lambda _: t, rows=rows, compression="zstd", **write)


def test_a_dictionary_encoded_bomb_is_refused_before_it_is_decoded(store, tmp_path):
    import resource
    import time

    import pyarrow as pa

    from precision_lab.services.share import ShareError, export_bytes, import_session
    from test_share import make_session

    make_session(store, "demo")
    archive = export_bytes(store, "demo")
    sid = store.session("demo").session_id
    run = store.df("SELECT run_id FROM runs LIMIT 1").run_id[0]
    n = 4000  # one 1 MiB message repeated: 4 GiB once decoded, a few KiB stored
    big = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["x" * (1 << 20)]))
    t = pa.table({"session_id": [sid] * n, "run_id": [run] * n, "file": ["f"] * n, "message": big})
    # written as any Parquet writer does, without Arrow's schema: the column reads back as plain strings
    bomb = _archive_with(archive, "warnings", t, n, store_schema=False)
    assert len(bomb) < 200_000
    other = Store(tmp_path / "other.duckdb")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(ShareError, match="compression bomb protection"):
        import_session(other, bomb)
    assert time.monotonic() - t0 < 30
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1024, grown_mib  # far from the 4 GiB it decodes to
    assert other.df("SELECT * FROM sessions").empty


def test_an_archive_with_thousands_of_unknown_columns_is_one_short_sentence(store, tmp_path):
    import pyarrow as pa

    from precision_lab.services.share import ShareError, export_bytes, import_session
    from test_share import make_session

    make_session(store, "demo")
    archive = export_bytes(store, "demo")
    sid = store.session("demo").session_id
    run = store.df("SELECT run_id FROM runs LIMIT 1").run_id[0]
    cols = {"session_id": [sid], "run_id": [run], "file": ["f"], "message": ["m"]}
    cols.update({f"junk_column_{i:05d}_" + "y" * 20: [1] for i in range(20_000)})
    bad = _archive_with(archive, "warnings", pa.table(cols), 1)
    with pytest.raises(ShareError) as e:
        import_session(Store(tmp_path / "other.duckdb"), bad)
    assert len(str(e.value)) < 400 and "warnings.parquet" in str(e.value), str(e.value)[:500]


# ---- a capture killed mid-run: its shards ingest, and the session says what is missing ---------------------

_KILLED = """
import os, sys, torch, precision_lab
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
with precision_lab.capture(m, run="train", shard_dir=sys.argv[1]) as cap:
    for step in range(5):
        m(torch.randn(3, 4)).sum().backward()
        if step == 2:
            os._exit(9)  # killed in step 2: steps 0 and 1 are written
        cap.step()
"""


@pytest.mark.slow
@pytest.mark.parametrize("manifest", ["as written", "lost"])
def test_a_killed_captures_shards_ingest_and_say_what_is_missing(tmp_path, manifest):
    import subprocess
    import sys

    from precision_lab.services.report import build_report

    shards = tmp_path / "shards"
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(shards)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr
    assert sorted(p.name for p in (shards / "train" / "rank0").iterdir()) == ["step0.parquet", "step1.parquet"]
    if manifest == "lost":
        (shards / "manifest.json").unlink()
    db = tmp_path / "k.duckdb"
    res = runner.invoke(app, ["ingest", str(shards), "--db", str(db)])
    assert res.exit_code == 0, res.output
    rep = build_report(Store(db), res.output.strip())
    assert sorted({t.step for t in rep.tensors}) == [0, 1]
    said = " ".join(w.message for w in rep.warnings)
    if manifest == "lost":
        assert "had no manifest.json (its capture was cut off): rebuilt from the shards" in said
    else:
        assert "rank 0 of run 'train' did not finish" in said and "the steps it wrote are read" in said


def test_a_timeline_file_of_other_types_is_refused_in_one_sentence(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    import precision_lab
    from precision_lab.live import CaptureOptions

    shards = tmp_path / "shards"
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with precision_lab.capture(m, run="r", shard_dir=shards, options=CaptureOptions(every=2)) as cap:
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward()
            cap.step()
    f = shards / "r" / "rank0" / "timeline.parquet"
    t = pq.read_table(f)
    t = t.set_column(t.column_names.index("absmax"), "absmax", pa.array(["big"] * t.num_rows))
    pq.write_table(t, f)
    db = tmp_path / "x.duckdb"
    _one_sentence(runner.invoke(app, ["ingest", str(shards), "--db", str(db)]), "timeline.parquet",
                  "column absmax holds string, not numbers")
    assert Store(db).df("SELECT * FROM sessions").empty


def test_a_database_replaced_by_a_foreign_one_is_checked_again(tmp_path):
    """A process skips the check for a file it already found clean, but not for another file put at its path."""
    from precision_lab.store import close_all

    db = tmp_path / "mine.duckdb"
    Store(db)  # made here: found clean
    Store(db)  # the same file: no second listing of its functions
    close_all()
    db.unlink()
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE meta (key VARCHAR, value VARCHAR); INSERT INTO meta VALUES ('schema_version', '7')")
    con.execute("CREATE MACRO leak() AS 42")
    con.close()
    with pytest.raises(ForeignDatabase, match="macros \\(leak\\)"):
        Store(db)
