"""Malformed and hostile dumps: each refusal gives a message naming the file and
the problem and leaves the database as it was; unusual but valid arrays are
read with statistics that match numpy.  (Session imports and browser uploads:
tests/test_hostile.py; paths that leave a dump: tests/test_containment.py.)"""

import io
import json
import os
import shutil
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from precision_lab.safezip import UnsafeZip, ZipLimits, check_zip, safe_extract
from precision_lab.services.ingest import ingest

from conftest import FIXTURES, SAMPLES, ingest_refused

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened


def _good(folder: Path) -> None:
    """Valid tensors sorted *before* the bad file, so a half session would exist without the transaction."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "a.output.0.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    np.save(folder / "b.output.0.npy", np.ones(5, dtype=np.float16))


# ---- tensor files ---------------------------------------------------------------

def test_truncated_npy(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.save(d / "z.output.0.npy", np.arange(1000, dtype=np.float32))
    full = (d / "z.output.0.npy").read_bytes()
    (d / "z.output.0.npy").write_bytes(full[:300])
    ingest_refused(store, d, "z.output.0.npy", "truncated")


def test_npy_with_bad_magic(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "z.npy").write_bytes(b"this is not numpy" * 4)
    ingest_refused(store, d, "z.npy", "not a .npy file")


def test_npy_object_array_refused(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.save(d / "z.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    ingest_refused(store, d, "z.npy", "Python objects")


def test_bad_npz(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.savez(d / "z.npz", x=np.ones(100, np.float32))
    data = (d / "z.npz").read_bytes()
    (d / "z.npz").write_bytes(data[: len(data) // 2])
    ingest_refused(store, d, "z.npz", "not a readable .npz")


class _Payload:
    """Unpickling this calls open(path, 'w'): a file appears if code runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_pt_is_not_executed(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    marker = tmp_path / "pwned.txt"
    torch.save({"x": torch.ones(3), "evil": _Payload(marker)}, d / "z.pt")
    msg = ingest_refused(store, d, "z.pt", "refused", "weights_only")
    assert not marker.exists(), "the payload ran"
    # the payload is real: an unsafe load would have run it
    torch.load(d / "z.pt", weights_only=False)
    assert marker.exists()
    assert "possibly code" in msg


def test_pickle_payload_in_msprobe_tensor_file(store, tmp_path):
    d, proc = _msprobe_copy(tmp_path)
    target = proc / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt"
    marker = tmp_path / "pwned2.txt"
    torch.save(_Payload(marker), target)
    ingest_refused(store, d, "Functional.linear.0.forward.output.0.pt", "refused")
    assert not marker.exists()


def test_truncated_pt(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    torch.save(torch.randn(100), d / "z.pt")
    data = (d / "z.pt").read_bytes()
    (d / "z.pt").write_bytes(data[: len(data) // 3])
    ingest_refused(store, d, "z.pt", "truncated or corrupt")


def test_bad_safetensors_header(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    # 8-byte little-endian header length far beyond the file, then junk
    (d / "z.safetensors").write_bytes((10 ** 9).to_bytes(8, "little") + b"{not json")
    ingest_refused(store, d, "z.safetensors", "not a readable .safetensors")


def test_safetensors_header_not_json(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    body = b"{this is not json}"
    (d / "z.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
    ingest_refused(store, d, "z.safetensors", "not a readable .safetensors")


def test_bin_without_sidecar(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.ones(8, np.float32).tofile(d / "z.bin")
    ingest_refused(store, d, "z.bin", "without a JSON sidecar")


def test_sidecar_shape_mismatch(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.ones(10, np.float16).tofile(d / "z.bin")
    (d / "z.json").write_text(json.dumps({"dtype": "float16", "shape": [4, 4]}))
    msg = ingest_refused(store, d, "z.bin", "[4, 4]", "32 bytes", "20 bytes")
    assert "z.json" in msg


@pytest.mark.slow
def test_sidecar_invalid_json_and_unknown_dtype(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.ones(4, np.float32).tofile(d / "z.bin")
    (d / "z.json").write_text("{dtype: float32")
    ingest_refused(store, d, "z.json", "invalid JSON")
    (d / "z.json").write_text(json.dumps({"dtype": "float13", "shape": [4]}))
    ingest_refused(store, d, "z.json", "unknown dtype 'float13'")


def test_duplicate_tensor_names(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    torch.save(torch.ones(2), d / "a.output.0.pt")
    ingest_refused(store, d, "a.output.0", "also given by")


def test_order_file_invalid_json(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "manifest.json").write_text('{"order": ["a.output.0",')
    ingest_refused(store, d, "manifest.json", "invalid JSON")


# ---- msprobe ----------------------------------------------------------------------

def _msprobe_copy(tmp_path, name="tensor_mix_fp32"):
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    for p in d.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (proc,) = (d / "step0").iterdir()
    return d, proc


def test_msprobe_invalid_json(store, tmp_path):
    d, proc = _msprobe_copy(tmp_path, "stat_mix_fp32_inner_ovf")
    text = (proc / "dump.json").read_text()
    (proc / "dump.json").write_text(text[: len(text) // 2])
    ingest_refused(store, d, "dump.json", "invalid JSON at line")


def test_msprobe_tensor_shape_disagrees_with_dump_json(store, tmp_path):
    d, proc = _msprobe_copy(tmp_path)
    torch.save(torch.ones(3, 3), proc / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    ingest_refused(store, d, "Functional.linear.0.forward.output.0.pt", "differs from the shape")


def test_msprobe_missing_tensor_file_is_a_warning(store, tmp_path):
    d, proc = _msprobe_copy(tmp_path)
    (proc / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt").unlink()
    name = ingest(d, store=store)
    w = store.df("SELECT file, message FROM warnings")
    assert len(w) == 1
    assert w.file[0].endswith("Functional.linear.0.forward.output.0.pt")
    assert "missing" in w.message[0] and "dump.json" in w.message[0]
    # the record is still there, with the statistics dump.json recorded and no histogram
    row = store.df("SELECT has_hist, max, nan_count FROM tensors WHERE op = 'Functional.linear.0.forward' "
                   "AND role = 'output'")
    assert len(row) == 1 and not row.has_hist[0]
    doc = json.loads((proc / "dump.json").read_text())
    assert row["max"][0] == doc["data"]["Functional.linear.0.forward"]["output"][0]["Max"]
    assert store.session(name).name == name



def test_msprobe_non_numeric_statistic_is_a_warning(store, tmp_path):
    d, proc = _msprobe_copy(tmp_path, "stat_mix_fp32_inner_ovf")
    doc = json.loads((proc / "dump.json").read_text())
    entry = doc["data"]["Functional.layer_norm.0.forward"]["input_args"][0]
    entry["Max"] = "abc"
    (proc / "dump.json").write_text(json.dumps(doc))
    ingest(d, store=store)
    w = store.df("SELECT file, message FROM warnings")
    assert len(w) == 1
    assert w.file[0] == str((proc / "dump.json").relative_to(d))
    assert "Functional.layer_norm.0.forward input 0" in w.message[0]
    assert "Max" in w.message[0] and "'abc'" in w.message[0] and "missing" in w.message[0]
    # stored as missing; the entry's other statistics are kept as dump.json has them
    row = store.df("SELECT max, min FROM tensors WHERE op = 'Functional.layer_norm.0.forward' "
                   "AND role = 'input' AND \"index\" = '0'")
    assert len(row) == 1 and (row["max"][0] is None or np.isnan(row["max"][0]))
    assert row["min"][0] == entry["Min"]


# ---- folders and paths --------------------------------------------------------------

def test_empty_folder(store, tmp_path):
    (tmp_path / "empty").mkdir()
    ingest_refused(store, tmp_path / "empty", "empty", "empty folder")


def test_folder_of_unsupported_files(store, tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    (d / "model.onnx").write_bytes(b"\x00" * 10)
    ingest_refused(store, d, "docs", "no tensor files found", ".txt", ".onnx")


def test_unsupported_file_beside_tensors_is_a_warning(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "README.md").write_text("notes")
    ingest(d, store=store)
    w = store.df("SELECT file, message FROM warnings")
    assert list(w.file) == ["README.md"]
    assert "unsupported file type '.md'" in w.message[0]
    assert store.sql("SELECT count(*) FROM tensors").fetchone()[0] == 2


@pytest.mark.slow
def test_missing_path_and_single_file(store, tmp_path):
    ingest_refused(store, tmp_path / "nope", "nope", "no such file or folder")
    np.save(tmp_path / "x.npy", np.ones(3))
    ingest_refused(store, tmp_path / "x.npy", "x.npy", "single file")


@pytest.mark.slow
def test_folder_of_ten_thousand_tiny_unreadable_files(store, tmp_path):
    d = tmp_path / "junk"
    d.mkdir()
    for i in range(10_000):
        (d / f"f{i}.log").write_bytes(b"x")
    ingest_refused(store, d, "junk", "no tensor files found", ".log (10000)")


# ---- zip archives -----------------------------------------------------------------

def _zip(path, entries):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            z.writestr(name, data)
    return path


def _npy_bytes(a):
    import io

    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def test_zip_slip(store, tmp_path):
    z = _zip(tmp_path / "slip.zip", [("ok.npy", _npy_bytes(np.ones(3))), ("../../evil.npy", _npy_bytes(np.ones(3)))])
    ingest_refused(store, z, "slip.zip", "../../evil.npy", "leaves the extraction folder")
    assert not (tmp_path.parent / "evil.npy").exists()


@pytest.mark.slow
def test_zip_absolute_path(store, tmp_path):
    z = _zip(tmp_path / "abs.zip", [("/tmp/abs_evil.npy", _npy_bytes(np.ones(3)))])
    ingest_refused(store, z, "abs.zip", "absolute path")
    z2 = _zip(tmp_path / "drive.zip", [("C:\\evil.npy", _npy_bytes(np.ones(3)))])
    ingest_refused(store, z2, "drive.zip", "absolute path")


def test_zip_symlink(store, tmp_path):
    p = tmp_path / "link.zip"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("a.npy", _npy_bytes(np.ones(3)))
        info = zipfile.ZipInfo("b.npy")
        info.create_system = 3
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, "/etc/passwd")
    ingest_refused(store, p, "link.zip", "'b.npy'", "symbolic link")


def test_zip_bomb_ratio(store, tmp_path):
    z = _zip(tmp_path / "bomb.zip", [("zeros.npy", _npy_bytes(np.zeros(1 << 19, np.float32)))])
    msg = ingest_refused(store, z, "bomb.zip", "zip bomb", "zeros.npy")
    assert "expands" in msg
    # the same archive passes once the limit is raised (the limits are configurable)
    assert ingest(z, store=store, zip_limits=ZipLimits(max_ratio=1e6))


@pytest.mark.slow
def test_zip_bomb_count_and_size(store, tmp_path):
    entries = [(f"t{i}.npy", _npy_bytes(np.ones(2, np.float32))) for i in range(30)]
    z = _zip(tmp_path / "many.zip", entries)
    ingest_refused(store, z, "many.zip", "30 entries", "limit of 20 files", zip_limits=ZipLimits(max_files=20))
    ingest_refused(store, z, "many.zip", "uncompressed size exceeds", zip_limits=ZipLimits(max_total_bytes=1000))


def test_zip_that_is_not_a_zip(store, tmp_path):
    p = tmp_path / "broken.zip"
    p.write_bytes(b"PK\x03\x04 definitely not a complete archive")
    ingest_refused(store, p, "broken.zip", "not a readable zip archive")


def test_check_zip_runs_before_anything_is_written(tmp_path):
    z = _zip(tmp_path / "mixed.zip", [("a.npy", b"x"), ("b/../../c.npy", b"y")])
    dest = tmp_path / "out"
    with pytest.raises(UnsafeZip):
        safe_extract(z, dest)
    assert not dest.exists() or not any(dest.iterdir())


def test_zip_depth_limit(tmp_path):
    z = _zip(tmp_path / "deep.zip", [("/".join(["d"] * 5) + "/x.npy", b"x")])
    with pytest.raises(UnsafeZip, match="nested 5 folders deep"):
        check_zip(z, ZipLimits(max_depth=4))
    assert check_zip(z, ZipLimits(max_depth=5))


def test_zip_limits_from_config():
    from precision_lab.config import ServerConfig

    cfg = ServerConfig(zip_max_files=7, zip_max_total_mb=3, zip_max_ratio=50.0, max_path_depth=9)
    lim = ZipLimits.from_config(cfg)
    assert (lim.max_files, lim.max_total_bytes, lim.max_ratio, lim.max_depth) == (7, 3 << 20, 50.0, 9)


# ---- headers, names and links that lie -------------------------------------------------

def test_non_utf8_file_name(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    with open(os.fsencode(d) + b"/\xff\xfe.output.0.npy", "wb") as f:
        np.save(f, np.ones(2, np.float32))
    ingest_refused(store, d, "\ufffd\ufffd.output.0.npy", "not valid UTF-8")


def test_npy_header_shape_disagrees_with_data(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    raw = _npy_bytes(np.ones(10, np.float32)).replace(b"(10,)", b"(2,) ")
    (d / "z.output.0.npy").write_bytes(raw)
    ingest_refused(store, d, "z.output.0.npy", "header says shape [2]",
            "holds 40 bytes")


def test_npy_header_claims_a_huge_array(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,), }"
    hdr = hdr + " " * (118 - len(hdr)) + "\n"
    (d / "h.output.0.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(hdr).to_bytes(2, "little") + hdr.encode() + b"\0" * 16)
    ingest_refused(store, d, "h.output.0.npy", "400000000000 bytes",
            "max_tensor_mb")


def test_empty_npy_file(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "e.output.0.npy").write_bytes(b"")
    ingest_refused(store, d, "e.output.0.npy", "not a .npy file")


@pytest.mark.slow
def test_safetensors_data_truncated_and_offsets_past_end(store, tmp_path):
    from safetensors.numpy import save

    d = tmp_path / "dump"
    _good(d)
    (d / "w.safetensors").write_bytes(save({"w": np.ones(100, np.float32)})[:-50])
    ingest_refused(store, d, "w.safetensors", "not a readable .safetensors")
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 400]}}).encode()
    (d / "w.safetensors").write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\0" * 16)
    ingest_refused(store, d, "w.safetensors", "offset")


def test_npz_holding_a_pickle(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    b = io.BytesIO()
    np.savez(b, a=np.array([{"x": 1}], dtype=object))
    (d / "z.npz").write_bytes(b.getvalue())
    ingest_refused(store, d, "z.npz", "Python objects")


@pytest.mark.parametrize("arr, words", [
    (np.array([1 + 2j, 3j]), ["complex"]),
    (np.array(["ab", "c"]), ["cannot compute numeric statistics"]),
    (np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]), ["cannot compute numeric statistics"]),
], ids=["complex", "strings", "structured"])
def test_non_numeric_dtypes_are_refused(store, tmp_path, arr, words):
    d = tmp_path / "dump"
    _good(d)
    np.save(d / "x.output.0.npy", arr)
    ingest_refused(store, d, "x.output.0.npy", *words)


def _msprobe(tmp_path, mutate) -> Path:
    import shutil

    d = tmp_path / "ms"
    shutil.copytree(SAMPLES / "stat_mix_fp16_inner_ovf", d)
    p = next(d.rglob("dump.json"))
    mutate(p)
    return d


def test_msprobe_json_not_utf8(store, tmp_path):
    def mutate(p):
        b = p.read_bytes()
        i = b.index(b"Functional.linear.0")
        p.write_bytes(b[:i] + b"\xff\xfe" + b[i:])

    ingest_refused(store, _msprobe(tmp_path, mutate), "dump.json",
            "not UTF-8")


@pytest.mark.slow
def test_msprobe_entry_not_an_object_and_bad_shape(store, tmp_path):
    def null_entry(p):
        j = json.loads(p.read_text())
        j["data"][next(iter(j["data"]))] = None
        p.write_text(json.dumps(j))

    ingest_refused(store, _msprobe(tmp_path, null_entry), "dump.json",
            "'Functional.layer_norm.0.forward' is not an object")

    def bad_shape(p):
        j = json.loads(p.read_text())
        j["data"][next(iter(j["data"]))]["output"][0]["shape"] = [-3, "x"]
        p.write_text(json.dumps(j))

    ingest_refused(store, _msprobe(tmp_path / "b", bad_shape), "dump.json",
            "[-3, 'x'] is not a list of sizes")


def test_symlink_to_a_file_outside_the_dump(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    outside = tmp_path / "secret.txt"
    outside.write_text("not a tensor")
    os.symlink(outside, d / "p.output.0.npy")
    msg = ingest_refused(store, d, "p.output.0.npy", "symbolic link")
    assert str(outside) not in msg


def test_folder_symlink_loop_is_refused_without_hanging(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    os.symlink(d, d / "loop")
    os.symlink("/", d / "root")
    ingest_refused(store, d, "loop", "symbolic link")


def test_fifo_named_npy_is_refused_without_opening_it(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    os.mkfifo(d / "f.output.0.npy")  # opening it for reading would block forever
    ingest_refused(store, d, "f.output.0.npy", "not a regular file")


# ---- unusual but valid: read, with numbers checked against numpy -----------------------------------

def _stats_of(store, name):
    return store.df("SELECT * FROM tensors WHERE name = ?", [name]).iloc[0]


@pytest.mark.parametrize("arr", [
    np.zeros((0, 4), np.float32),
    np.array(3.5, np.float32),
    np.array([-3, 7, 0, 2 ** 40], np.int64),
    np.array([0, 255, 7], np.uint8),
    np.array([True, False, True]),
    np.full(7, np.nan, np.float16),
    np.array([np.inf, -np.inf, 1.0, np.nan], np.float32),
], ids=["empty", "0-d", "int64", "uint8", "bool", "all-nan", "mixed-nonfinite"])
def test_unusual_arrays_are_read_exactly(store, tmp_path, arr):
    d = tmp_path / "dump"
    d.mkdir()
    np.save(d / "x.output.0.npy", arr)
    ingest(d, store=store)
    row = _stats_of(store, "x.output.0")
    x = arr.astype(np.float64).ravel()
    fin = x[np.isfinite(x)]
    assert row["numel"] == x.size
    assert json.loads(row["shape"]) == list(arr.shape)
    assert row["nan_count"] == np.isnan(x).sum() and row["inf_count"] == np.isinf(x).sum()
    assert bool(row["nonfinite"]) == bool((~np.isfinite(x)).any())
    if fin.size:
        assert row["min"] == fin.min() and row["max"] == fin.max()
        assert row["l2norm"] == pytest.approx(np.sqrt(np.sum(fin * fin)), rel=1e-12)
    else:
        assert row["min"] is None or np.isnan(row["min"])


@pytest.mark.slow
def test_all_nan_tensor_is_the_first_nonfinite_producer(store, tmp_path):
    from precision_lab.services.report import build_report

    d = tmp_path / "dump"
    d.mkdir()
    np.save(d / "a.output.0.npy", np.ones(3, np.float16))
    np.save(d / "b.output.0.npy", np.full(3, np.nan, np.float16))
    name = ingest(d, store=store)
    first = next(iter(build_report(store, name).first_nonfinite.values()))
    assert first.op == "b" and first.producer


def test_bare_nan_and_infinity_in_msprobe_json(store, tmp_path):
    def mutate(p):
        t = p.read_text()
        assert '"Max": 4.28515625' in t
        p.write_text(t.replace('"Max": 4.28515625', '"Max": NaN', 1).replace('"Min": -4.43359375', '"Min": -Infinity', 1))

    name = ingest(_msprobe(tmp_path, mutate), store=store)
    rows = store.df("SELECT name, max, min, nonfinite FROM tensors WHERE isnan(max) OR isinf(min)")
    assert len(rows) >= 1 and rows["nonfinite"].all()
    assert name


def test_very_long_and_hostile_op_names_are_stored_intact(store, tmp_path):
    long_op = "Functional." + "x" * 100_000 + ".0.forward"
    script_op = "Functional.<script>alert(1)</script>[a](http://e.x).0.forward"

    def mutate(p):
        j = json.loads(p.read_text())
        first = next(iter(j["data"].values()))
        j["data"][long_op] = first
        j["data"][script_op] = first
        p.write_text(json.dumps(j))

    ingest(_msprobe(tmp_path, mutate), store=store)
    names = set(store.df("SELECT op FROM tensors")["op"])
    assert any(len(n) > 100_000 for n in names)
    assert any("<script>alert(1)</script>[a](http://e.x)" in n for n in names)


def test_very_long_file_name(store, tmp_path):
    d = tmp_path / "dump"
    d.mkdir()
    name = "y" * 230 + ".output.0.npy"
    np.save(d / name, np.arange(4, dtype=np.float32))
    ingest(d, store=store)
    assert _stats_of(store, "y" * 230 + ".output.0")["max"] == 3.0


def test_a_zero_size_npy_numpy_cannot_allocate_is_named(store, tmp_path):
    """Found by the fuzzer: shape (0, 2**62) has no elements, yet numpy refuses to make it."""
    d = tmp_path / "dump"
    d.mkdir()
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4611686018427387904, ), }"
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    (d / "x.output.0.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    ingest_refused(store, d, "x.output.0.npy")
