"""Readers: generic tensor folders round-trip, msprobe layout and naming, the registry."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch

from precision_lab import readers
from precision_lab.readers import RunSource, natural_key
from precision_lab.ops import parse_op
from precision_lab.records import split_tensor_name
from precision_lab.services.ingest import ingest

from conftest import FIXTURES

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened


def _f64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def _check_stats(row, x):
    """Stored statistics against an independent float64 numpy computation."""
    a = _f64(x).ravel()
    fin = a[np.isfinite(a)]
    assert row["numel"] == a.size
    assert row["nan_count"] == int(np.isnan(a).sum())
    assert row["inf_count"] == int(np.isinf(a).sum())
    assert row["zero_count"] == int((a == 0).sum())
    if fin.size == 0:
        assert np.isnan(row["min"]) and np.isnan(row["max"])
        return
    assert row["min"] == fin.min() and row["max"] == fin.max()
    assert row["mean"] == pytest.approx(fin.mean(), rel=1e-12, abs=1e-300)
    assert row["l2norm"] == pytest.approx(np.sqrt(np.sum(fin * fin)), rel=1e-12)


def _rows(store, name):
    sid = store.session(name).session_id
    df = store.df("SELECT t.* FROM tensors t JOIN runs r USING (run_id) WHERE r.session_id = ? ORDER BY seq, rid",
                  [sid])
    return {r["name"]: r for r in df.to_dict("records")}


def _record_name(n):
    """A name that is not ``op.role.index`` becomes op ``n``, role ``tensor``, index ``0``."""
    return n if split_tensor_name(n) else f"{n}.tensor.0"


def _roundtrip(store, folder, expected: dict):
    """Ingest with tensors kept; every tensor comes back bit-exact with correct stats."""
    name = ingest(folder, store=store, keep_tensors=True)
    rows = _rows(store, name)
    assert set(rows) == {_record_name(n) for n in expected}
    for n, x in expected.items():
        r = rows[_record_name(n)]
        _check_stats(r, x)
        back = store.tensor(r["run_id"], r["rid"])
        assert tuple(back.shape) == tuple(x.shape)
        np.testing.assert_array_equal(back.astype(np.float64), _f64(x))
        want_dtype = str(x.dtype).replace("torch.", "")
        assert r["dtype"] == want_dtype
    return name, rows


def test_npy_roundtrip(store, tmp_path):
    d = tmp_path / "npy"
    d.mkdir()
    a = np.array([[1.5, -2.0, 0.0], [np.inf, np.nan, 3.25]], dtype=np.float32)
    b = (np.arange(7) - 3).astype(np.float16)
    c = np.zeros((0, 4), np.float32)
    np.save(d / "blocks.0.fc1.output.0.npy", a)
    np.save(d / "blocks.0.fc1.input.0.npy", b)
    (d / "sub").mkdir()
    np.save(d / "sub" / "empty.npy", c)
    d_be = np.arange(5, dtype=">f4")
    np.save(d / "bigendian.npy", d_be)
    _, rows = _roundtrip(store, d, {"blocks.0.fc1.output.0": a, "blocks.0.fc1.input.0": b, "sub.empty": c,
                                    "bigendian": d_be.astype("<f4")})
    r = rows["blocks.0.fc1.output.0"]
    assert (r["op"], r["role"], r["index"], r["op_type"]) == ("blocks.0.fc1", "output", "0", "fc1")
    assert rows["sub.empty.tensor.0"]["role"] == "tensor" and rows["sub.empty.tensor.0"]["op"] == "sub.empty"
    assert not rows["sub.empty.tensor.0"]["nonfinite"]
    assert r["nonfinite"]


def test_npz_roundtrip(store, tmp_path):
    d = tmp_path / "npz"
    d.mkdir()
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    y = np.arange(10, dtype=np.int64)
    np.savez(d / "acts.npz", **{"layer1.output.0": x, "layer1.input.0": y})
    np.savez_compressed(d / "more.npz", z=x * 2)
    _, rows = _roundtrip(store, d, {"acts.layer1.output.0": x, "acts.layer1.input.0": y, "more.z": x * 2})
    assert rows["acts.layer1.output.0"]["op"] == "acts.layer1"


def test_single_container_contributes_its_keys(store, tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    x = np.ones((2, 3), np.float32)
    np.savez(d / "acts.npz", **{"fc.output.0": x})
    _roundtrip(store, d, {"fc.output.0": x})


def test_pt_roundtrip(store, tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 4, generator=g)
    h = torch.randn(6, generator=g).to(torch.bfloat16)
    torch.save(t, d / "lone.pt")
    torch.save({"attn": {"q": h, "k": t.half()}, "meta": "not a tensor", "steps": 3}, d / "nested.pth")
    torch.save([t * 2, t * 3], d / "pair.pt")
    _roundtrip(store, d, {"lone": t, "nested.attn.q": h, "nested.attn.k": t.half(), "pair.0": t * 2,
                          "pair.1": t * 3})


def test_safetensors_roundtrip(store, tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "st"
    d.mkdir()
    g = torch.Generator().manual_seed(1)
    tensors = {
        "mlp.down.output.0": torch.randn(4, 8, generator=g).half(),
        "mlp.down.param.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(3.0),
        "q": (torch.randn(16, generator=g) * 100).to(torch.float8_e4m3fn),
    }
    save_file(tensors, d / "model.safetensors")
    save_file({"x": torch.zeros(2)}, d / "other.safetensors")
    exp = {f"model.{k}": v for k, v in tensors.items()}
    exp["other.x"] = torch.zeros(2)
    _, rows = _roundtrip(store, d, exp)
    r = rows["model.mlp.down.param.weight"]
    assert (r["op"], r["role"], r["index"]) == ("model.mlp.down", "param", "weight")


def test_bin_sidecar_roundtrip(store, tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    a = np.linspace(-3, 3, 24, dtype=np.float16).reshape(2, 3, 4)
    a.tofile(d / "x.output.0.bin")
    (d / "x.output.0.json").write_text(json.dumps({"dtype": "float16", "shape": [2, 3, 4]}))
    b = np.arange(6, dtype=np.float32) * 1.5
    (d / "be.bin").write_bytes(b"\x00" * 16 + b.astype(">f4").tobytes())
    (d / "be.bin.json").write_text(json.dumps({"dtype": "float32", "shape": [6], "byteorder": "big", "offset": 16}))
    c = np.array([1.0, -2.5, 1e30], dtype=np.float32).astype(ml_dtypes.bfloat16)
    c.tofile(d / "bf.bin")
    (d / "bf.json").write_text(json.dumps({"dtype": "bfloat16", "shape": [3]}))
    _roundtrip(store, d, {"x.output.0": a, "be": b, "bf": c})


@pytest.mark.parametrize("spelling, dtype", [("bf16", ml_dtypes.bfloat16), ("fp16", np.float16),
                                             ("fp8_e4m3fn", ml_dtypes.float8_e4m3fn), ("torch.bfloat16", ml_dtypes.bfloat16)])
def test_bin_sidecar_takes_the_format_names_the_formats_command_shows(store, tmp_path, spelling, dtype):
    d = tmp_path / "named"
    d.mkdir()
    # values through a real cast: 1e3 rounds in bf16 and fp8, 448 is e4m3fn's max
    v = np.array([0.1, -3.0, 448.0, 1e-3], dtype=np.float32).astype(dtype)
    v.tofile(d / "t.bin")
    (d / "t.json").write_text(json.dumps({"dtype": spelling, "shape": [4]}))
    _roundtrip(store, d, {"t": v})
    with pytest.raises(Exception) as e:
        (d / "t.json").write_text(json.dumps({"dtype": "e4m3x", "shape": [4]}))
        ingest(d, store=store)
    assert "t.json" in str(e.value) or "t.bin" in str(e.value)
    assert "unknown dtype 'e4m3x'" in str(e.value)


def test_order_from_manifest(store, tmp_path):
    d = tmp_path / "ordered"
    d.mkdir()
    for n in ("a.output.0", "b.output.0", "c.output.0", "z.output.0"):
        np.save(d / f"{n}.npy", np.ones(2, np.float32))
    (d / "manifest.json").write_text(json.dumps({"order": ["c.output.0", "a.output.0.npy", "b.output.0"]}))
    name = ingest(d, store=store)
    seq = {r["name"]: r["seq"] for r in _rows(store, name).values()}
    assert seq == {"c.output.0": 0, "a.output.0": 1, "b.output.0": 2, "z.output.0": 3}
    info = store.session(name)
    run = next(iter(info.notes["ingest"]["runs"].values()))
    assert run["order"] == "execution" and "manifest.json" in run["order_from"]
    assert store.run(run["run_id"]).order == "execution"
    w = store.df("SELECT file, message FROM warnings")
    assert list(w.file) == ["manifest.json"] and "z.output.0" in w.message[0]


def test_order_by_name_is_said(store, tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    for i in (10, 9, 1):
        np.save(d / f"layer{i}.npy", np.ones(1, np.float32))
        os.utime(d / f"layer{i}.npy", ns=(1_700_000_000_000_000_000,) * 2)  # equal times say nothing
    name = ingest(d, store=store)
    seq = {r["op"]: r["seq"] for r in _rows(store, name).values()}
    assert seq == {"layer1": 0, "layer9": 1, "layer10": 2}  # natural order, not 1, 10, 9
    run = next(iter(store.session(name).notes["ingest"]["runs"].values()))
    assert run["order"] == "name" and "order unknown: by name" in run["order_from"]
    assert store.run(run["run_id"]).order == "name"


def test_order_txt_and_step_rank_folders(store, tmp_path):
    d = tmp_path / "sr"
    for step in (0, 1):
        for rank in (0, 1):
            p = d / f"step{step}" / f"rank{rank}"
            p.mkdir(parents=True)
            np.save(p / "fc.output.0.npy", np.full(3, step * 10 + rank, np.float32))
            np.save(p / "fc.input.0.npy", np.ones(3, np.float32))
    (d / "order.txt").write_text("# execution order\nfc.input.0\nfc.output.0\n")
    name = ingest(d, store=store)
    df = store.df("SELECT step, rank, name, seq, max FROM tensors ORDER BY step, rank, seq")
    assert len(df) == 8
    assert list(df.seq) == [0, 1] * 4
    outs = df[df.name == "fc.output.0"]
    assert list(zip(outs.step, outs["rank"], outs["max"])) == [(0, 0, 0.0), (0, 1, 1.0), (1, 0, 10.0), (1, 1, 11.0)]
    assert name


# ---- msprobe ----------------------------------------------------------------------

@pytest.mark.parametrize("key,expected", [
    ("Functional.linear.3.forward", ("linear", "forward")),
    ("Tensor.__add__.1.backward", ("add", "backward")),
    ("Torch.matmul.0.forward", ("matmul", "forward")),
    ("Module.blocks.0.fc1.Linear.forward.0", ("Linear", "forward")),
    ("Module.head.Linear.backward.0", ("Linear", "backward")),
    ("Module.head.Linear.parameters_grad.0", ("Linear", "backward")),
    ("Functional.scaled_dot_product_attention.0.forward", ("scaled_dot_product_attention", "forward")),
])
def test_parse_op(key, expected):
    assert parse_op(key) == expected


def _json_tensors(entry_key, entry):
    """Independent walk of one dump.json entry: [(role, index, statdict)]."""
    out = []

    def tensors(items, prefix=""):
        for i, it in enumerate(items):
            if isinstance(it, list):
                tensors(it, f"{prefix}{i}.")
            elif isinstance(it, dict) and it.get("type") == "torch.Tensor":
                out.append((role, f"{prefix}{i}", it))

    if ".parameters_grad." in entry_key:
        for p, v in entry.items():
            out.extend(("param_grad", p, d) for d in v)
        return out
    if entry_key.endswith(".backward") or ".backward." in entry_key:
        role = "grad_output"
        tensors(entry.get("input", []))
        role = "grad_input"
        tensors(entry.get("output", []))
        return out
    role = "input"
    tensors(entry.get("input_args", []))
    for k, v in entry.get("input_kwargs", {}).items():
        if isinstance(v, dict) and v.get("type") == "torch.Tensor":
            out.append(("kwarg", k, v))
    role = "output"
    tensors(entry.get("output", []))
    for p, v in entry.get("parameters", {}).items():
        out.append(("param", p, v))
    return out


def test_msprobe_statistics_records_match_dump_json(store):
    folder = FIXTURES / "stat_mix_fp16_inner_ovf"
    (dump,) = folder.glob("step*/*/dump.json")
    doc = json.loads(dump.read_text())
    expected = {}
    for seq, (k, e) in enumerate(doc["data"].items()):
        for role, idx, d in _json_tensors(k, e):
            expected[(k, role, idx)] = (seq, d)
    name = ingest(folder, store=store)
    df = store.df("SELECT * FROM tensors")
    assert len(df) == len(expected)
    assert not df.has_hist.any()
    for r in df.to_dict("records"):
        seq, d = expected[(r["op"], r["role"], r["index"])]
        assert r["seq"] == seq and r["step"] == 0 and r["rank"] == 0
        assert json.loads(r["shape"]) == d["shape"]
        assert r["dtype"] == d["dtype"].replace("torch.", "")
        for col, key in (("max", "Max"), ("min", "Min"), ("mean", "Mean"), ("l2norm", "Norm")):
            a, b = r[col], d[key]
            assert (np.isnan(a) and np.isnan(b)) or a == b, (r["name"], col)
    assert name


def test_msprobe_tensor_mode_stats_from_tensors(store):
    folder = FIXTURES / "tensor_mix_fp16"
    (proc,) = (folder / "step0").iterdir()
    ingest(folder, store=store)
    df = store.df("SELECT * FROM tensors WHERE op IN ('Functional.linear.0.forward', "
                  "'Module.head.Linear.parameters_grad.0', 'Tensor.__add__.3.backward')")
    names = set(df.name)
    assert {"Functional.linear.0.forward.output.0", "Functional.linear.0.forward.input.0",
            "Module.head.Linear.parameters_grad.0.param_grad.weight",
            "Tensor.__add__.3.backward.grad_output.0", "Tensor.__add__.3.backward.grad_input.1"} <= names
    for r in df.to_dict("records"):
        assert r["has_hist"]
        doc_name = {"param_grad": f"{r['op']}.{r['index']}.pt"}.get(r["role"])
        msrole = {"grad_output": "input", "grad_input": "output", "input": "input", "output": "output"}.get(r["role"])
        fname = doc_name or f"{r['op']}.{msrole}.{r['index']}.pt"
        t = torch.load(proc / "dump_tensor_data" / fname, weights_only=True)
        _check_stats(r, t)


def test_msprobe_ranks_and_steps_from_folders(store, tmp_path):
    src = next((FIXTURES / "stat_mix_fp32_inner_ovf" / "step0").iterdir()) / "dump.json"
    d = tmp_path / "multi"
    for step in (0, 3):
        for rank in (0, 2):
            p = d / f"step{step}" / f"rank{rank}"
            p.mkdir(parents=True)
            shutil.copy(src, p / "dump.json")
    ingest(d, store=store)
    df = store.df("SELECT step, rank, count(*) n FROM tensors GROUP BY ALL ORDER BY ALL")
    assert list(zip(df.step, df["rank"])) == [(0, 0), (0, 2), (3, 0), (3, 2)]
    assert len(set(df.n)) == 1


def test_msprobe_proc_folders_get_ranks_with_a_warning(store, tmp_path):
    src = next((FIXTURES / "stat_mix_fp32_inner_ovf" / "step0").iterdir()) / "dump.json"
    d = tmp_path / "procs"
    for pid in (900, 123):
        (d / "step0" / f"proc{pid}").mkdir(parents=True)
        shutil.copy(src, d / "step0" / f"proc{pid}" / "dump.json")
    ingest(d, store=store)
    ranks = store.df("SELECT DISTINCT rank FROM tensors ORDER BY rank")["rank"].tolist()
    assert ranks == [0, 1]
    msg = store.df("SELECT message FROM warnings").message.tolist()
    assert any("proc<PID>" in m for m in msg)


# ---- registry -------------------------------------------------------------------

class _CsvReader:
    """A plug-in: one tensor per .csv file (comma-separated floats)."""

    name = "csv-test"

    def detect(self, root):
        return any(root.glob("*.csv"))

    def iter_runs(self, root, tick):
        from precision_lab.records import TensorRecord
        from precision_lab.stats import tensor_stats

        def records():
            for i, p in enumerate(sorted(root.glob("*.csv"))):
                x = np.array([float(v) for v in p.read_text().split(",")], dtype=np.float32)
                tick(p.stat().st_size, p.name)
                yield TensorRecord(run_id="", seq=i, op=p.stem, op_type="csv", role="output", index="0",
                                   stats=tensor_stats(x), source=p.name, tensor=x)

        yield RunSource(key="csv", name=root.name, root=root, reader=self.name, records=records())


def test_registry_plugin_is_used_like_a_builtin(store, tmp_path):
    d = tmp_path / "csvs"
    d.mkdir()
    (d / "a.csv").write_text("1,2,3")
    (d / "b.csv").write_text("4,-5")
    assert readers.detect(d) is None
    plugin = readers.register(_CsvReader())
    try:
        assert readers.detect(d) is plugin
        assert [r.name for r in readers.ordered()][:2] == ["precision-lab", "msprobe"]
        with pytest.raises(ValueError, match="already registered"):
            readers.register(_CsvReader())  # one name, one reader: replacing says so
        assert readers.register(_CsvReader(), replace=True).name == "csv-test"
        name = ingest(d, store=store)
        df = store.df("SELECT op, max, min FROM tensors ORDER BY seq")
        assert list(df.op) == ["a", "b"] and list(df["max"]) == [3.0, 4.0] and list(df["min"]) == [1.0, -5.0]
        assert store.session(name).notes["ingest"]["runs"]["csvs"]["reader"] == "csv-test"
    finally:
        readers.unregister("csv-test")
    assert readers.detect(d) is None


def test_register_rejects_non_readers():
    with pytest.raises(TypeError, match="iter_runs"):
        readers.register(type("X", (), {"name": "x", "detect": lambda self, r: False})())


def test_natural_key():
    assert sorted(["a10", "a9", "a1b", "a1a"], key=natural_key) == ["a1a", "a1b", "a9", "a10"]


def test_float32_dumps_of_bf16_and_fp8_are_read_in_their_original_format(store, tmp_path):
    """``t.float().numpy()`` of a bf16/fp8 tensor plus ``manifest.json`` "dtypes": the records are the
    originals (dtype, values, stats), checked against real torch casts."""
    d = tmp_path / "wide"
    d.mkdir()
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(64, generator=g) * 1e3).to(torch.bfloat16)  # bf16 rounding: not float32 values in general
    q = (torch.randn(32, generator=g) * 100).to(torch.float8_e4m3fn)
    np.save(d / "mlp.output.0.npy", h.float().numpy())
    torch.save({"input": h.float(), "output": q.float()}, d / "q.pt")
    np.save(d / "plain.npy", np.float32([0.1, 2.0]))
    (d / "manifest.json").write_text(json.dumps({"dtypes": {"mlp.output.0": "bfloat16", "q.output.0": "float8_e4m3fn",
                                                            "q.input.0": "torch.bfloat16"}}))
    name, rows = _roundtrip(store, d, {"mlp.output.0": h, "q.input.0": h, "q.output.0": q,
                                       "plain": np.float32([0.1, 2.0])})
    assert rows["q.output.0"]["dtype"] == "float8_e4m3fn" and rows["mlp.output.0"]["dtype"] == "bfloat16"
    assert store.df("SELECT count(*) AS n FROM warnings").n[0] == 0


def test_a_dtypes_entry_the_values_contradict_is_said_and_the_tensor_kept(store, tmp_path):
    d = tmp_path / "wrong"
    d.mkdir()
    x = np.float32([0.1, 1.0, 3.0])  # 0.1 is no bf16 value: torch rounds it
    assert float(torch.tensor(0.1).to(torch.bfloat16)) != float(np.float32(0.1))
    np.save(d / "x.npy", x)
    (d / "manifest.json").write_text(json.dumps({"dtypes": {"x": "bf16"}}))
    name, rows = _roundtrip(store, d, {"x": x})
    assert rows["x.tensor.0"]["dtype"] == "float32"
    w = store.df("SELECT file, message FROM warnings")
    assert list(w.file) == ["x.npy"] and "not bfloat16 values" in w.message[0] and "manifest" in w.message[0]


def test_per_file_dtype_sidecars_are_read_like_the_manifest(store, tmp_path):
    """``x.json`` beside ``x.npy`` holding {"dtype": "bfloat16"}: read as the manifest's "dtypes" are, and over
    the manifest for that file; a sidecar the values contradict, or with no dtype, is said and the file kept."""
    d = tmp_path / "side"
    d.mkdir()
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(48, generator=g) * 300).to(torch.bfloat16)
    q = (torch.randn(16, generator=g) * 50).to(torch.float8_e5m2)
    np.save(d / "a.output.0.npy", h.float().numpy())
    (d / "a.output.0.json").write_text(json.dumps({"dtype": "bfloat16"}))
    np.save(d / "b.output.0.npy", q.float().numpy())
    (d / "b.output.0.npy.json").write_text(json.dumps({"dtype": "float8_e5m2", "note": "saved with .float()"}))
    (d / "manifest.json").write_text(json.dumps({"dtypes": {"b.output.0": "bfloat16"}}))  # the sidecar wins
    x = np.float32([0.1, 1.0, 3.0])  # 0.1 is no bf16 value
    np.save(d / "c.output.0.npy", x)
    (d / "c.output.0.json").write_text(json.dumps({"dtype": "bfloat16"}))
    y = np.float32([0.5, 2.0])
    np.save(d / "e.output.0.npy", y)
    (d / "e.output.0.json").write_text(json.dumps({"shape": [2]}))
    name, rows = _roundtrip(store, d, {"a.output.0": h, "b.output.0": q, "c.output.0": x, "e.output.0": y})
    assert rows["a.output.0"]["dtype"] == "bfloat16" and rows["b.output.0"]["dtype"] == "float8_e5m2"
    w = store.df("SELECT file, message FROM warnings ORDER BY file")
    assert list(w.file) == ["c.output.0.npy", "e.output.0.json"]
    assert "not bfloat16 values" in w.message[0] and "its sidecar says" in w.message[0]
    assert w.message[1] == 'sidecar of e.output.0.npy needs "dtype": the name of a dtype (NoneType is not one); the ' \
                           "file is read as saved"


def test_the_manifest_is_read_once(tmp_path, monkeypatch):
    """The order list and the "dtypes" come from one read of manifest.json."""
    from precision_lab.readers import generic

    d = tmp_path / "m"
    d.mkdir()
    np.save(d / "a.output.0.npy", np.float32([1, 2]))
    np.save(d / "b.output.0.npy", np.float32([3, 4]))
    (d / "manifest.json").write_text(json.dumps({"order": ["b", "a"], "dtypes": {"a.output.0": "bfloat16"}}))
    reads = []
    real = generic.read_json
    monkeypatch.setattr(generic, "read_json", lambda path, *a, **k: reads.append(path.name) or real(path, *a, **k))
    src = next(generic.GenericReader().iter_runs(d, lambda n, label: None))
    recs = list(src.records)
    assert reads == ["manifest.json"]
    assert {r.op: r.stats.dtype for r in recs} == {"a": "bfloat16", "b": "float32"}
    assert src.order == "execution" and [src.hints[(0, 0, r.op, "output", "0")][0] for r in recs] == [1, 0]
