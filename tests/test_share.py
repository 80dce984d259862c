"""Export / import of a session, share tokens, server config and access rules.

``make_session`` builds a small but complete session (reference, candidate and
re-run runs; histograms; kept tensors; comparisons; diagnoses; warnings) that
other test files reuse.
"""

import hashlib
import io
import json
from typing import Optional
import zipfile
from pathlib import Path

import numpy as np
import pytest

from precision_lab.metrics import compare
from precision_lab.records import StepScalar, TimelineRow, TimelineShare, Diagnosis, TensorRecord
from precision_lab.services.share import FORMAT_NAME, SHARED_SOURCE, TABLES, ShareError, export_bytes, export_session, import_session, read_manifest, share_url
from precision_lab.stats import tensor_stats

ROOT = Path(__file__).resolve().parents[1]

# table -> ORDER BY that makes a dump of it comparable across databases
_ORDER = {
    "sessions": "name",
    "runs": "run_id",
    "tensors": "run_id, rid",
    "histograms": "run_id, rid",
    "tensor_data": "run_id, rid",
    "comparisons": "cand_run_id, seq, op, role, \"index\"",
    "diagnoses": "run_id, seq, rule",
    "warnings": "file, message",
    "timeline": "run_id, tid",
    "timeline_formats": "run_id, tid, fmt",
    "step_scalars": "run_id, step, name",
}


def make_session(store, name="demo", *, seed=0, n_ops=6, op_prefix="blocks", keep=True, tag=0.0):
    """One session with three runs; returns {"ref", "cand", "rerun"} run ids and the arrays written.

    ``tag`` shifts every value so sessions written by different threads can
    be told apart by their statistics alone.
    """
    rng = np.random.default_rng(seed)
    arrays = {}
    with store.new_session(name, source=f"/dumps/{name}", notes={"seed": seed}) as w:
        ref = w.add_run(name="fp32", dtype="float32", kind="reference", source="ref")
        cand = w.add_run(name="fp16", dtype="float16", kind="candidate", source="cand")
        rerun = w.add_run(name="fp16+fix", dtype="float16", kind="rerun", parent_run_id=cand, fix="fp32_scale")
        for i in range(n_ops):
            op = f"{op_prefix}.{i}.fc"
            x = rng.standard_normal((4, 8)) * (10.0 ** (i - 2)) + tag
            if i == n_ops - 1:
                x[0, 0] = 1e6  # overflows fp16: a non-finite candidate output
            xr = x.astype(np.float32)
            xc = x.astype(np.float16)
            arrays[(op, "ref")], arrays[(op, "cand")] = xr, xc
            for run, arr in ((ref, xr), (cand, xc), (rerun, xc)):
                w.add_record(TensorRecord(run_id=run, seq=i, op=op, op_type="Linear", role="output", index="0",
                                          stats=tensor_stats(arr), source=f"{op}.npy",
                                          tensor=arr if keep else None))
            rid = i  # records are added in order, one per op per run
            w.add_comparison(kind="accumulated", ref_run_id=ref, ref_rid=rid, cand_run_id=cand, cand_rid=rid,
                             step=0, rank=0, seq=i, op=op, role="output", index="0", match="exact",
                             comparison=compare(xr, xc, cand_format="fp16"))
        w.add_comparison(kind="accumulated", ref_run_id=ref, ref_rid=None, cand_run_id=cand, cand_rid=None,
                         step=0, rank=0, seq=99, op="only.in.ref", role="output", index="0",
                         match="unmatched_ref", comparison=None)
        w.add_diagnosis(Diagnosis(session_id="", run_id=cand, op=f"{op_prefix}.{n_ops - 1}.fc", rule="overflow",
                                  message="output exceeds fp16 max", fixes=("bf16", "fp32_island"), seq=n_ops - 1))
        w.add_warning("extra.txt", "not a tensor file; skipped", run_id=cand)
        w.add_warning("notes.md", "session-level warning")
        # a long run's timeline: two steps of one op, its shares in one format, and the loss
        w.add_timeline(
            [TimelineRow(run_id=cand, tid=t, step=t, rank=0, seq=0, op="blocks.0.fc.forward.0", op_type="Linear",
                         role="output", index="0", direction="forward", dtype="float16", numel=32, nan_count=0,
                         inf_count=t, neg_inf_count=0, zero_count=0, absmax=1e3 * (t + 1), min_abs_nonzero=1e-3,
                         l2norm=5.0, location="model.py:3 in forward") for t in range(2)],
            [TimelineShare(run_id=cand, tid=t, fmt="float8_e4m3fn", finite=32 - t, overflow=t + 1, underflow=0,
                           subnormal=2) for t in range(2)],
            [StepScalar(run_id=cand, step=t, rank=0, name="loss", value=1.5 - t) for t in range(2)])
    return {"ref": ref, "cand": cand, "rerun": rerun, "arrays": arrays, "session": w.name}


def dump_tables(store, session_id):
    """Every row of the session, table by table, as plain Python values."""
    out = {}
    runs_of = "(SELECT run_id FROM runs WHERE session_id = ?)"
    for t in TABLES:
        where = "session_id = ?" if t in ("sessions", "runs", "comparisons", "diagnoses", "warnings") \
            else f"run_id IN {runs_of}"
        cur = store.sql(f"SELECT * FROM {t} WHERE {where} ORDER BY {_ORDER[t]}", [session_id])
        cols = [d[0] for d in cur.description]
        out[t] = [dict(zip(cols, r)) for r in cur.fetchall()]
    return out


def _as_exported(runs):
    """Imported runs read ``shared archive: <source>`` (replay never reads those folders); the rest as exported."""
    out = []
    for r in runs:
        if r["source"] is not None:
            assert r["source"].startswith(SHARED_SOURCE), r["source"]
            r = {**r, "source": r["source"][len(SHARED_SOURCE):]}
        out.append(r)
    return out


def _shared(tables_or_report):
    """What an export carries of a session: every source (and a session's recipe) without the sharer's paths."""
    from precision_lab.public import public_source

    d = dict(tables_or_report)
    if "runs" in d:
        d["runs"] = [{**r, "source": None if r["source"] is None else public_source(r["source"])} for r in d["runs"]]
    if isinstance(d.get("source"), str):
        d["source"] = public_source(d["source"])
    if "sessions" in d:
        d["sessions"] = [{**r, **{k: public_source(r[k]) for k in ("source", "recipe") if r.get(k) is not None}}
                         for r in d["sessions"]]
    return d


def _same(a, b):
    """Row lists equal, NaN equal to NaN."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            x, y = ra[k], rb[k]
            if isinstance(x, float) and isinstance(y, float) and np.isnan(x) and np.isnan(y):
                continue
            assert x == y, (k, x, y)


@pytest.fixture
def other_store(tmp_path):
    from precision_lab.store import Store

    return Store(tmp_path / "other.duckdb")


# ---- round trip ------------------------------------------------------------------

@pytest.mark.slow
def test_round_trip_into_empty_database_keeps_every_row(store, other_store, tmp_path):
    made = make_session(store, "demo")
    sid = store.session("demo").session_id
    res = export_session(store, "demo", tmp_path / "demo.zip")
    assert res.rows["tensors"] == 18 and res.rows["runs"] == 3 and res.rows["comparisons"] == 7

    imp = import_session(other_store, tmp_path / "demo.zip")
    assert imp.session == "demo" and not imp.renamed and not imp.new_ids
    assert imp.session_id == sid  # the ids were free, so they were kept
    a, b = _shared(dump_tables(store, sid)), dump_tables(other_store, sid)
    b["runs"] = _as_exported(b["runs"])
    for t in TABLES:
        _same(a[t], b[t])
    # histograms and kept tensors come back bit for bit, checked against the arrays written
    for i in range(6):
        op = f"blocks.{i}.fc"
        for run, key in ((made["cand"], "cand"), (made["ref"], "ref")):
            got = other_store.tensor(run, i)
            want = made["arrays"][(op, key)]
            assert got.dtype == want.dtype and np.array_equal(got, want)
            h = other_store.histogram(run, i)
            assert np.array_equal(h, tensor_stats(want).hist)


@pytest.mark.slow
def test_round_trip_report_json_identical(store, other_store, tmp_path):
    from precision_lab.services.report import build_report, to_json

    make_session(store, "demo")
    export_session(store, "demo", tmp_path / "demo.zip")
    import_session(other_store, tmp_path / "demo.zip")
    before = _shared(json.loads(to_json(build_report(store, "demo"))))
    after = json.loads(to_json(build_report(other_store, "demo")))
    after["runs"] = _as_exported(after["runs"])
    assert before == after
    assert before["first_nonfinite"]["fp16"]["op"] == "blocks.5.fc"  # the report is not empty


@pytest.mark.slow
def test_round_trip_of_real_msprobe_ingest(store, other_store, tmp_path):
    from conftest import SAMPLES
    from precision_lab.services.report import build_report, to_json
    from precision_lab.services.ingest import ingest

    name = ingest(SAMPLES / "stat_mix_fp16_inner_ovf", reference=SAMPLES / "stat_mix_fp32_inner_ovf", store=store)
    export_session(store, name, tmp_path / "s.zip")
    imp = import_session(other_store, tmp_path / "s.zip")
    a = _shared(json.loads(to_json(build_report(store, name))))
    b = json.loads(to_json(build_report(other_store, imp.session)))
    b["runs"] = _as_exported(b["runs"])
    assert a == b and len(a["tensors"]) > 100


def test_export_is_deterministic_and_manifest_is_true(store, tmp_path):
    make_session(store, "demo")
    b1, b2 = export_bytes(store, "demo"), export_bytes(store, "demo")
    assert b1 == b2
    import pyarrow.parquet as pq

    with zipfile.ZipFile(io.BytesIO(b1)) as zf:
        m = json.loads(zf.read("manifest.json"))
        assert m["format"] == FORMAT_NAME and m["format_version"] == 1
        assert sorted(zf.namelist()) == sorted(["manifest.json"] + [f"{t}.parquet" for t in TABLES])
        sid = m["session"]["session_id"]
        counts = {
            "sessions": 1,
            "runs": store.sql("SELECT count(*) FROM runs WHERE session_id=?", [sid]).fetchone()[0],
            "tensors": 18, "histograms": 18, "tensor_data": 18, "comparisons": 7, "diagnoses": 1, "warnings": 2,
                "timeline": 2, "timeline_formats": 2, "step_scalars": 2,
        }
        for t in TABLES:
            raw = zf.read(f"{t}.parquet")
            assert m["tables"][t]["sha256"] == hashlib.sha256(raw).hexdigest()
            assert m["tables"][t]["rows"] == counts[t] == pq.read_table(io.BytesIO(raw)).num_rows
    (tmp_path / "d.zip").write_bytes(b1)
    assert read_manifest(tmp_path / "d.zip")["session"]["name"] == "demo"


def test_stats_only_session_round_trips(store, other_store, tmp_path):
    from precision_lab.stats import TensorStats

    with store.new_session("stats") as w:
        r = w.add_run(name="fp16", dtype="float16")
        w.add_record(TensorRecord(run_id=r, seq=0, op="a", op_type="Linear", role="output", index="0",
                                  stats=TensorStats.summary_only(dtype="float16", shape=(2, 3), min=-1.0, max=2.0,
                                                                 mean=0.5, l2norm=float("inf"))))
    export_session(store, "stats", tmp_path / "s.zip")
    import_session(other_store, tmp_path / "s.zip")
    run_id = other_store.runs(other_store.session("stats").session_id).iloc[0]["run_id"]
    s = other_store.record_stats(run_id, 0)
    assert s.hist is None and s.nan_count is None and s.max == 2.0 and s.l2norm == float("inf")
    assert other_store.histogram(run_id, 0) is None and other_store.tensor(run_id, 0) is None


def with_table(archive: bytes, table: str, change, schema_version: Optional[int] = None, *,
               rows: Optional[int] = None, **write) -> bytes:
    """The archive with ``table`` replaced by ``change(table)`` (Arrow, written with ``write``) and the manifest
    saying ``schema_version`` and ``rows`` where given; the manifest's checksums made true again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = zipfile.ZipFile(io.BytesIO(archive))
    m = json.loads(src.read("manifest.json"))
    buf = pa.BufferOutputStream()
    pq.write_table(change(pq.read_table(io.BytesIO(src.read(f"{table}.parquet")))), buf, **write)
    data = buf.getvalue().to_pybytes()
    if schema_version is not None:
        m["schema_version"] = schema_version
    m["tables"][table].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    if rows is not None:
        m["tables"][table]["rows"] = rows
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename == "manifest.json":
                dst.writestr(info.filename, json.dumps(m))
            else:
                dst.writestr(info.filename, data if info.filename == f"{table}.parquet" else src.read(info))
    return out.getvalue()


def _as_schema_4(archive: bytes) -> bytes:
    """The archive as schema 4 wrote it: comparisons without the summary columns, a statistics-only
    comparison's summary errors in max_abs_err/max_rel_err."""
    import pyarrow.compute as pc

    def old_columns(t):
        stats = pc.fill_null(pc.equal(t.column("basis"), "stats"), False)
        for kind in ("abs", "rel"):
            i = t.column_names.index(f"max_{kind}_err")
            t = t.set_column(i, f"max_{kind}_err", pc.if_else(stats, t.column(f"summary_{kind}_err"), t.column(i)))
        return t.drop_columns(["summary_abs_err", "summary_rel_err"])

    return with_table(archive, "comparisons", old_columns, 4)


def test_a_schema_4_archive_imports_with_its_summary_errors_moved(store, other_store):
    """An archive written at schema 4 kept a statistics-only comparison's errors in max_abs_err/max_rel_err:
    imported, they land in summary_abs_err/summary_rel_err; element-wise comparisons keep theirs."""
    from precision_lab.metrics import compare_stats

    make_session(store, "demo")
    cand, ref = (store.runs(store.session("demo").session_id).set_index("name").loc[n, "run_id"]
                 for n in ("fp16", "fp32"))
    x = np.linspace(-3.0, 3.0, 64)
    by_stats = compare_stats(tensor_stats(x.astype(np.float32)), tensor_stats((x * 1.01).astype(np.float16)))
    with store.extend_session("demo") as w:
        w.add_comparison(kind="stats", ref_run_id=ref, ref_rid=0, cand_run_id=cand, cand_rid=0, step=0, rank=0,
                         seq=50, op="by.summary", role="output", index="0", match="aligned", comparison=by_stats)
    sid = store.session("demo").session_id
    v4 = _as_schema_4(export_bytes(store, "demo"))
    assert json.loads(zipfile.ZipFile(io.BytesIO(v4)).read("manifest.json"))["schema_version"] == 4
    res = import_session(other_store, v4, filename="old.zip")
    assert res.session == "demo"
    cols = "op, basis, max_abs_err, max_rel_err, summary_abs_err, summary_rel_err, verdict"
    q = f"SELECT {cols} FROM comparisons WHERE session_id = ? ORDER BY seq, op"
    got, before = other_store.sql(q, [res.session_id]).fetchall(), store.sql(q, [sid]).fetchall()
    moved = [r for r in got if r[1] == "stats"]
    assert moved == [("by.summary", "stats", None, None, by_stats.summary_abs_err, by_stats.summary_rel_err,
                      by_stats.verdict)]
    # every other row as exported: element-wise errors stay, no summary error appears
    assert [r for r in got if r[1] != "stats"] == [r for r in before if r[1] != "stats"]
    assert all(r[4] is None and r[5] is None and (r[1] is None or r[3] is not None) for r in got if r[1] != "stats")


# ---- never overwrite ----------------------------------------------------------------

@pytest.mark.slow
def test_import_into_same_database_renames_and_gives_fresh_ids(store, tmp_path):
    made = make_session(store, "demo")
    before = dump_tables(store, store.session("demo").session_id)
    export_session(store, "demo", tmp_path / "demo.zip")
    res = import_session(store, tmp_path / "demo.zip")
    assert res.session == "demo-2" and res.renamed and res.new_ids
    assert "already exists" in res.message and "'demo-2'" in res.message
    # the original is untouched
    after = dump_tables(store, store.session("demo").session_id)
    for t in TABLES:
        _same(before[t], after[t])
    # the copy has its own ids and the same data
    new = dump_tables(store, res.session_id)
    assert res.session_id != store.session("demo").session_id
    assert not {r["run_id"] for r in new["runs"]} & {made["ref"], made["cand"], made["rerun"]}
    assert len(new["tensors"]) == 18 and len(new["comparisons"]) == 7
    # the parent link and comparison run ids follow the new ids
    runs = {r["name"]: r for r in new["runs"]}
    assert runs["fp16+fix"]["parent_run_id"] == runs["fp16"]["run_id"]
    assert {c["cand_run_id"] for c in new["comparisons"]} == {runs["fp16"]["run_id"]}
    t = store.tensor(runs["fp16"]["run_id"], 2)
    assert np.array_equal(t, made["arrays"][("blocks.2.fc", "cand")])
    # a third import gets -3
    assert import_session(store, tmp_path / "demo.zip").session == "demo-3"


@pytest.mark.slow
def test_import_as_name_and_name_clash(store, tmp_path):
    make_session(store, "demo")
    export_session(store, "demo", tmp_path / "demo.zip")
    assert import_session(store, tmp_path / "demo.zip", name="review").session == "review"
    res = import_session(store, tmp_path / "demo.zip", name="review")
    assert res.session == "review-2" and "'review'" in res.message
    with pytest.raises(ShareError, match="cannot be empty"):
        import_session(store, tmp_path / "demo.zip", name="   ")


def test_import_from_bytes_names_the_upload(store, other_store):
    make_session(store, "demo")
    data = export_bytes(store, "demo")
    assert import_session(other_store, data, filename="demo.zip").session == "demo"
    with pytest.raises(ShareError) as ei:
        import_session(other_store, data[:200], filename="upload-42.zip")
    assert "upload-42.zip" in str(ei.value) and "/tmp" not in str(ei.value)


def test_share_token_is_not_exported(store, other_store, tmp_path):
    from precision_lab.services.share import create_share_token

    make_session(store, "demo")
    token = create_share_token(store, "demo")
    export_session(store, "demo", tmp_path / "demo.zip")
    import_session(other_store, tmp_path / "demo.zip")
    assert other_store.session_by_token(token) is None


def test_export_unknown_session(store, tmp_path):
    from precision_lab.store import SessionNotFound

    make_session(store, "demo")
    with pytest.raises(SessionNotFound, match="no session named 'nope'.*demo"):
        export_session(store, "nope", tmp_path / "x.zip")
    assert not (tmp_path / "x.zip").exists()


# ---- share tokens and URLs ---------------------------------------------------------

def test_share_tokens_are_random_and_revocable(store):
    from precision_lab.services.share import create_share_token, revoke_share_token

    make_session(store, "demo")
    t1 = create_share_token(store, "demo")
    t2 = create_share_token(store, "demo")
    assert t1 != t2 and len(t1) >= 22  # 16 random bytes in url-safe base64
    assert store.session_by_token(t1) is None  # replaced
    assert store.session_by_token(t2).name == "demo"
    revoke_share_token(store, "demo")
    assert store.session_by_token(t2) is None


def test_share_url_keeps_other_parameters():
    assert share_url("https://lab.example.org/ops?page=ops&session=x", "T0k") == \
        "https://lab.example.org/ops?page=ops&share=T0k"
    assert share_url("http://localhost:8501", "abc") == "http://localhost:8501/?share=abc"


# ---- config ----------------------------------------------------------------------

def test_config_defaults_env_and_toml_precedence(tmp_path):
    from precision_lab.config import ServerConfig, load_config

    cfg = load_config(env={})
    assert cfg == ServerConfig() and not cfg.read_only and cfg.can_list_sessions
    toml = tmp_path / "pl.toml"
    toml.write_text('[server]\nread_only = true\nmax_upload_mb = 64\ndb_path = "~/x.duckdb"\n')
    cfg = load_config(toml, env={})
    assert cfg.read_only and cfg.max_upload_mb == 64 and cfg.max_upload_bytes == 64 * 1024 * 1024
    assert cfg.db_path == str(Path("~/x.duckdb").expanduser())
    assert not cfg.can_list_sessions  # read-only servers hide the list unless asked
    # environment beats the file
    cfg = load_config(env={"PRECISION_LAB_CONFIG": str(toml), "PRECISION_LAB_READ_ONLY": "no",
                           "PRECISION_LAB_MAX_UPLOAD_MB": "5", "PRECISION_LAB_LIST_SESSIONS": "off"})
    assert not cfg.read_only and cfg.max_upload_mb == 5 and not cfg.can_list_sessions
    assert str(toml) in cfg.source and "PRECISION_LAB_MAX_UPLOAD_MB" in cfg.source


@pytest.mark.parametrize("env, words", [
    ({"PRECISION_LAB_READ_ONLY": "maybe"}, ["PRECISION_LAB_READ_ONLY", "true or false", "'maybe'"]),
    ({"PRECISION_LAB_MAX_UPLOAD_MB": "ten"}, ["PRECISION_LAB_MAX_UPLOAD_MB", "integer", "'ten'"]),
    ({"PRECISION_LAB_MAX_UPLOAD_MB": "0"}, ["max_upload_mb", "positive"]),
    ({"PRECISION_LAB_ZIP_MAX_RATIO": "1"}, ["zip_max_ratio", "above 1"]),
    ({"PRECISION_LAB_CONFIG": "/nonexistent/pl.toml"}, ["/nonexistent/pl.toml", "does not exist"]),
])
def test_config_errors_name_the_source(env, words):
    from precision_lab.config import ConfigError, load_config

    with pytest.raises(ConfigError) as ei:
        load_config(env=env)
    for w in words:
        assert w in str(ei.value)


def test_config_file_errors(tmp_path):
    from precision_lab.config import ConfigError, load_config

    bad = tmp_path / "bad.toml"
    bad.write_text("read_only = [\n")
    with pytest.raises(ConfigError, match="bad.toml.*not valid TOML"):
        load_config(bad, env={})
    typo = tmp_path / "typo.toml"
    typo.write_text("readonly = true\n")
    with pytest.raises(ConfigError, match="typo.toml.*unknown setting.*readonly"):
        load_config(typo, env={})


def test_every_setting_is_documented():
    from precision_lab.config import SETTINGS, ServerConfig

    doc = (ROOT / "docs" / "sharing.md").read_text()
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ServerConfig)} - {"source"}
    assert fields == {s.name for s in SETTINGS}
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    for s in SETTINGS:
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{s.name}` | `{s.env}` |")), None)
        assert row is not None, s.name
        d = defaults[s.name]
        if isinstance(d, bool):
            assert f"`{str(d).lower()}`" in row
        elif isinstance(d, (int, float)):
            assert f"`{d:g}`" in row, (s.name, row)


def test_zip_limits_follow_config():
    from precision_lab.config import ServerConfig

    lim = ServerConfig(zip_max_files=7, zip_max_total_mb=3, zip_max_ratio=50.0).zip_limits()
    assert (lim.max_files, lim.max_total_bytes, lim.max_ratio) == (7, 3 * 1024 * 1024, 50.0)


def test_import_respects_configured_limits(store, other_store, tmp_path):
    from precision_lab.config import ServerConfig

    make_session(store, "demo")
    export_session(store, "demo", tmp_path / "demo.zip")
    with pytest.raises(ShareError, match=f"demo.zip.*{len(TABLES) + 1} entries exceed the limit of 5"):
        import_session(other_store, tmp_path / "demo.zip", config=ServerConfig(zip_max_files=5))
    size = (tmp_path / "demo.zip").stat().st_size
    assert size < 1024 * 1024
    assert import_session(other_store, tmp_path / "demo.zip", config=ServerConfig(max_upload_mb=1)).session == "demo"


# ---- access --------------------------------------------------------------------------

def test_resolve_access(store):
    from precision_lab.config import ServerConfig, resolve_access
    from precision_lab.services.share import create_share_token

    make_session(store, "demo")
    make_session(store, "other", seed=1)
    token = create_share_token(store, "demo")
    open_cfg, ro_cfg = ServerConfig(), ServerConfig(read_only=True)

    a = resolve_access({"share": token}, store, open_cfg)
    assert (a.session, a.read_only, a.can_upload, a.can_delete, a.can_rerun, a.can_list, a.shared) == \
        ("demo", True, False, False, False, False, True)
    # the token wins over a session named in the URL
    assert resolve_access({"share": token, "session": "other"}, store, open_cfg).session == "demo"
    bad = resolve_access({"share": "not-a-token"}, store, open_cfg)
    assert bad.session is None and bad.error and "not valid" in bad.error and not bad.can_list

    a = resolve_access({"session": "other"}, store, open_cfg)
    assert a.session == "other" and a.can_upload and a.can_delete and a.can_rerun and a.can_list
    assert resolve_access({"session": "missing"}, store, open_cfg).session is None
    a = resolve_access({}, store, ro_cfg)
    assert a.read_only and not (a.can_upload or a.can_delete or a.can_rerun or a.can_list)
    # a read-only server hides names: ?session= does not open a session without the token
    assert resolve_access({"session": "other"}, store, ro_cfg).session is None
    a = resolve_access({"session": "other"}, store, ServerConfig(read_only=True, list_sessions=True))
    assert a.session == "other" and a.read_only and a.can_list
    # a revoked token stops working at once
    from precision_lab.services.share import revoke_share_token

    revoke_share_token(store, "demo")
    assert resolve_access({"share": token}, store, open_cfg).error


# ---- CLI ------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_export_import_share_link(store, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from precision_lab.cli import app

    make_session(store, "demo")
    db, other = store.path, str(tmp_path / "cli-other.duckdb")
    r = CliRunner()
    out = r.invoke(app, ["export", "--session", "demo", "-o", str(tmp_path / "e.zip"), "--db", db])
    assert out.exit_code == 0, out.output
    assert "exported session 'demo'" in out.output and "18 tensor records" in out.output
    out = r.invoke(app, ["import", str(tmp_path / "e.zip"), "--db", other])
    assert out.exit_code == 0 and "imported session 'demo'" in out.output
    out = r.invoke(app, ["import", str(tmp_path / "e.zip"), "--db", other, "--as", "demo"])
    assert out.exit_code == 0 and "imported as 'demo-2'" in out.output
    out = r.invoke(app, ["export", "--session", "nope", "-o", str(tmp_path / "n.zip"), "--db", db])
    # 2 = unusable input, as for every other command (README, "Command line")
    assert out.exit_code == 2 and "no session named 'nope'" in out.output
    (tmp_path / "a-file").write_text("")
    out = r.invoke(app, ["export", "--session", "demo", "-o", str(tmp_path / "a-file" / "e.zip"), "--db", db])
    assert out.exit_code == 2 and "a-file" in out.output and "cannot write the export" in out.output
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    out = r.invoke(app, ["import", str(tmp_path / "junk.zip"), "--db", other])
    assert out.exit_code == 2 and "junk.zip" in out.output and "not a readable zip" in out.output
    out = r.invoke(app, ["share-link", "--session", "demo", "--db", db, "--base-url", "https://lab.example.org/"])
    assert out.exit_code == 0
    token = out.output.strip().split("share=")[1]
    assert store.session_by_token(token).name == "demo"
    out = r.invoke(app, ["share-link", "--session", "demo", "--db", db, "--revoke"])
    assert out.exit_code == 0 and store.session_by_token(token) is None
    out = r.invoke(app, ["share-link", "--session", "nope", "--db", db])
    assert out.exit_code == 2 and "no session named 'nope'" in out.output
    out = r.invoke(app, ["config", "--config", str(tmp_path / "missing.toml")])
    assert out.exit_code == 2 and "missing.toml" in out.output
    # a read-only server is read-only for browsers; its operator still adds sessions from the shell
    monkeypatch.setenv("PRECISION_LAB_READ_ONLY", "1")
    out = r.invoke(app, ["import", str(tmp_path / "e.zip"), "--db", other, "--as", "ops-added"])
    assert out.exit_code == 0 and "imported session 'ops-added'" in out.output
    out = r.invoke(app, ["config"])
    assert out.exit_code == 0 and "read_only" in out.output and "True" in out.output


# ---- the dashboard: import, export, share links, read-only server ---------------------------

@pytest.fixture
def app_db(tmp_path, monkeypatch):
    """A database with two sessions, used by the app under test."""
    import streamlit as st

    from precision_lab.store import Store, close_all

    db = tmp_path / "app.duckdb"
    s = Store(db)
    make_session(s, "demo")
    make_session(s, "private", seed=1)
    close_all()
    for var in ("PRECISION_LAB_CONFIG", "PRECISION_LAB_READ_ONLY", "PRECISION_LAB_LIST_SESSIONS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PRECISION_LAB_DB", str(db))
    st.cache_resource.clear()
    yield db
    st.cache_resource.clear()
    close_all()


def _app(**query):
    from ui_fixtures import app_test

    at = app_test(**query)
    at.run()
    return at


def test_dashboard_import_says_when_it_renamed(app_db, tmp_path):
    from precision_lab.store import Store
    from ui_fixtures import assert_clean

    data = export_bytes(Store(app_db), "demo")
    at = _app()
    at.file_uploader(key="import_zip").set_value(("demo.zip", data, "application/zip")).run()
    at.button(key="import_session").click().run()
    assert_clean(at)
    from precision_lab.ui.common import escape_md

    msg = at.success[0].value
    assert escape_md("a session named 'demo' already exists, so it was imported as 'demo-2'") in msg
    assert "demo-2" in set(Store(app_db).sessions()["name"])


@pytest.mark.slow
def test_dashboard_import_refuses_a_bad_file(app_db):
    from precision_lab.store import Store
    from conftest import snapshot
    from ui_fixtures import assert_clean

    before = snapshot(Store(app_db))
    at = _app()
    at.file_uploader(key="import_zip").set_value(("broken.zip", b"PK\x03\x04garbage", "application/zip")).run()
    at.button(key="import_session").click().run()
    assert_clean(at)
    assert "broken.zip" in at.error[0].value and "not a readable zip archive" in at.error[0].value
    assert snapshot(Store(app_db)) == before


@pytest.mark.slow
def test_dashboard_share_link_opens_one_session_read_only(app_db):
    from precision_lab.store import Store
    from ui_fixtures import assert_clean, open_page

    at = open_page("overview", session="demo")
    assert at.button(key="share_link")
    at.button(key="share_link").click().run()
    assert_clean(at)
    link = next(c.value for c in at.code if "share=" in c.value)
    token = link.split("share=")[1].split("&")[0]
    assert Store(app_db).session_by_token(token).name == "demo"

    # a visitor with the link: the shared session only, nothing to write with, no list of the others
    shared = _app(share=token)
    assert_clean(shared)
    assert shared.title[0].value.startswith("Overview")
    assert "demo" in shared.title[0].value
    assert not shared.get("file_uploader")
    keys = {b.key for b in shared.button}
    assert not keys & {"share_link", "rename", "delete", "ingest", "import_session"}
    assert "private" not in " ".join(str(s.value) for s in shared.sidebar.selectbox)
    # the export buttons are there: a reader may take the session away with them
    assert {d.key for d in shared.get("download_button")} == {"export_zip", "export_html"}
    # the Diff page pairs by data within the shared session only: no other session to take a candidate from
    from precision_lab.ui.page import page_script

    shared.switch_page(page_script("diff"))
    shared.query_params["share"], shared.query_params["view"] = token, "data"
    shared.run()
    assert_clean(shared)
    assert shared.selectbox(key="data_cand") and not [s for s in shared.selectbox if s.key == "data_session"]

    bad = _app(share="not-a-real-token")
    assert "not valid" in bad.error[0].value and not bad.dataframe


@pytest.mark.slow
def test_read_only_server(app_db, monkeypatch):
    from ui_fixtures import assert_clean

    monkeypatch.setenv("PRECISION_LAB_READ_ONLY", "1")
    at = _app()
    assert_clean(at)
    assert not at.get("file_uploader") and not at.dataframe  # no uploads, no list of sessions
    assert "read-only" in at.info[0].value
    at = _app(session="private")  # naming a session is not enough without its link
    assert "private" not in " ".join(t.value for t in at.title)


@pytest.mark.slow
def test_no_rerun_button_for_read_only_visitors(tmp_path, monkeypatch):
    """A recipe session offers re-runs to a writer, never through a share link or on a read-only server."""
    import streamlit as st

    from precision_lab.services.rerun import capture_recipe
    from precision_lab.services.share import create_share_token
    from precision_lab.store import Store, close_all
    from ui_fixtures import assert_clean, open_page

    db = tmp_path / "recipe.duckdb"
    s = Store(db)
    name = capture_recipe(s, "fp8-zero-scale", session="recipe")
    token = create_share_token(s, name)
    close_all()
    for var in ("PRECISION_LAB_CONFIG", "PRECISION_LAB_READ_ONLY", "PRECISION_LAB_LIST_SESSIONS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PRECISION_LAB_DB", str(db))
    st.cache_resource.clear()
    try:
        def rerun_buttons(at):
            assert_clean(at)
            return [b.key for b in at.button if b.key and b.key.startswith("rerun_")]

        assert rerun_buttons(open_page("overview", session=name))  # a writer may re-run
        assert rerun_buttons(_app(share=token)) == []
        monkeypatch.setenv("PRECISION_LAB_READ_ONLY", "1")
        monkeypatch.setenv("PRECISION_LAB_LIST_SESSIONS", "1")
        at = open_page("overview", session=name)
        assert name in at.title[0].value and rerun_buttons(at) == []
        assert not any(b.key == "share_link" for b in at.button)
    finally:
        st.cache_resource.clear()
        close_all()
