"""Ingest + pairing + report on the msprobe samples and on built folders."""

import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from precision_lab.records import TensorRecord
from precision_lab.services.ingest import ingest
from precision_lab.services.pairing import Item, match_records, verdict_format
from precision_lab.services.report import build_report, first_nonfinite, render_text, to_json

from conftest import FIXTURES

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened


def _run_ids(store, name):
    runs = store.runs(store.session(name).session_id)
    return {r["name"]: r["run_id"] for r in runs.to_dict("records")}


def _finite(d):
    return all(isinstance(d.get(k), (int, float)) and math.isfinite(d[k]) for k in ("Max", "Min"))


def _expected_producer(dump_json: Path) -> str:
    """Independent scan of dump.json: first entry with finite inputs and a non-finite output."""
    doc = json.loads(dump_json.read_text())

    def tensors(x):
        if isinstance(x, dict) and x.get("type") == "torch.Tensor":
            yield x
        elif isinstance(x, dict):
            for v in x.values():
                yield from tensors(v)
        elif isinstance(x, list):
            for v in x:
                yield from tensors(v)

    for key, e in doc["data"].items():
        if key.endswith("backward") or ".backward." in key or "parameters_grad" in key:
            ins, outs = e.get("input", []), e.get("output", [])
        else:
            ins = [e.get("input_args", []), e.get("input_kwargs", {}), e.get("parameters", {})]
            outs = e.get("output", [])
        if all(_finite(t) for t in tensors(ins)) and not all(_finite(t) for t in tensors(outs)):
            return key
    raise AssertionError("no producer in the sample")


@pytest.fixture(scope="module")
def stat_session(tmp_path_factory):
    from precision_lab.store import Store

    db = tmp_path_factory.mktemp("stat") / "s.duckdb"
    store = Store(db)
    name = ingest(FIXTURES / "stat_mix_fp16_inner_ovf", reference=FIXTURES / "stat_mix_fp32_inner_ovf", store=store)
    return store, name


def test_statistics_pair_first_nonfinite_producer(stat_session):
    store, name = stat_session
    ids = _run_ids(store, name)
    (dump16,) = (FIXTURES / "stat_mix_fp16_inner_ovf").glob("step*/*/dump.json")
    want = _expected_producer(dump16)
    assert want == "Functional.linear.10.forward"  # the fc1 of block 2, per the sample's README
    f = first_nonfinite(store, ids["stat_mix_fp16_inner_ovf"])
    assert f.op == want and f.producer and f.role == "output" and f.op_type == "linear"
    assert f.run == "stat_mix_fp16_inner_ovf" and f.step == 0 and f.rank == 0
    doc = json.loads(dump16.read_text())
    assert f.seq == list(doc["data"]).index(want)
    assert [p.op for p in f.path][-1] == want
    assert len(f.path) == 6 and not any(p.nonfinite_out for p in f.path[:-1])
    assert first_nonfinite(store, ids["stat_mix_fp32_inner_ovf"]) is None


def test_norm_artefact_is_not_called_an_overflow(stat_session):
    store, name = stat_session
    rep = build_report(store, name)
    arts = rep.norm_artefacts
    assert {(a.op, a.role, a.index) for a in arts} == {
        ("Functional.linear.10.forward", "input", "1"), ("Module.blocks.2.fc1.Linear.forward.0", "param", "weight")}
    for a in arts:
        assert a.l2norm == math.inf and math.isfinite(a.max) and math.isfinite(a.min)
        assert a.reason.startswith("fp16 norm-arithmetic artefact")
        # independent bound: sqrt(numel) * absmax in float64 exceeds fp16's max finite
        assert a.norm_bound_f64 == pytest.approx(math.sqrt(1024 * 256) * 1875.0)
        assert a.norm_bound_f64 > float(torch.finfo(torch.float16).max)
    weight = [t for t in rep.tensors if t.op == "Module.blocks.2.fc1.Linear.forward.0" and t.role == "param"
              and t.index == "weight" and t.run == "stat_mix_fp16_inner_ovf"]
    assert len(weight) == 1 and weight[0].nonfinite is False
    text = render_text(rep)
    assert "fp16 norm-arithmetic artefact" in text and "not non-finite" in text
    assert "Functional.linear.10.forward" in text.split("First non-finite producer:")[1].split("\n")[2]


def test_statistics_pair_comparisons(stat_session):
    store, name = stat_session
    rep = build_report(store, name)
    comps = rep.comparisons
    n16 = sum(1 for t in rep.tensors if t.run == "stat_mix_fp16_inner_ovf")
    n32 = sum(1 for t in rep.tensors if t.run == "stat_mix_fp32_inner_ovf")
    assert n16 == n32 and len(comps) == n16
    assert all(c.match == "exact" and c.basis == "stats" for c in comps)
    # compared on their summaries: the summaries' errors, never an element-wise one
    assert all(c.max_rel_err is None and c.max_abs_err is None for c in comps)
    judged = [c for c in comps if c.verdict != "nonfinite"]
    assert len(judged) > 100 and all(isinstance(c.summary_rel_err, float) for c in judged)
    text = render_text(rep)
    assert "summary_rel" in text.split("Worst")[1].splitlines()[1]  # the worst table's header
    by = {(c.op, c.role, c.index): c for c in comps}
    assert by[("Functional.linear.10.forward", "output", "0")].verdict == "nonfinite"
    # the weight whose fp16 Norm is inf is not flagged: its Max/Min match fp32's
    w = by[("Module.blocks.2.fc1.Linear.forward.0", "param", "weight")]
    assert w.verdict != "nonfinite" and w.nonfinite_introduced == 0
    # every comparison before the producer in the forward pass is free of non-finite values
    first_seq = first_nonfinite(store, _run_ids(store, name)["stat_mix_fp16_inner_ovf"]).seq
    assert all(c.verdict != "nonfinite" for c in comps if c.seq < first_seq)


@pytest.mark.slow
def test_report_json_is_strict_and_stable(stat_session):
    store, name = stat_session
    text = to_json(build_report(store, name))

    def no_constants(tok):
        raise AssertionError(f"non-strict JSON token {tok}")

    doc = json.loads(text, parse_constant=no_constants)
    assert {"session", "runs", "first_nonfinite", "tensors", "comparisons", "diagnoses"} <= set(doc)
    assert set(doc["runs"][0]) >= {"name", "dtype", "parent", "fix"}
    assert doc["first_nonfinite"]["stat_mix_fp32_inner_ovf"] is None
    f = doc["first_nonfinite"]["stat_mix_fp16_inner_ovf"]
    assert {"run", "op", "seq"} <= set(f)
    t = doc["tensors"][0]
    assert set(t) >= {"run", "seq", "op", "op_type", "role", "index", "step", "rank", "dtype", "shape", "numel",
                      "nan", "inf", "zero", "min", "max", "absmax", "mean", "std"}
    c = doc["comparisons"][0]
    assert set(c) >= {"op", "role", "index", "ref_run", "cand_run", "max_abs_err", "max_rel_err", "summary_abs_err",
                      "summary_rel_err", "cosine", "sqnr_db", "nonfinite_introduced", "verdict"}
    out = [t for t in doc["tensors"] if t["op"] == "Functional.linear.10.forward" and t["role"] == "output"
           and t["run"] == "stat_mix_fp16_inner_ovf"][0]
    assert (out["max"], out["min"], out["mean"]) == ("inf", "-inf", "nan")


def _pt(proc, name):
    return torch.load(proc / "dump_tensor_data" / name, weights_only=True)


@pytest.mark.slow
def test_tensor_mode_pair_compares_element_wise(store):
    name = ingest(FIXTURES / "tensor_mix_fp16", reference=FIXTURES / "tensor_mix_fp32", store=store)
    rep = build_report(store, name)
    comps = rep.comparisons
    assert len(comps) == sum(1 for t in rep.tensors if t.run == "tensor_mix_fp16")
    assert all(c.match == "exact" and c.basis == "tensor" and c.kind == "accumulated" for c in comps)
    assert all(c.verdict in ("expected", "warn", "error") for c in comps)
    (p32,) = (FIXTURES / "tensor_mix_fp32" / "step0").iterdir()
    (p16,) = (FIXTURES / "tensor_mix_fp16" / "step0").iterdir()
    by = {(c.op, c.role, c.index): c for c in comps}
    for key, fname in [
        (("Functional.linear.3.forward", "output", "0"), "Functional.linear.3.forward.output.0.pt"),
        (("Functional.softmax.1.forward", "input", "0"), "Functional.softmax.1.forward.input.0.pt"),
        (("Functional.linear.5.backward", "grad_input", "0"), "Functional.linear.5.backward.output.0.pt"),
    ]:
        r = _pt(p32, fname).double().numpy().ravel()
        c = _pt(p16, fname).double().numpy().ravel()
        d = c - r
        got = by[key]
        assert got.max_abs_err == pytest.approx(np.abs(d).max(), rel=1e-12)
        assert got.sqnr_db == pytest.approx(10 * np.log10(np.sum(r * r) / np.sum(d * d)), rel=1e-9)
        cos = np.dot(r, c) / (np.linalg.norm(r) * np.linalg.norm(c))
        assert got.cosine == pytest.approx(cos, rel=1e-12)
        assert got.nonfinite_introduced == 0
    # an fp32 tensor of the fp16 run (the loss) is judged against fp16 rounding, the run's format
    loss = by[("Tensor.mean.0.forward", "output", "0")]
    assert loss.cand_format == "fp16" and loss.verdict == "expected"


@pytest.mark.slow
def test_zip_equals_folder_and_no_cache_equals_cache(store, tmp_path):
    base = ingest(FIXTURES / "tensor_mix_fp16", reference=FIXTURES / "tensor_mix_fp32", store=store)
    zips = []
    for n in ("tensor_mix_fp16", "tensor_mix_fp32"):
        z = tmp_path / f"{n}.zip"
        with zipfile.ZipFile(z, "w") as zf:
            for p in (FIXTURES / n).rglob("*"):
                if p.is_file():
                    zf.write(p, Path(n) / p.relative_to(FIXTURES / n))  # one wrapping folder, as users zip
        zips.append(z)
    from_zip = ingest(zips[0], reference=zips[1], store=store, cache_bytes=0)
    cols = "op, role, \"index\", match, basis, max_abs_err, sqnr_db, cosine, verdict"

    def comps(name):
        sid = store.session(name).session_id
        return store.df(f"SELECT {cols} FROM comparisons WHERE session_id = ? ORDER BY op, role, \"index\"", [sid])

    a, b = comps(base), comps(from_zip)
    assert len(a) == len(b) > 0
    assert a.equals(b)
    assert {r.name for r in build_report(store, from_zip).runs} == {"tensor_mix_fp16", "tensor_mix_fp32"}


def test_progress_reports_bytes_then_pairs(store, tmp_path):
    calls = []
    ingest(FIXTURES / "tensor_mix_fp16", reference=FIXTURES / "tensor_mix_fp32", store=store,
           progress=lambda done, total, label: calls.append((done, total, label)))
    reads = [c for c in calls if not c[2].startswith("compare")]
    assert reads and all(b[0] >= a[0] for a, b in zip(reads, reads[1:]))
    total = sum(p.stat().st_size for n in ("tensor_mix_fp16", "tensor_mix_fp32")
                for p in (FIXTURES / n).rglob("*") if p.is_file())
    assert reads[-1][1] == total
    # every tensor file and dump.json was ticked once; stack/construct.json are not read
    unread = sum(p.stat().st_size for n in ("tensor_mix_fp16", "tensor_mix_fp32")
                 for p in (FIXTURES / n).rglob("*") if p.name in ("stack.json", "construct.json"))
    assert reads[-2][0] == total - unread
    assert reads[-1] == (total, total, "read")  # the read phase ends at 100%


# ---- pairing --------------------------------------------------------------------------

def _items(names_shapes, run="r", has_data=False, start_rid=0):
    from precision_lab.stats import TensorStats

    out = []
    for i, (op, op_type, role, shape) in enumerate(names_shapes):
        st = TensorStats.summary_only(dtype="float32", shape=shape, min=0.0, max=1.0, mean=0.5, l2norm=1.0)
        rec = TensorRecord(run_id=run, seq=i, op=op, op_type=op_type, role=role, index="0", stats=st)
        out.append(Item(start_rid + i, rec, has_data))
    return out


def test_alignment_pairs_ops_whose_counters_shifted():
    ref = _items([("Functional.linear.0.forward", "linear", "output", (2, 4)),
                  ("Tensor.add.0.forward", "add", "output", (2, 4)),
                  ("Functional.gelu.0.forward", "gelu", "output", (2, 4)),
                  ("Tensor.add.1.forward", "add", "output", (2, 8))])
    # the candidate casts once more: an extra add shifts every later add's counter
    cand = _items([("Functional.linear.0.forward", "linear", "output", (2, 4)),
                   ("Tensor.add.0.forward", "add", "output", (3, 3)),
                   ("Tensor.add.1.forward", "add", "output", (2, 4)),
                   ("Functional.gelu.0.forward", "gelu", "output", (2, 4)),
                   ("Tensor.add.2.forward", "add", "output", (2, 8))], start_rid=100)
    ms = match_records(ref, cand)
    pairs = {(m.ref.record.op if m.ref else None, m.cand.record.op if m.cand else None): m.match for m in ms}
    assert pairs == {
        ("Functional.linear.0.forward", "Functional.linear.0.forward"): "exact",
        ("Functional.gelu.0.forward", "Functional.gelu.0.forward"): "exact",
        ("Tensor.add.0.forward", "Tensor.add.1.forward"): "aligned",
        ("Tensor.add.1.forward", "Tensor.add.2.forward"): "aligned",
        (None, "Tensor.add.0.forward"): "unmatched_cand",
    }


def test_alignment_of_statistics_dumps_with_renamed_prefixes(store, tmp_path):
    """Statistics-only dumps whose op names differ (module prefix renamed) still pair by order and shape,
    and tensors without a partner are listed, never counted as passing."""
    (dump,) = (FIXTURES / "stat_mix_fp32_inner_ovf").glob("step*/*/dump.json")
    text = dump.read_text()
    doc = json.loads(text)
    renamed = {k.replace("Module.blocks.", "Module.model.layers."): v for k, v in doc["data"].items()}
    first_key = next(iter(renamed))
    renamed.pop(first_key)  # a tensor missing from the candidate
    d = tmp_path / "renamed" / "step0" / "rank0"
    d.mkdir(parents=True)
    (d / "dump.json").write_text(json.dumps({**doc, "data": renamed}))
    name = ingest(tmp_path / "renamed", reference=FIXTURES / "stat_mix_fp32_inner_ovf", store=store)
    comps = store.df("SELECT match, verdict, op FROM comparisons")
    counts = comps.match.value_counts().to_dict()
    n_module = sum(1 for k in doc["data"] if k.startswith("Module.blocks."))
    assert counts.get("aligned", 0) > 0
    assert counts["unmatched_ref"] >= 1 and "unmatched_cand" not in counts
    assert comps[comps.match.str.startswith("unmatched")].verdict.isna().all()
    aligned_ops = set(comps[comps.match == "aligned"].op)
    assert all(op.startswith("Module.model.layers.") for op in aligned_ops)
    assert n_module > 0 and name


def test_verdict_format():
    assert verdict_format("float32", "float16") == "fp16"
    assert verdict_format("float16", "float16") is None
    assert verdict_format("float16", "float32") is None
    assert verdict_format("int64", "bfloat16") == "bf16"
    assert verdict_format("float32", None) is None


# ---- generic pair with a NaN, and our own shard format ---------------------------------

def _generic_pair(tmp_path):
    g = torch.Generator().manual_seed(0)
    ref, cand = tmp_path / "ref32", tmp_path / "cand16"
    ref.mkdir()
    cand.mkdir()
    x = torch.randn(64, 32, generator=g)
    w = torch.randn(32, 32, generator=g) * 0.2
    acts = {"fc1.input.0": x, "fc1.output.0": x @ w, "act.output.0": torch.relu(x @ w)}
    for k, v in acts.items():
        torch.save(v, ref / f"{k}.pt")
        vh = v.half()
        if k == "act.output.0":
            vh[3, 5] = float("nan")
        torch.save(vh, cand / f"{k}.pt")
    return ref, cand, acts


@pytest.mark.slow
def test_generic_pair_flags_introduced_nan(store, tmp_path):
    ref, cand, acts = _generic_pair(tmp_path)
    name = ingest(cand, reference=ref, store=store)
    rep = build_report(store, name)
    by = {c.op + "." + c.role: c for c in rep.comparisons}
    assert by["act.output"].verdict == "nonfinite" and by["act.output"].nonfinite_introduced == 1
    assert by["fc1.output"].verdict == "expected"
    f = rep.first_nonfinite["cand16"]
    assert f.op == "act" and f.producer
    assert rep.first_nonfinite["ref32"] is None


class _GivenShards:
    """A shard reader yielding given records: the native reader's delegation without Parquet files."""

    def __init__(self, runs):
        self.runs = runs

    def read_shards(self, root):
        for meta, recs in self.runs:
            for r in recs:
                yield meta, r


@pytest.mark.slow
def test_native_folder_pairs_its_reference_and_candidate(store, tmp_path, monkeypatch):
    import precision_lab.readers.native as native
    from precision_lab.stats import tensor_stats

    d = tmp_path / "captured"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"format": "precision-lab-shards", "version": 1, "runs": []}))

    def recs(run_id, dtype, bad):
        out = []
        for i, op in enumerate(["blocks.0.fc1", "blocks.0.act", "blocks.0.fc2"]):
            x = torch.full((4,), float(i + 1), dtype=dtype)
            if bad and op != "blocks.0.fc1":  # act makes an inf, fc2 receives it and passes it on to the output
                x[0] = float("inf")
            for j, role in enumerate(("input", "output")):
                seen = x if role == "output" or op == "blocks.0.fc2" else x.abs().clamp(max=9)
                out.append(TensorRecord(run_id=run_id, seq=2 * i + j, op=op, op_type=op.split(".")[-1], role=role,
                                        index="0", stats=tensor_stats(seen), source="cand/rank0/step0.parquet"))
        return out

    runs = [({"run_id": "c1", "name": "fp16", "dtype": "float16", "kind": "candidate", "parent_run_id": None,
              "fix": None, "policy": None}, recs("c1", torch.float16, True)),
            ({"run_id": "r1", "name": "fp32", "dtype": "float32", "kind": "reference", "parent_run_id": None,
              "fix": None, "policy": {"dtype": "float32"}}, recs("r1", torch.float32, False)),
            ({"run_id": "x1", "name": "fp16+fix", "dtype": "float16", "kind": "rerun", "parent_run_id": "c1",
              "fix": "keep-fp32:blocks.0.act", "policy": None}, recs("x1", torch.float16, False))]
    monkeypatch.setattr(native, "read_shards", _GivenShards(runs).read_shards)
    name = ingest(d, store=store)
    rep = build_report(store, name)
    runs = {r.name: r for r in rep.runs}
    assert {n: r.kind for n, r in runs.items()} == {"fp16": "candidate", "fp32": "reference", "fp16+fix": "rerun"}
    assert [r.name for r in rep.runs][0] == "fp32"
    assert runs["fp16+fix"].parent == "fp16" and runs["fp16+fix"].fix == "keep-fp32:blocks.0.act"
    assert runs["fp16"].parent is None
    assert len(rep.comparisons) == 12 and all(c.basis == "stats" for c in rep.comparisons)
    assert rep.first_nonfinite["fp16"].op == "blocks.0.act"
    assert rep.first_nonfinite["fp16+fix"] is None
    assert rep.notes["ingest"]["pairs"] == [{"reference": "fp32", "candidate": "fp16"},
                                               {"reference": "fp32", "candidate": "fp16+fix"}]
    assert rep.notes["ingest"]["runs"]["fp16"]["order"] == "execution"


@pytest.mark.slow
def test_native_shards_written_by_capture_code(store, tmp_path):
    """Shards written with precision_lab.readers.shards (two ranks), local comparisons included."""
    import precision_lab.readers.shards as shards
    from precision_lab.metrics import compare
    from precision_lab.stats import tensor_stats

    root = tmp_path / "shards"
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 8, generator=g)
    metas = {
        "fp32": {"run_id": "a", "name": "fp32", "dtype": "float32", "kind": "reference", "parent_run_id": None,
                 "fix": None, "policy": None, "order": "execution"},
        "fp16": {"run_id": "b", "name": "fp16", "dtype": "float16", "kind": "candidate", "parent_run_id": None,
                 "fix": None, "policy": None, "order": "execution"},
    }
    for rank in (0, 1):
        for name, meta in metas.items():
            dt = torch.float32 if name == "fp32" else torch.float16
            h = (x * (1 + rank)).to(dt)
            y = h * 1000 if rank == 1 else h  # rank 1 overflows fp16 in the scaling op
            y = y.to(dt)
            recs = [TensorRecord(run_id=meta["run_id"], seq=i, op=op, op_type=op, role=role, index="0",
                                 stats=tensor_stats(t), rank=rank)
                    for i, (op, role, t) in enumerate([("scale", "input", h), ("scale", "output", y * 100)])]
            local = {1: compare((y * 100).double(), y * 100)} if name == "fp16" else None
            shards.write_shard(root, meta, recs, rank=rank, step=0, local_comparisons=local)
    shards.write_manifest(root, list(metas.values()))
    name = ingest(root, store=store)
    rep = build_report(store, name)
    f = rep.first_nonfinite["fp16"]
    assert (f.op, f.rank, f.role) == ("scale", 1, "output")
    assert rep.first_nonfinite["fp32"] is None
    acc = [c for c in rep.comparisons if c.kind != "local"]
    assert len(acc) == 4 and all(c.match == "exact" for c in acc)
    bad = [c for c in acc if c.verdict == "nonfinite"]
    assert [(c.op, c.role, c.rank) for c in bad] == [("scale", "output", 1)]
    local = [c for c in rep.comparisons if c.kind == "local"]
    assert len(local) == 2 and {c.rank for c in local} == {0, 1}
    assert all(c.ref_run == c.cand_run == "fp16" for c in local)
