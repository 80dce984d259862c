"""Parquet shards: round trip, DuckDB over the glob, capture in shard mode, and malformed folders."""

from __future__ import annotations

import json
import math

import duckdb
import numpy as np
import pytest
import torch

from precision_lab import capture
from precision_lab.live import CaptureOptions
from precision_lab.records import TensorRecord
from precision_lab.readers.shards import ShardError, read_local_comparisons, read_manifest, read_shards, shard_glob, write_manifest, write_shard
from precision_lab.stats import HIST_EDGES_ID, tensor_stats

from test_capture import build_tiny, run_step, tiny_input


def _records(run_id="r1", step=0, rank=0):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 5, generator=g) * 1e3
    b = torch.tensor([1.0, float("nan"), float("inf"), 0.0, -2.5]).half()
    c = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    return [
        TensorRecord(run_id, 0, "fc.linear.0", "linear", "input", "0", tensor_stats(a), step, rank, tensor=a),
        TensorRecord(run_id, 0, "fc.linear.0", "linear", "output", "0", tensor_stats(b), step, rank),
        TensorRecord(run_id, 1, "fc.backward.0", "Linear", "param_grad", "weight",
                     tensor_stats(c, histogram=False), step, rank, direction="backward"),
    ]


META = {"run_id": "r1", "name": "fp16 run", "dtype": "float16", "kind": "candidate", "parent_run_id": None,
        "fix": None, "policy": '{"dtype": "float16"}', "source": "capture", "order": "execution"}


def test_round_trip(tmp_path):
    recs = _records()
    p0 = write_shard(tmp_path, META, recs, rank=0, step=0)
    p1 = write_shard(tmp_path, META, _records(step=1), rank=0, step=1)
    write_manifest(tmp_path, [META])
    assert p0 == tmp_path / "fp16 run" / "rank0" / "step0.parquet" and p1.name == "step1.parquet"
    doc = read_manifest(tmp_path)
    assert doc["format"] == "precision-lab-shards" and doc["version"] == 1
    run = doc["runs"][0]
    assert run["steps"] == [0, 1] and run["ranks"] == [0] and run["hist_edges_id"] == HIST_EDGES_ID
    assert run["files"] == ["fp16 run/rank0/step0.parquet", "fp16 run/rank0/step1.parquet"]
    got = list(read_shards(tmp_path))
    assert len(got) == 6
    meta, first = got[0]
    assert {k: meta[k] for k in META} == META
    for (_, r), e in zip(got[:3], recs):
        assert (r.seq, r.op, r.op_type, r.role, r.index, r.step, r.rank, r.direction) == (
            e.seq, e.op, e.op_type, e.role, e.index, e.step, e.rank, e.direction)
        assert r.stats == e.stats  # every field, NaN-aware, histogram included
        assert r.source == p0.relative_to(tmp_path).as_posix()  # relative: no server path is stored
    np.testing.assert_array_equal(first.tensor, recs[0].tensor.numpy())
    assert got[1][1].tensor is None and got[1][1].stats.nan_count == 1 and got[1][1].stats.inf_count == 1
    assert got[2][1].stats.hist is None
    assert [r.step for _, r in got] == [0, 0, 0, 1, 1, 1]


def test_duckdb_reads_every_shard_with_store_columns(tmp_path):
    from precision_lab.store import TENSOR_COLUMNS, Store

    Store(":memory:")  # fills TENSOR_COLUMNS
    for rank in (0, 1):
        write_shard(tmp_path, META, _records(rank=rank), rank=rank, step=0)
    write_manifest(tmp_path, [META])
    con = duckdb.connect()
    df = con.execute(f"SELECT * FROM read_parquet('{shard_glob(tmp_path)}', filename=true) "
                     "ORDER BY rank, seq, role").df()
    assert len(df) == 6 and sorted(df["rank"].unique()) == [0, 1]
    assert set(TENSOR_COLUMNS) - {"rid", "has_hist"} <= set(df.columns)
    nf = con.execute(f"SELECT rank, op, role FROM read_parquet('{shard_glob(tmp_path)}') WHERE nonfinite "
                     "ORDER BY rank").fetchall()
    assert nf == [(0, "fc.linear.0", "output"), (1, "fc.linear.0", "output")]
    h = con.execute(f"SELECT hist_bins, hist_counts FROM read_parquet('{shard_glob(tmp_path)}') "
                    "WHERE role = 'input' AND rank = 0").fetchone()
    s = _records()[0].stats
    assert h[0] == np.flatnonzero(s.hist).tolist() and h[1] == s.hist[s.hist > 0].tolist()


def test_capture_writes_one_shard_per_step_with_local_comparisons(tmp_path):
    torch.manual_seed(0)
    model = build_tiny().half()
    root = tmp_path / "shards"
    opts = CaptureOptions(local_error=True)
    with capture(model, run="fp16", shard_dir=root, options=opts) as cap:
        for _ in range(3):
            run_step(model, tiny_input().half())
            cap.step()
    assert cap.session is None
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet"))
    assert files == ["fp16/rank0/step0.parquet", "fp16/rank0/step1.parquet", "fp16/rank0/step2.parquet"]
    back = list(read_shards(root))
    assert len(back) == len(cap.records)
    for (meta, r), e in zip(back, cap.records):
        assert meta["run_id"] == cap.run_id and meta["kind"] == "candidate" and meta["dtype"] == "float16"
        assert r.name == e.name and r.seq == e.seq and r.stats == e.stats
    local = list(read_local_comparisons(root))
    assert len(local) == len(cap.local_comparisons) > 30
    by_pos = {(e.step, e.name): c for (pos, c), e in
              zip(cap.local_comparisons, (cap.records[p] for p, _ in cap.local_comparisons))}
    for _, rec, cmp in local:
        assert cmp == by_pos[(rec.step, rec.name)] or all(
            (a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
            for a, b in zip(cmp.to_dict().values(), by_pos[(rec.step, rec.name)].to_dict().values()))


def test_ingest_reads_a_capture_shard_folder(tmp_path, store):
    from precision_lab.services.ingest import ingest
    from precision_lab.services.report import first_nonfinite

    torch.manual_seed(0)
    model = build_tiny(overflow_scale=2e5).half()
    root = tmp_path / "cap"
    with capture(model, run="fp16", shard_dir=root):
        run_step(model, tiny_input().half())
    name = ingest([root], store=store)
    run_id = store.runs(store.session(name).session_id).iloc[0]["run_id"]
    hit = first_nonfinite(store, run_id)
    assert hit.op == "blocks.1.fc1.linear.0" and hit.producer


# ---- malformed shard folders: each message names the file and the problem ---------------------------

def _good(tmp_path):
    write_shard(tmp_path, META, _records(), rank=0, step=0)
    write_manifest(tmp_path, [META])
    return tmp_path / "manifest.json"


def _manifest_edit(tmp_path, fn):
    path = _good(tmp_path)
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def test_malformed_manifests(tmp_path):
    # no manifest beside shards (a capture killed before it wrote one): rebuilt from them, said; none at all: refused
    d = tmp_path / "lost"
    d.mkdir()
    _good(d).unlink()
    got = list(read_shards(d))
    assert got and "rebuilt from the shards" in str(got[0][0]["warnings"])
    with pytest.raises(ShardError, match="no manifest.json") as e:
        list(read_shards(tmp_path / "lost" / "fp16 run" / "rank0"))
    assert str(tmp_path / "lost" / "fp16 run" / "rank0" / "manifest.json") in str(e.value)
    cases = [
        ("invalid", lambda p: p.write_text("{not json"), "invalid JSON"),
        ("format", lambda p: p.write_text(json.dumps({"format": "other", "version": 1, "runs": []})),
         "expected 'precision-lab-shards'"),
        ("future", lambda p: p.write_text(json.dumps({"format": "precision-lab-shards", "version": 99,
                                                     "runs": []})), "newer than this Precision Lab reads"),
        ("runs", lambda p: p.write_text(json.dumps({"format": "precision-lab-shards", "version": 1,
                                                   "runs": {}})), '"runs" must be a list'),
    ]
    for label, breaker, message in cases:
        d = tmp_path / label
        d.mkdir()
        breaker(_good(d))
        with pytest.raises(ShardError, match=message) as e:
            list(read_shards(d))
        assert str(e.value).startswith("manifest.json: "), label
        assert str(tmp_path) not in str(e.value), label  # names relative to the dump, no server path


def test_malformed_runs_and_files(tmp_path):
    d = tmp_path / "escape"
    d.mkdir()
    _manifest_edit(d, lambda doc: doc["runs"][0].__setitem__("files", ["../../etc/passwd"]))
    with pytest.raises(ShardError, match="outside the shard folder"):
        list(read_shards(d))
    d = tmp_path / "missing"
    d.mkdir()
    _manifest_edit(d, lambda doc: doc["runs"][0]["files"].append("fp16 run/rank0/step7.parquet"))
    with pytest.raises(ShardError, match=r"step7\.parquet: listed in .* but missing"):
        list(read_shards(d))
    d = tmp_path / "badname"
    d.mkdir()
    _manifest_edit(d, lambda doc: doc["runs"][0].__setitem__("name", "../up"))
    with pytest.raises(ShardError, match="cannot be a shard folder name"):
        list(read_shards(d))
    with pytest.raises(ShardError, match="cannot be a shard folder name"):
        write_shard(tmp_path, {**META, "name": "a/b"}, _records(), rank=0, step=0)
    d = tmp_path / "twice"
    d.mkdir()
    _manifest_edit(d, lambda doc: doc["runs"].append(dict(doc["runs"][0])))
    with pytest.raises(ShardError, match="listed twice"):
        list(read_shards(d))


def test_malformed_parquet_content(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "garbage"
    d.mkdir()
    _good(d)
    shard = d / "fp16 run" / "rank0" / "step0.parquet"
    shard.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ShardError, match=r"step0\.parquet: not a readable Parquet shard"):
        list(read_shards(d))

    def rewrite(label, fn, message):
        dd = tmp_path / label
        dd.mkdir()
        _good(dd)
        f = dd / "fp16 run" / "rank0" / "step0.parquet"
        t = pq.read_table(f)
        pq.write_table(fn(t), f)
        with pytest.raises(ShardError, match=message) as e:
            list(read_shards(dd))
        assert str(e.value).startswith("fp16 run/rank0/step0.parquet: ")

    rewrite("nocol", lambda t: t.drop_columns(["nan_count"]), "lacks column.*nan_count")
    rewrite("bins", lambda t: t.set_column(t.column_names.index("hist_bins"), "hist_bins",
                                           pa.array([[10**6], [1], None], pa.list_(pa.int32()))),
            "bins outside")
    rewrite("edges", lambda t: t.set_column(t.column_names.index("hist_edges_id"), "hist_edges_id",
                                            pa.array(["deadbeef0000", HIST_EDGES_ID, None])),
            "uses bin edges deadbeef0000")
    rewrite("shape", lambda t: t.set_column(t.column_names.index("shape"), "shape",
                                            pa.array(["[4, 5]", "{oops", "[2, 3]"])), "not a JSON list")
    rewrite("npy", lambda t: t.set_column(t.column_names.index("tensor_npy"), "tensor_npy",
                                          pa.array([b"nope", None, None], pa.binary())), "not a valid .npy")
    rewrite("op", lambda t: t.set_column(t.column_names.index("op"), "op", pa.array([None, "a", "b"], pa.string())),
            "has no 'op'")


def test_manifest_merge_keeps_other_ranks(tmp_path):
    write_shard(tmp_path, META, _records(rank=1), rank=1, step=0)
    write_manifest(tmp_path, [{**META, "warnings": [{"where": "x", "message": "rank 1 note"}]}])
    write_shard(tmp_path, META, _records(rank=0), rank=0, step=0)
    write_manifest(tmp_path, [META])
    run = read_manifest(tmp_path)["runs"][0]
    assert run["ranks"] == [0, 1] and run["warnings"] == [{"where": "x", "message": "rank 1 note"}]
    assert sorted({r.rank for _, r in read_shards(tmp_path)}) == [0, 1]


class _OldComparison:
    """A local comparison as shards written before the summary fields hold it (``to_dict`` without them)."""

    def __init__(self, cmp, **old):
        self.d = {k: v for k, v in cmp.to_dict().items() if not k.startswith("summary_")} | old

    def to_dict(self) -> dict:
        return self.d


def test_local_comparisons_of_shards_written_before_the_summary_fields_still_read(tmp_path):
    from precision_lab.metrics import compare, compare_stats

    recs = _records()
    a, b = recs[0].tensor.double(), recs[0].tensor.half()
    elem = compare(a, b)
    by_stats = compare_stats(tensor_stats(a), tensor_stats(b))
    # schema-4 meaning: a stats-basis comparison carried its summaries' errors as max_abs_err/max_rel_err
    old_stats = _OldComparison(by_stats, max_abs_err=by_stats.summary_abs_err, max_rel_err=by_stats.summary_rel_err)
    write_shard(tmp_path, META, recs, rank=0, step=0, local_comparisons={0: _OldComparison(elem), 1: old_stats})
    write_manifest(tmp_path, [META])
    got = {rec.role: cmp for _, rec, cmp in read_local_comparisons(tmp_path)}
    assert got["input"] == elem  # summary fields absent: None, as an element-wise comparison has them
    assert got["output"] == by_stats  # the summaries' errors moved to their own fields
    assert got["output"].max_rel_err is None and got["output"].summary_rel_err is not None
