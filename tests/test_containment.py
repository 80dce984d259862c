"""Nothing outside a dump is read, and what a dump declares is bounded before it is read.

Each test builds the hostile input, asserts the refusal names the entry, and
that the database is unchanged; the same input without the attack ingests.
"""

import io
import json
import os
import shutil
import zipfile

import numpy as np
import pytest
import torch

from precision_lab.readers.safeio import ReadLimits
from precision_lab.safezip import UnsafeZip, ZipLimits, check_zip, safe_extract
from precision_lab.services.ingest import ingest

from conftest import FIXTURES, ingest_refused

pytestmark = pytest.mark.held_store  # the content read and stored, not how the file is opened

PROC = "step0/proc22432"


def _counts(store):
    return tuple(store.sql(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("sessions", "runs", "tensors"))


def _tensor_dump(tmp_path, name="dump"):
    d = tmp_path / name
    shutil.copytree(FIXTURES / "tensor_mix_fp16", d)
    return d


def _point_data_name(d, data_name):
    """Make the first tensor entry of dump.json name ``data_name``."""
    p = d / PROC / "dump.json"
    doc = json.loads(p.read_text())
    first = doc["data"]["Functional.layer_norm.0.forward"]["input_args"][0]
    first["data_name"] = data_name
    p.write_text(json.dumps(doc))


@pytest.mark.slow
@pytest.mark.parametrize("escape", ["../../../../{secret}", "../../../../{missing}", "{abs_secret}", "{abs_missing}"])
def test_data_name_outside_the_dump_is_refused_alike_whether_or_not_it_exists(store, tmp_path, escape):
    secret = tmp_path / "secret.pt"
    torch.save(torch.full((2, 8, 32), 7.0, dtype=torch.float16), secret)
    d = _tensor_dump(tmp_path)
    name = escape.format(secret="secret.pt", missing="missing.pt", abs_secret=secret,
                         abs_missing=tmp_path / "missing.pt")
    _point_data_name(d, name)
    msg = ingest_refused(store, d)
    assert f"data_name of Functional.layer_norm.0.forward {name!r}" in msg
    assert msg.startswith(f"{PROC}/dump.json: ")
    kind = "is an absolute path" if name.startswith("/") else "points outside the dump"
    assert kind in msg and "only files inside the dump are read" in msg
    # the sentence depends on the name only: an existing and a missing target read alike
    other = name.replace("secret", "missing") if "secret" in name else name.replace("missing", "secret")
    _point_data_name(d, other)
    assert ingest_refused(store, d) == msg.replace(repr(name), repr(other))


def test_data_name_climbing_back_inside_is_read(store, tmp_path):
    d = _tensor_dump(tmp_path)
    _point_data_name(d, "../dump_tensor_data/Functional.layer_norm.0.forward.input.0.pt")
    ingest(d, store=store)
    assert _counts(store)[0] == 1


def test_data_name_that_is_a_symlink_is_not_followed(store, tmp_path):
    secret = tmp_path / "secret.pt"
    torch.save(torch.full((2, 8, 32), 7.0, dtype=torch.float16), secret)
    d = _tensor_dump(tmp_path)
    link = d / PROC / "dump_tensor_data" / "Functional.layer_norm.0.forward.input.0.pt"
    link.unlink()
    link.symlink_to(secret)
    msg = ingest_refused(store, d)
    assert "Functional.layer_norm.0.forward.input.0.pt: is a symbolic link" in msg
    assert str(secret) not in msg


def test_damaged_pt_is_refused_not_read_as_numbers(store, tmp_path):
    d = _tensor_dump(tmp_path)
    p = d / PROC / "dump_tensor_data" / "Functional.layer_norm.0.forward.input.0.pt"
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    h = info.header_offset  # the local header's own name and extra lengths (torch pads its extra field)
    start = h + 30 + int.from_bytes(raw[h + 26:h + 28], "little") + int.from_bytes(raw[h + 28:h + 30], "little")
    raw[start + 10] ^= 0x7F  # one byte of the tensor's data; torch itself would read it silently
    p.write_bytes(bytes(raw))
    assert torch.load(p, weights_only=True).shape == (2, 8, 32)  # torch does not notice
    msg = ingest_refused(store, d)
    assert "Functional.layer_norm.0.forward.input.0.pt: damaged .pt archive" in msg and "Bad CRC-32" in msg


def test_zero_stride_view_over_a_tiny_storage_is_refused(store, tmp_path):
    d = tmp_path / "views"
    d.mkdir()
    torch.save(torch.zeros(1).expand(1 << 28), d / "big.output.0.pt")  # 1 GiB of float32 from 4 bytes
    msg = ingest_refused(store, d, read_limits=ReadLimits(max_tensor_bytes=2 << 30))
    assert "big.output.0.pt" in msg and "views 4 stored bytes as 1073741824 bytes" in msg


def test_npz_member_header_claiming_more_than_it_holds(store, tmp_path):
    d = tmp_path / "npz"
    d.mkdir()
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (1 << 26,)})
    with zipfile.ZipFile(d / "x.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.npy", buf.getvalue() + b"\0" * 64)
    msg = ingest_refused(store, d)
    assert "x.npz: member 'a.npy'" in msg and "holds 64 bytes of data" in msg


@pytest.mark.slow
def test_tensor_limit_is_checked_from_the_header(store, tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    np.save(d / "a.output.0.npy", np.zeros(4096, np.float32))  # 16 KiB
    msg = ingest_refused(store, d, read_limits=ReadLimits(max_tensor_bytes=8 << 10))
    assert "a.output.0.npy" in msg and "16384 bytes" in msg and "max_tensor_mb" in msg
    assert ingest(d, store=store, read_limits=ReadLimits(max_tensor_bytes=16 << 10))


def test_safetensors_with_more_tensors_than_the_file_limit_is_refused_from_its_header(store, tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "st"
    d.mkdir()
    save_file({f"t{i}": torch.zeros(0) for i in range(50)}, str(d / "m.safetensors"))
    msg = ingest_refused(store, d, read_limits=ReadLimits(max_file_records=49))
    assert "m.safetensors: holds 50 tensors, more than the limit of 49" in msg


@pytest.mark.slow
def test_msprobe_shape_beyond_any_tensor_and_huge_statistic(store, tmp_path):
    d = tmp_path / "stat"
    shutil.copytree(FIXTURES / "stat_mix_fp16_inner_ovf", d)
    p = next(d.rglob("dump.json"))
    doc = json.loads(p.read_text())
    key = next(iter(doc["data"]))
    doc["data"][key]["input_args"][0]["Max"] = 10 ** 400  # JSON allows it; no float holds it
    p.write_text(json.dumps(doc))
    name = ingest(d, store=store)
    warn = store.sql("SELECT message FROM warnings").fetchall()
    assert any("statistic Max is" in w[0] and "not a number" in w[0] for w in warn), warn
    store.delete_session(name)
    doc["data"][key]["input_args"][0]["shape"] = [1 << 40, 1 << 40]
    p.write_text(json.dumps(doc))
    assert "has more elements than any tensor can hold" in ingest_refused(store, d)


@pytest.mark.parametrize("where", ["dump.json", "sidecar", "order"])
def test_deeply_nested_json_is_one_sentence(store, tmp_path, where):
    deep = "[" * 100_000 + "]" * 100_000
    if where == "dump.json":
        d = tmp_path / "m"
        (d / "step0" / "rank0").mkdir(parents=True)
        (d / "step0" / "rank0" / "dump.json").write_text('{"data": {"x": ' + deep + "}}")
        shown = "step0/rank0/dump.json"
    else:
        d = tmp_path / "g"
        d.mkdir()
        np.zeros(4, np.float32).tofile(d / "a.bin")
        (d / "a.json").write_text(deep if where == "sidecar" else json.dumps({"dtype": "float32", "shape": [4]}))
        if where == "order":
            (d / "order.json").write_text(deep)
        shown = "a.json" if where == "sidecar" else "order.json"
    msg = ingest_refused(store, d)
    assert msg.startswith(f"{shown}: ") and "nested too deeply" in msg


def test_zip_of_many_small_well_compressed_entries_is_refused_before_writing(tmp_path):
    z = tmp_path / "many.zip"
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf:
        for i in range(600):
            zf.writestr(f"d/{i}.npy", b"\0" * (60 << 10))  # 35 MiB from ~100 kB; each entry is under 64 KiB
    with pytest.raises(UnsafeZip, match="600 entries expand .*x in all"):
        safe_extract(z, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # a small archive of well-compressed entries is fine: the budget is relative and has a floor
    with zipfile.ZipFile(tmp_path / "small.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        for i in range(8):
            zf.writestr(f"d/{i}.npy", b"\0" * (60 << 10))
    assert len(check_zip(tmp_path / "small.zip")) == 8


def test_zip_entry_under_a_mebibyte_is_still_ratio_checked(tmp_path):
    z = tmp_path / "one.zip"
    with zipfile.ZipFile(z, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("x.npy", b"\0" * (1 << 20))
    with pytest.raises(UnsafeZip, match="expands .*x"):
        check_zip(z, ZipLimits())


def test_zip_file_and_folder_of_one_name_and_colons(tmp_path):
    z = tmp_path / "clash.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("d/a", b"1")
        zf.writestr("d/a/b.npy", b"2")
    with pytest.raises(UnsafeZip, match="'d/a' is both a file and a folder"):
        check_zip(z)
    z = tmp_path / "colon.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("d/step:0.npy", b"1")  # harmless on POSIX; only a drive letter is refused
        zf.writestr("C:/x.npy", b"2")
    with pytest.raises(UnsafeZip, match="'C:/x.npy' has an absolute path"):
        check_zip(z)


def test_fifo_does_not_hang_and_special_files_are_named(store, tmp_path):
    d = tmp_path / "fifo"
    d.mkdir()
    np.save(d / "a.output.0.npy", np.ones(3, np.float32))
    os.mkfifo(d / "b.output.0.npy")
    msg = ingest_refused(store, d)
    assert msg.startswith("b.output.0.npy: is not a regular file")
