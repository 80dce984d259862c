"""A dump's one-tensor ``.pt`` read into numpy without torch: the same numbers as ``torch.load``, and every
file it does not map (parameters, containers, fp8, anything hostile) either refused with one sentence or left
to torch's safe loader."""

from __future__ import annotations

import collections
import io
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._utils

from precision_lab.readers.base import ReadError
from precision_lab.readers.tensorfile import load_tensor_file
from precision_lab.readers.ptfile import NotPlain, read_plain_tensor
from precision_lab.readers.safeio import check_member_zip

ROOT = Path(__file__).resolve().parents[1]


def _plain(path: Path):
    return read_plain_tensor(path, path.name, check_member_zip(path, path.name, kind=".pt", crcs=False))


def _as_f64(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == bool else a.astype(np.float64)


@pytest.mark.parametrize("name, make", [
    ("transposed", lambda: torch.randn(5, 7).t()),
    ("offset slice", lambda: torch.arange(20.0)[5:15]),
    ("strided half column", lambda: torch.randn(3, 4).half()[:, 1]),
    ("bf16", lambda: torch.randn(9).bfloat16()),
    ("bool", lambda: torch.tensor([True, False, True])),
    ("int64", lambda: torch.arange(6).reshape(2, 3)),
    ("scalar", lambda: torch.tensor(3.5)),
    ("empty", lambda: torch.zeros(0, 3)),
    ("float64 with inf", lambda: torch.tensor([1.0, float("inf"), -float("inf"), float("nan")], dtype=torch.float64)),
])
def test_plain_tensors_read_the_numbers_torch_reads(tmp_path, name, make):
    t = make()
    path = tmp_path / "t.pt"
    torch.save(t, path)
    a = _plain(path)
    ref = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    assert a.shape == tuple(t.shape) and a.dtype.itemsize == t.element_size()
    assert np.array_equal(_as_f64(a), _as_f64(ref), equal_nan=True)
    assert not a.flags.writeable


@pytest.mark.parametrize("obj", [torch.nn.Parameter(torch.ones(2)), torch.randn(4).to(torch.float8_e4m3fn),
                                 {"a": torch.ones(2)}], ids=["parameter", "fp8", "dict"])
def test_what_is_not_one_plain_tensor_goes_to_torchs_safe_loader(tmp_path, obj):
    path = tmp_path / "t.pt"
    torch.save(obj, path)
    with pytest.raises(NotPlain):
        _plain(path)
    got = load_tensor_file(path, "t.pt")
    want = torch.load(path, weights_only=True)
    if isinstance(want, dict):
        assert set(got) == set(want)
    else:
        assert isinstance(got, torch.Tensor) and torch.equal(got.float(), want.float())


class _Ref:
    def __init__(self, key: str, numel: int, storage=torch.HalfStorage):
        self.key, self.numel, self.storage = key, numel, storage


class _Tensor:
    def __init__(self, ref: _Ref, offset: int, size: tuple, stride: tuple):
        self.args = (ref, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Ref):
            return ("storage", obj.storage, obj.key, "cpu", obj.numel)
        return None


def _craft(path: Path, obj, storages: dict[str, bytes]) -> Path:
    """A torch-style zip: data.pkl pickled here (any globals, any sizes), stored members as given."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", b"little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", b"3\n")
    return path


def test_a_crafted_file_with_the_rebuild_call_reads_like_torch(tmp_path):
    data = np.arange(12, dtype=np.float16)
    path = _craft(tmp_path / "ok.pt", _Tensor(_Ref("0", 12), 2, (2, 3), (1, 4)), {"0": data.tobytes()})
    want = torch.load(path, weights_only=True)
    assert np.array_equal(_plain(path), want.numpy())


@pytest.mark.parametrize("case, obj, storages, words", [
    ("storage shorter than declared", _Tensor(_Ref("0", 100), 0, (100,), (1,)), {"0": b"\0" * 20},
     "holds 20 bytes, not the 100 elements"),
    ("view past the storage", _Tensor(_Ref("0", 10), 5, (10,), (1,)), {"0": b"\0" * 20}, "reaches element 14"),
    ("storage member missing", _Tensor(_Ref("7", 10), 0, (10,), (1,)), {"0": b"\0" * 20}, "'7' is missing"),
    ("zero-stride bomb", _Tensor(_Ref("0", 1), 0, (1 << 20, 64), (0, 0)), {"0": b"\0\0"},
     "views 2 stored bytes"),
    ("over the tensor limit", _Tensor(_Ref("0", 1), 0, (1 << 40,), (0,)), {"0": b"\0\0"}, "more than the limit"),
])
def test_hostile_shapes_are_refused_with_one_sentence(tmp_path, case, obj, storages, words):
    path = _craft(tmp_path / "bad.pt", obj, storages)
    with pytest.raises(ReadError) as e:
        load_tensor_file(path, "bad.pt")
    msg = str(e.value)
    assert msg.startswith("bad.pt: ") and words in msg and "\n" not in msg


def test_a_damaged_storage_fails_its_crc(tmp_path):
    data = np.full(64, 7, dtype=np.float16).tobytes()
    path = _craft(tmp_path / "crc.pt", _Tensor(_Ref("0", 64), 0, (64,), (1,)), {"0": data})
    raw = bytearray(path.read_bytes())
    at = raw.find(data)
    raw[at + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ReadError, match=r"crc\.pt: damaged \.pt archive: entry 'archive/data/0' fails its check"):
        load_tensor_file(path, "crc.pt")


class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def test_a_pickle_that_calls_code_never_runs_it(tmp_path):
    marker = tmp_path / "ran"
    path = _craft(tmp_path / "evil.pt", (_System(f"touch {marker}"),), {})
    with pytest.raises(ReadError, match=r"evil\.pt: refused"):
        load_tensor_file(path, "evil.pt")
    assert not marker.exists()


@pytest.mark.slow
def test_compare_of_a_tensor_mode_msprobe_pair_does_not_import_torch(tmp_path):
    """The recorded msprobe tensor-mode dumps compare without torch (it is imported only where a file is not
    one plain tensor)."""
    data = ROOT / "tests" / "data" / "msprobe"
    pair = [data / "tensor_mix_fp32", data / "tensor_mix_fp16"]
    assert all(any(p.rglob("*.pt")) for p in pair)
    code = ("import sys\nfrom precision_lab.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n")
    out = subprocess.run([sys.executable, "-c", code, "compare", "--db", str(tmp_path / "c.duckdb"),
                          str(pair[0]), str(pair[1])], capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert "NO-TORCH" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def _u(text: str) -> bytes:
    b = text.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


def _tensor_pickle(size: bytes, stride: bytes, *, storage_state: bytes = b"", numel: int = 4) -> bytes:
    """data.pkl written opcode by opcode: _rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())."""
    return (b"\x80\x02c" + b"torch._utils\n_rebuild_tensor_v2\n" + b"(("
            + _u("storage") + b"ctorch\nHalfStorage\n" + _u("0") + _u("cpu") + b"J" + numel.to_bytes(4, "little")
            + b"tQ" + storage_state + b"K\x00" + size + stride
            + b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")


def _tuple(*ints: int) -> bytes:
    return b"(" + b"".join(b"\x8a\x08" + i.to_bytes(8, "little", signed=True) for i in ints) + b"t"


@pytest.mark.parametrize("case, pkl", [
    ("state set on the storage", _tensor_pickle(_tuple(4), _tuple(1), storage_state=b"}" + _u("data") + b"K\x01sb")),
    ("huge stride on a dimension of one", _tensor_pickle(_tuple(1, 4), _tuple(2 ** 62, 1))),
    ("empty with a huge dimension", _tensor_pickle(_tuple(0, 2 ** 62 + 1), _tuple(1, 1))),
    ("more dimensions than numpy holds", _tensor_pickle(_tuple(*[1] * 70), _tuple(*[1] * 70))),
], ids=["state-on-storage", "huge-stride-size-1", "empty-huge-dim", "70-dims"])
def test_odd_pickles_end_in_an_array_or_one_sentence(tmp_path, case, pkl):
    """Whatever the pickle says, the reader returns a tensor or says one sentence naming the file; never another
    exception (a traceback for the user)."""
    path = tmp_path / "odd.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/data/0", np.arange(4, dtype=np.float16).tobytes())
    try:
        got = load_tensor_file(path, "odd.pt")
    except ReadError as e:
        assert str(e).startswith("odd.pt: ") and "\n" not in str(e)
    else:
        assert isinstance(got, (np.ndarray, torch.Tensor))
        if case == "huge stride on a dimension of one":
            assert np.array_equal(np.asarray(got, dtype=np.float64), np.arange(4.0).reshape(1, 4))


def test_a_damaged_compressed_byteorder_is_one_sentence(tmp_path):
    data = np.arange(4, dtype=np.float16)
    path = _craft(tmp_path / "z.pt", _Tensor(_Ref("0", 4), 0, (4,), (1,)), {"0": data.tobytes()})
    # rewrite with a deflated byteorder member, then damage its compressed bytes
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(path, "w") as z:
        for n, b in members.items():
            z.writestr(n, b * 64 if n.endswith("byteorder") else b,
                       compress_type=zipfile.ZIP_DEFLATED if n.endswith("byteorder") else zipfile.ZIP_STORED)
    raw = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo("archive/byteorder")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[start:start + 4] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(raw))
    with pytest.raises(ReadError) as e:
        load_tensor_file(path, "z.pt")
    assert str(e.value).startswith("z.pt: ") and "\n" not in str(e.value)
