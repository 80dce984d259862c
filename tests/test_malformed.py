"""Malformed and hostile inputs: each gives a message naming the file and the
problem, and a failed ingest leaves nothing in the database."""

import json
import shutil
import stat
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from precision_lab.safezip import UnsafeZip, ZipLimits, check_zip, safe_extract
from precision_lab.services.ingest import IngestError, ingest

from conftest import FIXTURES


def _db_is_empty(store):
    for table in ("sessions", "runs", "tensors", "histograms", "comparisons", "warnings"):
        assert store.sql(f"SELECT count(*) FROM {table}").fetchone()[0] == 0, table


def _fails(store, path, *words, **kw):
    """Ingest must raise IngestError mentioning every word, and write nothing."""
    with pytest.raises(IngestError) as ei:
        ingest(path, store=store, **kw)
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    _db_is_empty(store)
    return msg


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
    _fails(store, d, "z.output.0.npy", "truncated")


def test_npy_with_bad_magic(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "z.npy").write_bytes(b"this is not numpy" * 4)
    _fails(store, d, "z.npy", "not a .npy file")


def test_npy_object_array_refused(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.save(d / "z.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    _fails(store, d, "z.npy", "Python objects")


def test_bad_npz(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.savez(d / "z.npz", x=np.ones(100, np.float32))
    data = (d / "z.npz").read_bytes()
    (d / "z.npz").write_bytes(data[: len(data) // 2])
    _fails(store, d, "z.npz", "not a readable .npz")


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
    msg = _fails(store, d, "z.pt", "refused", "weights_only")
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
    _fails(store, d, "Functional.linear.0.forward.output.0.pt", "refused")
    assert not marker.exists()


def test_truncated_pt(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    torch.save(torch.randn(100), d / "z.pt")
    data = (d / "z.pt").read_bytes()
    (d / "z.pt").write_bytes(data[: len(data) // 3])
    _fails(store, d, "z.pt", "truncated or corrupt")


def test_bad_safetensors_header(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    # 8-byte little-endian header length far beyond the file, then junk
    (d / "z.safetensors").write_bytes((10 ** 9).to_bytes(8, "little") + b"{not json")
    _fails(store, d, "z.safetensors", "not a readable .safetensors")


def test_safetensors_header_not_json(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    body = b"{this is not json}"
    (d / "z.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
    _fails(store, d, "z.safetensors", "not a readable .safetensors")


def test_bin_without_sidecar(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.ones(8, np.float32).tofile(d / "z.bin")
    _fails(store, d, "z.bin", "without a JSON sidecar")


def test_sidecar_shape_mismatch(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.ones(10, np.float16).tofile(d / "z.bin")
    (d / "z.json").write_text(json.dumps({"dtype": "float16", "shape": [4, 4]}))
    msg = _fails(store, d, "z.bin", "[4, 4]", "32 bytes", "20 bytes")
    assert "z.json" in msg


def test_sidecar_invalid_json_and_unknown_dtype(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    np.ones(4, np.float32).tofile(d / "z.bin")
    (d / "z.json").write_text("{dtype: float32")
    _fails(store, d, "z.json", "invalid JSON")
    (d / "z.json").write_text(json.dumps({"dtype": "float13", "shape": [4]}))
    _fails(store, d, "z.json", "unknown dtype 'float13'")


def test_duplicate_tensor_names(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    torch.save(torch.ones(2), d / "a.output.0.pt")
    _fails(store, d, "a.output.0", "also given by")


def test_order_file_invalid_json(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "manifest.json").write_text('{"order": ["a.output.0",')
    _fails(store, d, "manifest.json", "invalid JSON")


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
    _fails(store, d, "dump.json", "invalid JSON at line")


def test_msprobe_tensor_shape_disagrees_with_dump_json(store, tmp_path):
    d, proc = _msprobe_copy(tmp_path)
    torch.save(torch.ones(3, 3), proc / "dump_tensor_data" / "Functional.linear.0.forward.output.0.pt")
    _fails(store, d, "Functional.linear.0.forward.output.0.pt", "differs from the shape")


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
    assert store.session(name)["name"] == name



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
    _fails(store, tmp_path / "empty", "empty", "empty folder")


def test_folder_of_unsupported_files(store, tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "notes.txt").write_text("hello")
    (d / "model.onnx").write_bytes(b"\x00" * 10)
    _fails(store, d, "docs", "no tensor files found", ".txt", ".onnx")


def test_unsupported_file_beside_tensors_is_a_warning(store, tmp_path):
    d = tmp_path / "dump"
    _good(d)
    (d / "README.md").write_text("notes")
    ingest(d, store=store)
    w = store.df("SELECT file, message FROM warnings")
    assert list(w.file) == ["README.md"]
    assert "unsupported file type '.md'" in w.message[0]
    assert store.sql("SELECT count(*) FROM tensors").fetchone()[0] == 2


def test_missing_path_and_single_file(store, tmp_path):
    _fails(store, tmp_path / "nope", "nope", "no such file or folder")
    np.save(tmp_path / "x.npy", np.ones(3))
    _fails(store, tmp_path / "x.npy", "x.npy", "single file")


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
    _fails(store, z, "slip.zip", "../../evil.npy", "leaves the extraction folder")
    assert not (tmp_path.parent / "evil.npy").exists()


def test_zip_absolute_path(store, tmp_path):
    z = _zip(tmp_path / "abs.zip", [("/tmp/abs_evil.npy", _npy_bytes(np.ones(3)))])
    _fails(store, z, "abs.zip", "absolute path")
    z2 = _zip(tmp_path / "drive.zip", [("C:\\evil.npy", _npy_bytes(np.ones(3)))])
    _fails(store, z2, "drive.zip", "absolute path")


def test_zip_symlink(store, tmp_path):
    p = tmp_path / "link.zip"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("a.npy", _npy_bytes(np.ones(3)))
        info = zipfile.ZipInfo("b.npy")
        info.create_system = 3
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, "/etc/passwd")
    _fails(store, p, "link.zip", "'b.npy'", "symbolic link")


def test_zip_bomb_ratio(store, tmp_path):
    z = _zip(tmp_path / "bomb.zip", [("zeros.npy", _npy_bytes(np.zeros(1 << 19, np.float32)))])
    msg = _fails(store, z, "bomb.zip", "zip bomb", "zeros.npy")
    assert "expands" in msg
    # the same archive passes once the limit is raised (the limits are configurable)
    assert ingest(z, store=store, zip_limits=ZipLimits(max_ratio=1e6))


def test_zip_bomb_count_and_size(store, tmp_path):
    entries = [(f"t{i}.npy", _npy_bytes(np.ones(2, np.float32))) for i in range(30)]
    z = _zip(tmp_path / "many.zip", entries)
    _fails(store, z, "many.zip", "30 entries", "limit of 20 files", zip_limits=ZipLimits(max_files=20))
    _fails(store, z, "many.zip", "uncompressed size exceeds", zip_limits=ZipLimits(max_total_bytes=1000))


def test_zip_that_is_not_a_zip(store, tmp_path):
    p = tmp_path / "broken.zip"
    p.write_bytes(b"PK\x03\x04 definitely not a complete archive")
    _fails(store, p, "broken.zip", "not a readable zip archive")


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
