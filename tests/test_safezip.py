"""One zip validator (safezip.check_zip) for uploads and for the zips inside .npz/.pt files: each former call
site now gets the checks only the other made."""

import io
import stat
import zipfile
import zlib

import numpy as np
import pytest

from precision_lab.readers import ReadError
from precision_lab.readers.safeio import ReadLimits, check_member_zip, limits_in_force
from precision_lab.readers.tensorfile import read_tensors
from precision_lab.safezip import UnsafeZip, ZipLimits, check_zip, safe_extract


def _npy(a) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _zip(path, entries, method=zipfile.ZIP_STORED):
    """``entries``: (name, bytes) or (ZipInfo, bytes); duplicates are written as given."""
    with zipfile.ZipFile(path, "w", method) as z:
        for name, data in entries:
            z.writestr(name, data)
    return path


def _read_npz(path):
    return [k for k, _ in read_tensors(path, path.name, path.parent)]


# ---- the zip inside an .npz gets the upload checks ---------------------------------------------

def test_npz_member_that_climbs_out_is_refused(tmp_path):
    z = _zip(tmp_path / "z.npz", [("../../w.npy", _npy(np.ones(3, np.float32)))])
    with pytest.raises(ReadError, match=r"^z\.npz: entry '\.\./\.\./w\.npy' has a path that leaves"):
        _read_npz(z)


def test_npz_member_that_is_a_symlink_is_refused(tmp_path):
    info = zipfile.ZipInfo("w.npy")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    info.create_system = 3
    z = _zip(tmp_path / "z.npz", [(info, b"/etc/passwd")])
    with pytest.raises(ReadError, match=r"^z\.npz: entry 'w\.npy' is a symbolic link"):
        _read_npz(z)


def test_npz_member_twice_is_refused(tmp_path):
    with pytest.warns(UserWarning):  # zipfile says so too, and writes it
        z = _zip(tmp_path / "z.npz", [("w.npy", _npy(np.ones(3, np.float32))), ("w.npy", _npy(np.zeros(3, np.float32)))])
    with pytest.raises(ReadError, match=r"^z\.npz: entry 'w\.npy' appears more than once"):
        _read_npz(z)


def test_npz_of_many_small_members_that_add_up_to_a_bomb(tmp_path):
    """Each member is below the size where its own ratio is checked (64 KiB); together they expand about
    300 times past 16 MiB: the archive-wide ratio, once an upload check only, refuses it."""
    zeros = _npy(np.zeros(60_000 // 4, np.float32))
    z = _zip(tmp_path / "z.npz", [(f"m{i}.npy", zeros) for i in range(300)], method=zipfile.ZIP_DEFLATED)
    total = sum(i.file_size for i in zipfile.ZipFile(z).infolist())
    size = z.stat().st_size
    assert total > 16 << 20 and total > 200 * size and max(i.file_size for i in zipfile.ZipFile(z).infolist()) < 64 << 10
    with pytest.raises(ReadError, match=rf"^z\.npz: 300 entries expand {total / size:.0f}x in all .*zip_max_ratio"):
        _read_npz(z)
    # the same members, fewer of them, stay under 16 MiB and are read
    small = _zip(tmp_path / "s.npz", [(f"m{i}.npy", zeros) for i in range(20)], method=zipfile.ZIP_DEFLATED)
    assert len(_read_npz(small)) == 20


def test_member_limits_name_the_reader_settings(tmp_path):
    a = np.arange(1000, dtype=np.float32)
    z = _zip(tmp_path / "z.npz", [("w.npy", _npy(a))])
    with limits_in_force(ReadLimits(max_tensor_bytes=3000)):
        with pytest.raises(ReadError, match=rf"^z\.npz: entry 'w\.npy' expands to {len(_npy(a))} bytes, more than "
                                            r"the limit of 3000 bytes \(max_tensor_mb\)$"):
            _read_npz(z)
    many = _zip(tmp_path / "m.npz", [(f"m{i}.npy", _npy(a[:2])) for i in range(20)])
    with limits_in_force(ReadLimits(max_file_records=3)):
        with pytest.raises(ReadError, match=r"^m\.npz: 20 entries exceed the limit of 19 files .*max_file_records"):
            _read_npz(many)


def test_pt_members_read_whole_are_bounded_together(tmp_path):
    import torch

    p = tmp_path / "t.pt"
    torch.save({"a": torch.zeros(600), "b": torch.zeros(600)}, p)  # 2400 bytes each, 4800 together
    with limits_in_force(ReadLimits(max_tensor_bytes=4000)):
        assert len(check_member_zip(p, "t.pt", kind=".pt")) > 2  # one at a time: within the limit
        with pytest.raises(ReadError, match=r"^t\.pt: uncompressed size exceeds the limit of 4000 bytes"):
            check_member_zip(p, "t.pt", kind=".pt", loaded_whole=True)


# ---- uploads get the CRC check and a per-entry bound when asked ---------------------------------------

def _flip_stored_byte(path, name):
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    raw = bytearray(path.read_bytes())
    head = raw[info.header_offset:info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")
    raw[start + 100] ^= 0x01
    path.write_bytes(bytes(raw))
    return bytes(raw[start:start + info.file_size]), info.CRC


def test_upload_zip_crc_is_checked_before_and_during_extraction(tmp_path):
    a = np.linspace(0, 1, 256, dtype=np.float32)
    z = _zip(tmp_path / "up.zip", [("dump/a.output.0.npy", _npy(a))])
    data, crc = _flip_stored_byte(z, "dump/a.output.0.npy")
    assert zlib.crc32(data) != crc  # independent: the damaged bytes no longer match the recorded CRC-32
    assert len(check_zip(z)) == 1  # the declared sizes alone cannot tell
    with pytest.raises(UnsafeZip, match=r"up\.zip: damaged zip archive: entry 'dump/a\.output\.0\.npy' fails its "
                                        r"check \(Bad CRC-32"):
        check_zip(z, crcs=True)
    with pytest.raises(UnsafeZip, match=r"entry 'dump/a\.output\.0\.npy' is corrupt \(Bad CRC-32"):
        safe_extract(z, tmp_path / "out")


def test_upload_messages_name_the_setting_to_raise(tmp_path):
    z = _zip(tmp_path / "big.zip", [(f"d/{i}.npy", _npy(np.ones(300, np.float32))) for i in range(4)])
    with pytest.raises(UnsafeZip, match=r"4 entries exceed the limit of 3 files \(zip bomb protection; raise "
                                        r"zip_max_files if the archive is trusted\)"):
        check_zip(z, ZipLimits(max_files=3))
    with pytest.raises(UnsafeZip, match=r"entry 'd/0\.npy' expands to 1328 bytes, more than the limit of 1000 bytes"):
        check_zip(z, ZipLimits(max_entry_bytes=1000))
